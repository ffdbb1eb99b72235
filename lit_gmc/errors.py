"""Errors a user caused (an option, a config file, a data file, a checkpoint), told apart from bugs.

``python -m lit_gmc`` prints a :class:`UserError` as one line, ``lit_gmc: error: <message>``, and exits with status 2
(argparse's for a bad option); any other exception keeps its traceback. So a ``UserError`` must stand alone: name
the option, file (and line) or checkpoint, and say what is wrong with it.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem the user can fix from the message alone: a bad option, config file, data file or checkpoint.

    A ``ValueError``, so code that validated with ``ValueError`` before still catches it.
    """


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (still a ``FileNotFoundError`` for callers catching that)."""


class UserConnectionError(UserError, ConnectionError):
    """A hub source the user named cannot be reached (offline); still a ``ConnectionError`` for callers."""
