"""The one exception type the converter raises for problems a user can fix."""


class ConvertError(Exception):
    """A problem the user can fix; the CLI prints str(err) as one line and exits 2.

    The message names the thing that is wrong (file:line, bucket, option) and how to fix it.
    """
