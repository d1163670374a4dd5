"""Errors of the lease core."""

from __future__ import annotations


class LeaseError(Exception):
    """Base class of every error this package raises.

    Attributes:
      key: the lease key concerned, when there is one.
      actor: the actor concerned, when there is one (errors of the Dramatiq middleware).
    """

    def __init__(self, *args: object, key: str | None = None, actor: str | None = None) -> None:
        super().__init__(*args)
        self.key = key
        self.actor = actor


class LeaseConfigError(LeaseError, ValueError):
    """An option has a value that cannot work (raised where it is declared)."""


class LeaseKeyError(LeaseError, ValueError):
    """A lease key is not a non-empty string, or cannot be rendered from arguments."""


class LeaseUnavailableError(LeaseError):
    """Redis could not be reached or answered with an error; nothing was granted."""
