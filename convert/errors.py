"""The one exception type the converter raises for problems a user can fix."""


class ConvertError(Exception):
    """A problem the user can fix; the CLI prints str(err) as one line and exits 2.

    The message names the thing that is wrong (file:line, bucket, option) and how to fix it.
    """


class DamagedFile(ConvertError):
    """A file this conversion wrote earlier (a task's pieces, a sorted run, a merge stage's output)
    that does not read back as it was written: truncated, a flipped bit, missing. Whoever knows
    which step wrote it (a task, a merge stage) turns it into the line that says what to re-run."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url} is damaged ({reason})")
        self.url, self.reason = url, reason

    def __reduce__(self):  # raised in worker processes: pickled with its fields
        return (DamagedFile, (self.url, self.reason))
