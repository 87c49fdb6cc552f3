"""Errors that are the user's to fix: printed without a traceback, exit code 2."""


class UserError(Exception):
    """A bad input, spec, file or argument. The message names the file/key and what is wrong."""
