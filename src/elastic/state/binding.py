"""A sharded state's hold on its generation's process groups: `unbind` at a generation's end, `rebind` to
the next generation's mesh when it is the same.

FSDP2 and DTensor tie a state to its mesh's groups in two places: every DTensor's spec names a
``DeviceMesh``, which finds its groups by name (``_dim_group_names``, kept in its ``_pg_registry``), and
FSDP2's mesh infos (one per parameter group and parameter) hold the groups themselves. When a generation
ends, `unbind` drops every such reference, so the ending generation's groups close their sockets as soon as
they are destroyed (a peer still blocked on this rank fails at once, and no ``gc.collect`` is needed to
free them), while the state's modules, parameters, optimizer and its states stay as they are.

When the next generation's mesh has the same shape and dimension names and this rank sits at the same
coordinate (`Binding.fits`), `rebind` points the state's own ``DeviceMesh`` objects at the new mesh's
groups and recomputes FSDP2's mesh infos: the state goes on, nothing rebuilt, nothing copied, and the
returned mesh (the state's, now on the new groups) becomes the generation's ``world.mesh``. A mesh the
state reaches that is neither its root mesh nor a submesh of it by dimension names (a flattened mesh) makes
`unbind` return None: the state cannot be kept, and the caller rebuilds it.

A generation usually ends inside a step (a peer died during an all-gather or a reduce-scatter), which
leaves FSDP2's per-iteration bookkeeping half way: an all-gather result, a queued backward callback, a
training state of FORWARD or POST_BACKWARD. `unbind` puts it back as it is between two steps
(`_reset_fsdp`, local, no communication), so the kept state's next step starts like any other. The
sharded parameters themselves are only written by the optimizer's step, which a failed step never
reached on a rank that failed in a collective of the forward or backward pass.

These reach into torch's private attributes of ``DeviceMesh`` and FSDP2 (torch 2.13); anything missing
makes `unbind` return None (and the state rebuilt) rather than keep a state half bound.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from elastic.state.shards import find_dtensor, modules_of

__all__ = ["Binding", "rebind", "unbind"]

log = logging.getLogger("elastic")

#: The process-group attributes of FSDP2's mesh infos (``FSDPMeshInfo``, ``DDPMeshInfo``, ``HSDPMeshInfo``).
_GROUPS = ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group")


@attrs.define(eq=False)
class Binding:
    """What `unbind` left of a state's meshes: the root mesh (its DTensors'), its submeshes by dimension
    names, FSDP2's mesh infos, and where this rank sat."""

    root: Any
    subs: list[Any]
    infos: list[Any]
    shape: tuple[int, ...]
    names: tuple[str, ...] | None
    coordinate: tuple[int, ...] | None

    def fits(self, mesh: Any) -> bool:
        """Whether `mesh` (a new generation's) has the same shape, names, device type and this rank's
        coordinate: the state's pieces are then still this rank's pieces on it."""
        coordinate = mesh.get_coordinate()
        return (
            tuple(mesh.shape) == self.shape
            and mesh.mesh_dim_names == self.names
            and mesh.device_type == self.root.device_type
            and (tuple(coordinate) if coordinate is not None else None) == self.coordinate
        )


def _fsdp_infos(state: Any) -> list[Any] | None:
    """FSDP2's mesh infos of the state's modules (distinct objects), None when one is not as expected."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    infos: dict[int, Any] = {}
    for _, model in modules_of(state):
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is None:
                continue
            found = [group.mesh_info, group.post_forward_mesh_info]
            for param in group.fsdp_params:
                found += [param.mesh_info, param.post_forward_mesh_info]
            for info in found:
                if info is not None:
                    if not hasattr(info, "mesh"):
                        return None
                    infos[id(info)] = info
    return list(infos.values())


def _reset_fsdp(state: Any) -> bool:
    """FSDP2's per-iteration state of every module of `state` as between two steps, each module resharded,
    the gradients dropped (local). False when torch's objects are not as expected."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    except ImportError:  # pragma: no cover - torch without FSDP2
        return True
    try:
        for _, model in modules_of(state):
            for module in model.modules():
                if not isinstance(module, FSDPModule):
                    continue
                fsdp = module._get_fsdp_state()
                fsdp._training_state = TrainingState.IDLE
                fsdp._modules_to_run_forward.clear()
                ctx = fsdp._state_ctx
                ctx.iter_forward_root = None
                ctx.post_backward_final_callback_queued = False
                ctx.is_last_backward = True
                comm = fsdp._comm_ctx  # (some of its fields exist only after the first forward)
                for name, empty in (
                    ("post_forward_order", list),
                    ("reduce_scatter_states", list),
                    ("all_gather_state", lambda: None),
                    ("_last_post_reduce_events", dict),
                ):
                    if hasattr(comm, name):
                        setattr(comm, name, empty())
                group = fsdp._fsdp_param_group
                if group is None:
                    continue
                group._all_gather_result = None  # its work belongs to the ended generation's group
                group._post_reduce_event = None
                group._reshard_after_forward_event = None
                group._partial_reduce_output = None
                group._all_reduce_state = None
                group._post_forward_indices.clear()
                group._training_state = TrainingState.IDLE
                for fsdp_param in group.fsdp_params:
                    fsdp_param.grad_offload_event = None
                module.reshard()
            for param in model.parameters():
                param.grad = (
                    None  # a failed step's are partial (and a kept state holds no more than its pieces)
                )
    except AttributeError as exc:  # pragma: no cover - another torch's private layout
        log.debug("unbind: FSDP2's state is not as expected (%s): the state is rebuilt", exc)
        return False
    return True


