"""Errors a user can act on: the command line prints them as one line and exits with code 2."""


class EdgerunError(Exception):
    """Bad input or an unusable environment, explained in the message."""
