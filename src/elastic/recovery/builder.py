"""`run` with a builder: a sharded state rebuilt on each generation's mesh and filled in memory.

``run(fn, build, mesh=...)``: `MeshPlan` turns the live worker count into the generation's mesh shape
(``mesh(n)``) and names, and tells the rendezvous how many of `n` workers the mesh uses (`fit`: the others
wait as spares, heartbeating, and are admitted first at the next change). `Built` keeps the state across
generations: at the start of each one the previous state's pieces are held (`elastic.replication.reshard`;
FSDP2 modules resharded first, in case a failure struck between an all-gather and its reshard), the old
state is dropped, ``build(world)`` makes the new one on ``world.mesh`` and it is filled from the held
pieces, every byte moved at most once, never through a disk. Sources, in order: live pieces at their
tenure, then in-memory snapshots (``snapshot_every=k``: `elastic.replication.snapshot`), then ``ckpt``, then
a fresh sync (a first generation where nobody holds anything); nobody holding a whole version and no
``ckpt``: the `SyncError` naming what is missing. A generation that fails while filling keeps the held
pieces and snapshots for the next one: nothing half-filled is ever trained on.

When the mesh stays (a spare took a lost member's place, a worker joined as a spare, or left one) the state's
objects are kept: at the end of a generation the state lets go of its process groups (`elastic.state.binding`:
FSDP2 binds its modules and DTensors to them, and a peer blocked on this rank must fail at once), and a rank
whose coordinate on the new mesh is the one it had points the same modules, parameters and optimizer at
the new mesh's groups. Its held pieces are then its own tensors: the fill moves nothing into it, and only
newcomers (built as above) receive. The rendezvous keeps survivors at their ranks for this (`fit`).
"""

from __future__ import annotations

import gc
import logging
import math
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import torch

from elastic._util.errors import ElasticError, SyncError
from elastic.checkpoint.saveload import load
from elastic.replication.collective import Collective
from elastic.replication.reshard import Held, hold, reshard
from elastic.replication.snapshot import Snapshots, ring_peers
from elastic.replication.sync import sync, tenure
from elastic.state.binding import Binding, rebind, unbind
from elastic.state.config import config_of, is_elastic_state
from elastic.state.lineage import lineage
from elastic.state.shards import is_sharded, layout_of

__all__ = ["Built", "MeshPlan", "warm_up"]

log = logging.getLogger("elastic")


@attrs.frozen
class MeshPlan:
    """The user's ``mesh(n)`` and ``mesh_dim_names``, checked."""

    shape_of: Callable[[int], Any]
    names: tuple[str, ...] | None = None

    def shape(self, n: int) -> tuple[int, ...]:
        """The mesh shape for `n` live workers (`ValueError` unless positive ints, product <= n)."""
        try:
            raw = self.shape_of(n)
            shape = tuple(int(d) for d in (raw if isinstance(raw, (tuple, list)) else (raw,)))
        except Exception as exc:
            msg = f"elastic.run(mesh=...): mesh({n}) raised {type(exc).__name__}: {exc}"
            raise ValueError(msg) from exc
        if not shape or any(d < 1 for d in shape) or math.prod(shape) > n:
            msg = (
                f"elastic.run(mesh=...): mesh({n}) returned {raw!r}; it must be a tuple of positive ints "
                f"whose product is at most the {n} live workers (the rest wait as spares)"
            )
            raise ValueError(msg)
        return shape

    def dim_names(self, shape: tuple[int, ...]) -> tuple[str, ...]:
        if self.names is not None:
            if len(self.names) != len(shape):
                msg = f"elastic.run(mesh_dim_names={self.names!r}) does not match the mesh shape {shape}"
                raise ValueError(msg)
            return self.names
        if len(shape) == 1:
            return ("shard",)
        if len(shape) == 2:
            return ("replicate", "shard")
        msg = f"elastic.run: a {len(shape)}-D mesh {shape} needs mesh_dim_names=(...)"
        raise ValueError(msg)

    def fit(self, n: int) -> int:
        """How many of `n` workers the mesh uses (all of them when ``mesh(n)`` is invalid: the generation
        then raises the clear error)."""
        try:
            return math.prod(self.shape(n))
        except ValueError:
            return n


def _reshard_fsdp(state: Any) -> None:
    """Put every FSDP2 module of `state` back in its sharded form (local; after a failure mid-step)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for name in attrs.fields_dict(type(state)):
        value = getattr(state, name, None)
        if isinstance(value, torch.nn.Module):
            for m in value.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()


def _forget_meshes() -> None:
    """Empty torch's DTensor caches whose keys compare meshes by value (ranks, shape, names).

    A generation's mesh equals the last one when the shape stays, but a rank may sit elsewhere in it (a
    spare admitted at rank 0 moves every survivor up). The cached sharding propagations would give the new
    state's DTensors (``detach``, ``zeros_like``: its state dict, Adam's moments) the old ``DeviceMesh``,
    with the old rank's coordinate: wrong pieces planned, saved and redistributed. Local, a few ms."""
    try:
        from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    except ImportError:  # pragma: no cover - torch without DTensor
        return
    # what torch.distributed.tensor.debug._clear_sharding_prop_cache does (importing it takes ~1.7 s)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


