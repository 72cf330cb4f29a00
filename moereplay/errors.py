"""The one exception root of moereplay and its hierarchy.

MoereplayError
├── CaptureFileError        a capture file is unreadable: bad magic, version, hash, structure, size claims
│   ├── TruncatedFileError  the file ends inside a frame (recoverable up to the last whole frame)
│   └── MemoryBudgetError   loading a call would allocate more than the reader's memory budget
├── UnsupportedValueError   a recorded value has no codec, or a value cannot be encoded
├── SettingsError           a MOEREPLAY_* setting or CLI option is malformed
├── PackError               a kernel pack is missing, malformed, or built for another torch
├── ReplayError             a call cannot be replayed as asked
│   ├── UnknownOpError      the capture names an op no ``ops/`` module declares
│   └── InvalidMutationError a mutation names an unknown argument or leaves the op's legal domain
└── ReferenceError_         a reference cannot compute this call (unsupported quant type, inconsistent sizes)

The CLI catches MoereplayError, prints ``moereplay: <message>`` on one line to stderr and exits 2.
"""

from __future__ import annotations


class MoereplayError(Exception):
    """Root of every error moereplay raises on purpose."""


class CaptureFileError(MoereplayError):
    """A capture file cannot be read as format v1."""


class TruncatedFileError(CaptureFileError):
    """A capture file ends in the middle of a frame. ``record_end``: where the cut record would have ended, when
    its envelope was whole (so a reader can say how many bytes are missing); ``kind``: that record's kind."""

    def __init__(self, message: str, *, record_end: int | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.record_end = record_end
        self.kind = kind


class FileLimitError(CaptureFileError):
    """A record would take a capture file past its byte limit (``MOEREPLAY_MAX_BYTES``); nothing of it was written."""


class MemoryBudgetError(CaptureFileError):
    """Loading a call would allocate more than the reader's memory budget (``MOEREPLAY_LOAD_BUDGET``)."""


class UnsupportedValueError(MoereplayError):
    """A value has no codec (recording), or a recorded value is marked unsupported (replay)."""


class SettingsError(MoereplayError):
    """A setting from the environment or the command line is malformed."""


class PackError(MoereplayError):
    """A kernel pack is missing, malformed or incompatible with the running torch."""


class ReplayError(MoereplayError):
    """A captured call cannot be replayed as asked."""


class UnknownOpError(ReplayError):
    """The capture names an op that no ops module declares."""


class InvalidMutationError(ReplayError):
    """A mutation names an unknown argument or a value outside the op's legal domain."""


class ReferenceError_(MoereplayError):
    """The reference cannot compute this call."""
