"""elastic-state: the training state of elastic data-parallel PyTorch jobs.

Decorate an attrs class with `@elastic_state(tenure=...)`; `sync`, `save` and `load` elect the most
tenured state in the group and give it to every rank.
"""

from ._checkpoint import LoadReport, SaveHandle, load, save
from ._decorator import elastic_state
from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    DivergenceError,
    ElasticError,
    StateMismatchError,
    SyncError,
    TenureError,
    UntrustedCheckpointError,
    WorkerError,
)
from ._fields import field, local
from ._process_group import init_process_group
from ._run import World, run
from ._sampler import ElasticSampler
from ._spawn import spawn
from ._sync import SyncReport, broadcast_state, most_tenured_rank, sync, tenure
from ._verify import verify
from ._version import __version__

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "DivergenceError",
    "ElasticError",
    "ElasticSampler",
    "LoadReport",
    "SaveHandle",
    "StateMismatchError",
    "SyncError",
    "SyncReport",
    "TenureError",
    "UntrustedCheckpointError",
    "World",
    "WorkerError",
    "broadcast_state",
    "elastic_state",
    "field",
    "init_process_group",
    "load",
    "local",
    "most_tenured_rank",
    "run",
    "save",
    "spawn",
    "sync",
    "tenure",
    "verify",
    "__version__",
]