@attrs.define
class Built:
    """The state of a builder `run` across generations, and the pieces held while a new one is filled."""

    build: Callable[[Any], Any]
    plan: MeshPlan
    ckpt: Any
    timeout: timedelta
    snapshot_every: int | None = None
    state: Any = None
    held: Held | None = None
    #: the generation whose mesh `state` (and so `held`) was built on
    layout: int = 0
    snapshots: Snapshots = attrs.field(factory=Snapshots)
    #: the released state, unbound from its groups, kept for a next generation on the same mesh
    kept: Any = None
    binding: Binding | None = None
    #: the generation's mesh groups, to tell whether anything still holds them once destroyed
    groups: list[weakref.ref[Any]] = attrs.field(factory=list)
    #: the mesh of a kept state dropped in this generation (the mesh changed), to collect it once filled
    dropped: weakref.ref[Any] | None = None

    def release(self, *, wait: bool = False) -> None:
        """The generation is over: keep the state's pieces and make the state let go of the generation's
        process groups (FSDP2 keeps its own references to them): their sockets close when the group is
        destroyed, and a peer still blocked on this rank fails at once. The state itself is kept for a
        next generation on the same mesh; one that cannot be unbound (or is torn) is dropped. A snapshot
        in flight is waited for when the generation ended by agreement (`wait`), else abandoned."""
        self.snapshots.close(wait=wait)
        old, self.state = self.state, None
        self.kept = self.binding = None
        if old is not None:
            torn = lineage(old).torn
            if not torn:
                _reshard_fsdp(old)
                self.held = hold(old, tenure(old), self.layout)
            binding = unbind(old)
            if binding is not None and not torn:
                self.kept, self.binding = old, binding
        old = None
        _forget_meshes()  # torch's DTensor caches hold the mesh, and it the groups

    def groups_alive(self) -> bool:
        """Whether something still holds one of the ended generation's mesh groups (after their
        destruction: a state that could not be unbound, a reference cycle; `gc.collect` then frees it)."""
        alive = any(ref() is not None for ref in self.groups)
        self.groups = []
        return alive

    def snapshot(self) -> None:
        """Every `snapshot_every`-th ``world.check()``: a snapshot of the state (`Snapshots.take`)."""
        if self.state is not None:
            _reshard_fsdp(self.state)  # an FSDP2 module left unsharded (reshard_after_forward=False) holds
            # whole parameters: its shards are what the snapshot copies
            self.snapshots.take(self.state, tenure(self.state))  # torn: None, the round withheld

    def start(self, world: Any) -> tuple[int, Any]:
        """The generation's mesh, the new state and its filling. (source rank, tenure)"""
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.plan.shape(world.size)
        if math.prod(shape) != world.size:  # the rendezvous admitted exactly the mesh's product
            msg = f"elastic.run: generation of {world.size} workers but mesh({world.size}) = {shape}"
            raise ValueError(msg)
        device = "cuda" if dist_backend() == "nccl" else "cpu"
        _forget_meshes()
        began = time.monotonic()
        world.mesh = init_device_mesh(device, shape, mesh_dim_names=self.plan.dim_names(shape))
        self.groups = []
        for dim in range(len(shape)):  # the mesh's groups get torch's default (30 min), not run's timeout
            world.mesh.get_group(dim).set_timeout(self.timeout)
            self.groups.append(weakref.ref(world.mesh.get_group(dim)))
        if self.state is not None:  # (released when the last generation ended) the old state goes first
            self.release()
        meshed = time.monotonic()
        new = self._keep(world)
        kept = new is not None
        if new is None:
            new = self.build(world)
            config_of(new, "elastic.run(fn, build): build(world)")
            if not is_elastic_state(new) or not is_sharded(new):
                msg = (
                    "elastic.run(fn, build): build(world) must return an @elastic_state instance whose "
                    "model is sharded on world.mesh (fully_shard(..., mesh=world.mesh)); got "
                    f"{type(new).__qualname__}"
                )
                raise TypeError(msg)
        built = time.monotonic()
        group = Collective.of(None, self.timeout, "run")
        offers = [h for h in [self.held, *self.snapshots.held()] if h is not None and h.tenure is not None]
        records = group.gather((bool(offers), self.snapshot_every), "run-held")
        mismatch = snapshot_every_mismatch([every for _, every in records])
        if mismatch is not None:
            raise ElasticError(mismatch)
        holds = [held for held, _ in records]
        src, value = 0, None
        filled = from_snapshot = False
        if any(holds):
            try:
                value, moved, src, from_snapshot = reshard(new, offers, group)
                filled = True
                log.info(
                    "run: filled the %s mesh from %s at tenure %r (%d bytes received here)",
                    shape,
                    "snapshots" if from_snapshot else "live pieces",
                    value,
                    moved,
                )
            except BaseException as exc:
                if kept and lineage(new).torn:  # the fill wrote into the kept tensors, which `held` views
                    self.held = None
                if not isinstance(exc, SyncError) or self.ckpt is None:
                    raise
                log.warning("run: %s; loading %s instead", exc, self.ckpt)
        if not filled:
            report = load(new, self.ckpt, timeout=self.timeout) if self.ckpt is not None else None
            if report is not None:
                src, value = report.src, report.tenure
            else:
                sync_report = sync(new, timeout=self.timeout)
                src, value = sync_report.src, sync_report.tenure
        self.snapshots.settle(value, from_snapshot)
        self.state, self.held, self.layout = new, None, world.generation
        dropped, self.dropped = self.dropped, None
        if dropped is not None and dropped() is not None:
            gc.collect()  # the old state's cycles, and with them its pieces: freed before fn runs
        log.debug(
            "run: generation %d started in %.3f s: mesh %.3f, %s %.3f, fill %.3f",
            world.generation,
            time.monotonic() - began,
            meshed - began,
            "kept" if kept else "build",
            built - meshed,
            time.monotonic() - built,
        )
        if self.snapshot_every is not None:
            import torch.distributed as dist

            me = dist.get_rank()
            peers = ring_peers(layout_of(world.mesh), me)  # None alike on every rank: one shard position
            # the ring's own group (gloo: snapshots live in CPU memory), created by every rank in order
            ring = dist.new_group(backend="gloo", timeout=self.timeout) if peers is not None else None
            self.snapshots.open(ring, me, peers, world.generation, self.timeout)
        return src, value

    def _keep(self, world: Any) -> Any:
        """The kept state on `world.mesh` when this rank sits where it sat on the same mesh (`world.mesh`
        then becomes the state's own mesh, on the new groups), else None (the kept state dropped)."""
        kept, binding = self.kept, self.binding
        self.kept = self.binding = None
        if kept is not None and (binding is None or not binding.fits(world.mesh)):
            # dropped: FSDP2's modules are reference cycles, which keep the held pieces' memory after the
            # fill unless collected (`start` does, if they are still there then)
            self.dropped = weakref.ref(binding.root) if binding is not None else None
            return None
        if kept is None or binding is None:
            return None
        try:
            world.mesh = rebind(binding, world.mesh)
        except Exception as exc:  # torch's private objects not as `unbind` found them: rebuild
            log.warning(
                "run: keeping the state on the same mesh failed (%s: %s); building it anew",
                type(exc).__name__,
                exc,
            )
            return None
        log.debug("run: the mesh %s stays and this rank's coordinate too: the state is kept", binding.shape)
        return kept


