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
    """Base class of every error the library raises on purpose.

    Raised as such (not as a subclass) when a collective call finds no process group although a launcher
    set ``WORLD_SIZE`` > 1, and by `elastic.run` when no generation forms within ``join_timeout``, when
    no rendezvous store is reachable, when the ranks of a generation were in different operations (the
    script's bug) or when generations keep failing before a step completes. Catch it to catch them all.
    """


class StateMismatchError(ElasticError):
    """Ranks hold states of different schemas (class, fields, kinds or module shapes).

    Raised by `elastic.sync` (and everything built on it) on every rank, before any tensor moves; the
    message names the ranks and the fields that differ.
    """


class TenureError(ElasticError):
    """Tenures could not be computed or compared (the tenure function raised, NaN, incomparable types).

    Raised on every rank by the calls that elect a source (`elastic.sync`, `elastic.load`,
    `elastic.save`, `elastic.most_tenured_rank`), naming the rank and the cause.
    """


class SyncError(ElasticError):
    """A collective call failed or timed out on some rank; the message names the phase and the rank.

    Raised on every rank that takes part: a peer died, raised or never called, or a value could not be
    sent. Receivers that may be half-written are marked *torn* (their tenure counts as None until their
    next successful sync or load); the source is never modified.

    Attributes:
        phase: the phase that failed (``"elect"``, ``"objects"``, ``"apply"``, ``"save-elect"``, ...),
            when known.
        op: the library call that failed (``"sync"``, ``"save"``, ...), when known.
    """

    def __init__(self, msg: str, *, phase: str | None = None, op: str | None = None) -> None:
        super().__init__(msg)
        self.phase = phase
        #: the library call that failed ("sync", "save", ...), when known
        self.op = op


class CheckpointError(ElasticError):
    """A checkpoint could not be written or read.

    Raised on every rank by `elastic.save`, `elastic.load` and `SaveHandle.wait`, naming the writer or
    the reader, the path or URL and the fix (free space, permissions, a missing bucket, credentials).
    Older checkpoints stay valid.
    """


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, truncated or altered).

    `elastic.load` raises it only when its ``path`` names that one checkpoint; under a root of
    checkpoints a damaged one is skipped with a warning and the next most tenured one is used.
    """


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's fields or module shapes do not match the state's.

    Raised by `elastic.load` before anything changes (``strict=False`` tolerates added or removed
    fields, not changed shapes), and by a state's ``load_state_dict`` when a target lacks tensors the
    checkpoint holds.
    """


class UntrustedCheckpointError(CheckpointError):
    """Loading would unpickle arbitrary objects and ``trusted=True`` was not given.

    Raised by `elastic.load`; the message names the fields stored as pickles and the fix (pass
    ``trusted=True`` for checkpoints you wrote yourself).
    """


class DivergenceError(ElasticError):
    """Replicas that should be identical differ.

    Raised by `elastic.verify` on every rank, naming each field or tensor path that differs and which
    ranks hold which version.
    """


class WorkerError(ElasticError):
    """A worker started by `elastic.spawn` failed, or the run timed out.

    Attributes:
        rank: the failing worker's rank (its slot with ``restart="worker"``), or None for a timeout.
        exc_type: the name of the exception the worker raised, or None when it died without one.
        exc_message: that exception's message.
        remote_traceback: the worker's formatted traceback.
    """

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
