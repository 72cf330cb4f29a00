"""Errors raised by the bisect engine (both subclass :class:`moereplay.errors.MoereplayError`).

MoereplayError
├── BisectError            a search or session is used wrongly (observing a finished search, bad configuration)
│   └── BisectLogError     a session log is unreadable or belongs to another search
└── ReplayUnavailableError the replay engine the CLI wires predicates to is missing
"""

from __future__ import annotations

from moereplay.errors import MoereplayError


class BisectError(MoereplayError):
    """A bisect search or session was configured or driven in a way it cannot honour."""


class BisectLogError(BisectError):
    """A session log is malformed, truncated in its middle, or was written for a different search."""


class ReplayUnavailableError(MoereplayError):
    """The replay engine (``moereplay.replay``) that bisect predicates are built on is not available."""
