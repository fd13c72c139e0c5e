"""The one error the storage layer raises; each command turns it into its own one-line message."""


class StorageError(RuntimeError):
    """A file or object could not be read or written (after the retries of the policy in force).

    The message is one line that names the location, the operation and, for S3, the endpoint and
    what to check. `missing` is True when the failure is only that the object does not exist.
    """

    def __init__(self, message: str, *, missing: bool = False):
        super().__init__(message)
        self.missing = missing
