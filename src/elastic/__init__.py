"""elastic-state: the training state of elastic data-parallel PyTorch jobs.

Decorate an attrs class with `@elastic_state(tenure=...)`; `sync`, `save` and `load` elect the most
tenured state in the group and give it to every rank.
"""

from elastic._methods import StateMethods
from elastic._util.errors import (
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
from elastic.checkpoint.saveload import LoadReport, SaveHandle, load, save
from elastic.data.sampler import ElasticSampler
from elastic.launch.process_group import init_process_group
from elastic.launch.spawn import spawn
from elastic.recovery.run import World, run
from elastic.replication.sync import SyncReport, broadcast_state, most_tenured_rank, sync, tenure
from elastic.replication.verify import verify
from elastic.state.decorator import elastic_state
from elastic.state.fields import field, local

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
    "StateMethods",
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