def warm_up(plan: MeshPlan) -> None:
    """Pay torch's first-use costs of FSDP2 and DTensor (~0.7 s: building the first sharded model, its
    first step) before joining, on a throwaway group of this process alone: a spare admitted or a restarted
    worker otherwise pays them in its first `build` and step, while every member waits for it. Skipped when
    a default process group exists already (the user's). Local; failures are only logged."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    began = time.monotonic()
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            names = plan.names or ("replicate", "shard")
            mesh = init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            optimizer = torch.optim.Adam(model.parameters())
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            del model, optimizer, mesh
        finally:
            dist.destroy_process_group()
            _forget_meshes()
    except Exception as exc:  # only a cost moved: the first build pays it instead
        log.debug("run: warming up FSDP2 failed (%s: %s)", type(exc).__name__, exc)
        return
    log.debug("run: FSDP2 and DTensor warmed up in %.2f s", time.monotonic() - began)


def snapshot_every_mismatch(values: list[int | None]) -> str | None:
    """What is wrong when the ranks of a generation were given different ``snapshot_every`` (each rank's
    value, in rank order), else None: the snapshot ring needs every rank, and every rank alike."""
    if len(set(values)) < 2:
        return None
    by_value: dict[int | None, list[int]] = {}
    for rank, every in enumerate(values):
        by_value.setdefault(every, []).append(rank)
    seen = "; ".join(f"ranks {ranks}: snapshot_every={every!r}" for every, ranks in by_value.items())
    return (
        f"elastic.run: the workers were given different snapshot_every ({seen}); pass the same "
        "snapshot_every to elastic.run on every worker"
    )


def dist_backend() -> str:
    import torch.distributed as dist

    return str(dist.get_backend()) if dist.is_initialized() else "gloo"
