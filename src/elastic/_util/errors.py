"""The exception hierarchy. Every error the library raises on purpose derives from `ElasticError`."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "DivergenceError",
    "ElasticError",
    "StateMismatchError",
    "SyncError",
    "TenureError",
    "UntrustedCheckpointError",
    "WorkerError",
]


class ElasticError(Exception):
    """Base class of every error raised by `elastic`."""


class StateMismatchError(ElasticError):
    """Ranks hold states of different schemas (class, fields, kinds or module shapes)."""


class TenureError(ElasticError):
    """Tenures could not be computed or compared (raised, NaN, incomparable types)."""


class SyncError(ElasticError):
    """A collective transfer failed or timed out; the message names the phase and the rank."""

    def __init__(self, msg: str, *, phase: str | None = None, op: str | None = None) -> None:
        super().__init__(msg)
        self.phase = phase
        #: the library call that failed ("sync", "save", ...), when known
        self.op = op


class CheckpointError(ElasticError):
    """A checkpoint could not be written or read."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, truncated or altered)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's fields do not match the state's fields (see `strict=`)."""


class UntrustedCheckpointError(CheckpointError):
    """Loading would unpickle arbitrary objects and `trusted=True` was not given."""


class DivergenceError(ElasticError):
    """Replicas that should be identical differ (raised by `verify`)."""


class WorkerError(ElasticError):
    """A worker started by `spawn` failed, or the run timed out."""

    def __init__(
        self,
        msg: str,
        *,
        rank: int | None = None,
        exc_type: str | None = None,
        exc_message: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(msg)
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
