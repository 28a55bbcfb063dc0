"""The one exception type of mistakes a user can fix: a bad config value, a data file that does
not fit its reader or schema, a command-line misuse. The command line prints such an error as
its message alone (exit code 2); every other exception is a bug of ours and keeps its traceback.

It subclasses ValueError, so code that catches ValueError keeps catching it."""
from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix; the message names the parameter or the file and line, the
    value, and what is allowed."""