def unbind(state: Any) -> Binding | None:
    """Drop every reference `state` holds to its mesh's process groups (local, no communication).

    Returns:
        The `Binding` to `rebind` it with, or None when the state cannot be kept (no DTensor, meshes other
        than its root and the root's submeshes by name, or torch's objects not as expected): its groups
        may then still be referenced, and the state must be dropped.
    """
    found = find_dtensor(state)
    if not found:
        return None
    root = found[0][1].device_mesh
    infos = _fsdp_infos(state)
    if infos is None or not _reset_fsdp(state) or any(d.device_mesh is not root for _, d in found):
        return None
    subs: dict[int, Any] = {}
    for info in infos:
        for mesh in (info.mesh, getattr(info, "spmd_mesh", None)):
            if mesh is None or mesh is root:
                continue
            if mesh._get_root_mesh() is not root or not mesh.mesh_dim_names:
                return None
            subs[id(mesh)] = mesh
    try:
        coordinate = root.get_coordinate()
        binding = Binding(
            root,
            list(subs.values()),
            infos,
            tuple(root.shape),
            root.mesh_dim_names,
            tuple(coordinate) if coordinate is not None else None,
        )
        for mesh in (root, *binding.subs):
            mesh._pg_registry = {}
            mesh._flatten_mapping = {}
        for info in infos:
            for name in _GROUPS:
                if hasattr(info, name):
                    setattr(info, name, None)
    except AttributeError as exc:  # pragma: no cover - another torch's private layout
        log.debug("unbind: torch's DeviceMesh or FSDP2 is not as expected (%s): the state is rebuilt", exc)
        return None
    return binding


def rebind(binding: Binding, mesh: Any) -> Any:
    """Point the unbound state's meshes at the groups of `mesh` (a new generation's, `binding.fits` it)
    and recompute FSDP2's mesh infos from them (local, no communication).

    Returns:
        The state's own root ``DeviceMesh``, now on `mesh`'s groups: the generation's mesh from then on.

    Raises:
        ValueError: `mesh` does not fit the binding (another shape, names or coordinate).
    """
    if not binding.fits(mesh):
        msg = (
            f"rebind: the new mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} at {mesh.get_coordinate()} is "
            f"not the state's {binding.shape} {binding.names} at {binding.coordinate}; build the state anew"
        )
        raise ValueError(msg)
    pairs = [(binding.root, mesh)] + [(sub, mesh[sub.mesh_dim_names]) for sub in binding.subs]
    for old, new in pairs:
        old._dim_group_names = list(new._dim_group_names)
        old._pg_registry = dict(new._get_root_mesh()._pg_registry)
        old._rank = new._rank
        old._coordinate_on_dim = new._coordinate_on_dim
        old._hash = None
    for info in binding.infos:
        if getattr(info, "shard_mesh_dim", None) is not None:
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            info.shard_mesh_rank = info.shard_process_group.rank()
        if getattr(info, "replicate_mesh_dim", None) is not None:
            info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
            info.replicate_mesh_rank = info.replicate_process_group.rank()
        if hasattr(info, "reduce_scatter_process_group"):
            info.reduce_scatter_process_group = None  # FSDP2's default: the shard group
    return binding.root
