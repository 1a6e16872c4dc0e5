"""The tensors of a flattened state: their metadata, the storage they share, and the buffers they go to.

`TensorMeta` is what a receiver needs to place a tensor it does not have. Tensors that share one storage on
the source are linked as aliases of a carrier (their bytes travel once, receivers rebuild them as views);
`carriers` are the tensors whose bytes travel. A checkpoint's background write stages the carriers in CPU
buffers (`staged`, `staging_buffer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from elastic.state.nodes import Path, path_str

__all__ = [
    "TensorMeta",
    "allocate",
    "as_view",
    "carriers",
    "check_tensor",
    "metas_of",
    "staged",
    "staging_buffer",
    "staging_fits",
    "walked_metas",
]


class TensorMeta(NamedTuple):
    """What a receiver needs to place a tensor it does not have: path, shape, dtype, device type, strides
    and `requires_grad`; `alias` is the index of the tensor whose storage this one shares on the source
    (-1: none) and `offset` its storage offset relative to that tensor's, in elements. A named tuple:
    one is built per tensor per sync, ~10x faster than a frozen attrs class."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    stride: tuple[int, ...] | None = None
    requires_grad: bool = False
    alias: int = -1
    offset: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def walked_metas(paths: list[Path], tensors: list[torch.Tensor], grads: list[bool]) -> list[TensorMeta]:
    """The metadata of the tensors a walk found (with whether each `requires_grad`), aliases linked."""
    metas = []
    storages: dict[tuple[str, int], list[int]] = {}
    for i, (path, t, grad) in enumerate(zip(paths, tensors, grads)):
        device = "cpu" if t.is_cpu else t.device.type
        metas.append(TensorMeta(path, tuple(t.shape), t.dtype, device, t.stride(), grad, -1, 0))
        if t.numel():
            storages.setdefault((device, t.untyped_storage().data_ptr()), []).append(i)
    for members in storages.values():
        if len(members) > 1:
            _link_aliases(tensors, metas, members)
    return metas


def metas_of(paths: list[Path], tensors: list[torch.Tensor], devices: list[str]) -> list[TensorMeta]:
    """The metadata of tensors read back from a checkpoint (`torch.load` keeps storage sharing, strides and
    `requires_grad`), with the aliases among them linked as `flatten` links a live state's."""
    metas = [
        TensorMeta(p, tuple(t.shape), t.dtype, d, t.stride(), t.requires_grad, -1, 0)
        for p, t, d in zip(paths, tensors, devices)
    ]
    storages: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    for members in storages.values():
        if len(members) > 1:
            _link_aliases(tensors, metas, members)
    return metas


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """How many elements of storage a tensor reaches, from its first to its last (1 for a scalar)."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(shape, stride))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _link_aliases(tensors: list[torch.Tensor], metas: list[TensorMeta], members: list[int]) -> None:
    """Among tensors sharing one storage, make each that lies inside a dense tensor of the same dtype an
    alias of it (its bytes then travel once, and receivers rebuild it as a view)."""
    order = sorted(members, key=lambda i: (-_span(metas[i].shape, metas[i].stride or ()), i))
    carriers: list[tuple[int, int, int]] = []  # (index, first element, span) of dense tensors
    for i in order:
        m = metas[i]
        start, span = int(tensors[i].storage_offset()), _span(m.shape, m.stride or ())
        home = next(
            (
                c
                for c, c_start, c_span in carriers
                if metas[c].dtype == m.dtype and c_start <= start and start + span <= c_start + c_span
            ),
            None,
        )
        if home is not None:
            metas[i] = m._replace(alias=home, offset=start - int(tensors[home].storage_offset()))
        elif span == _numel(m.shape):
            carriers.append((i, start, span))


def check_tensor(tensor: torch.Tensor, path: Path) -> None:
    """Reject tensors that cannot be transferred, with the fix."""
    if type(tensor) is torch.Tensor and not (
        tensor.is_meta or tensor.layout != torch.strided or tensor.is_quantized
    ):
        return  # the common case, without building the path's text
    where = path_str(path)
    if type(tensor) is not torch.Tensor and not (
        type(tensor) is torch.nn.Parameter and type(tensor.detach()) is torch.Tensor
    ):
        if type(tensor).__name__ == "DTensor":
            msg = (
                f"tensor {where} is a DTensor in a state the library took for replicated: a sharded state is "
                "recognised by a DTensor field, or a module / optimizer whose first parameter is a DTensor. "
                "Shard the whole model (fully_shard on the root module after its layers, or tensor "
                "parallelism over every layer), so that its first parameter is sharded too"
            )
            raise TypeError(msg) from None
        msg = (
            f"tensor {where} is a {type(tensor).__module__}.{type(tensor).__qualname__}, a tensor subclass "
            "(FakeTensor, ...); elastic moves plain dense tensors and DTensors only: store its value as a "
            "plain torch.Tensor instead"
        )
        raise TypeError(msg) from None
    if tensor.is_meta:
        msg = (
            f"tensor {where} is on the meta device and holds no data to sync or save; "
            "materialise it first (module.to_empty(device=...) then initialise it)"
        )
        raise TypeError(msg) from None
    if tensor.layout != torch.strided:
        msg = (
            f"tensor {where} has layout {tensor.layout}; elastic moves dense tensors only: store "
            "tensor.to_dense() (or its indices and values as two dense tensors) in the state instead"
        )
        raise TypeError(msg) from None
    if tensor.is_quantized:
        msg = f"tensor {where} is quantized; store tensor.dequantize() or its int_repr() and scales instead"
        raise TypeError(msg) from None


def carriers(metas: list[TensorMeta]) -> list[int]:
    """The indices of the tensors whose bytes travel (the others are views of one of them)."""
    return [i for i, m in enumerate(metas) if m.alias < 0]


def as_view(carrier: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """Alias `meta` as a view of `carrier` (the tensor its `alias` names), outside inference mode."""
    assert meta.stride is not None  # aliases are found from strides
    with torch.inference_mode(False):
        view = carrier.detach().as_strided(meta.shape, meta.stride, carrier.storage_offset() + meta.offset)
        if meta.requires_grad:
            view.requires_grad_(True)
    return view


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a layout covers its storage exactly once (contiguous, channels_last, any permutation)."""
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if st != expected:
            return False
        expected *= n
    return True


def allocate(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """A new tensor for `meta` on `device`: the source's strides where they are dense, `requires_grad`
    as the source's, an ordinary tensor also under `torch.inference_mode()`."""
    with torch.inference_mode(False):
        if meta.stride is not None and _numel(meta.shape) > 1 and _dense(meta.shape, meta.stride):
            t = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
        else:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if meta.requires_grad:
            t.requires_grad_(True)
    return t


def staged(
    tensors: list[torch.Tensor], metas: list[TensorMeta], buffer: Callable[[int], torch.Tensor]
) -> list[torch.Tensor]:
    """Copies of `tensors` for a background write: `buffer(i)` gives a buffer shaped like carrier `i`
    (see `staging_buffer`); aliases become views of their carrier's copy, so the bytes are staged and
    written once and sharing survives."""
    out: list[Any] = [None] * len(tensors)
    for i in carriers(metas):
        buf = buffer(i)
        buf.copy_(tensors[i].detach(), non_blocking=buf.is_pinned())
        out[i] = buf
    for i, m in enumerate(metas):
        if m.alias >= 0:
            out[i] = as_view(out[m.alias], m._replace(requires_grad=False))
    return [t.detach().requires_grad_(True) if m.requires_grad else t for t, m in zip(out, metas)]


def staging_fits(buf: torch.Tensor | None, meta: TensorMeta, pin: bool) -> bool:
    """Whether a staging buffer kept from the last async save can hold carrier `meta` again."""
    return (
        buf is not None
        and tuple(buf.shape) == meta.shape
        and buf.dtype == meta.dtype
        and buf.stride() == _layout(meta)
        and buf.is_pinned() == pin
    )


def staging_buffer(meta: TensorMeta, pin: bool) -> torch.Tensor:
    """A CPU buffer for carrier `meta`, with its strides where they are dense (channels_last kept)."""
    return torch.empty_strided(meta.shape, _layout(meta), dtype=meta.dtype, pin_memory=pin)


def _layout(meta: TensorMeta) -> tuple[int, ...]:
    if meta.stride is not None and _numel(meta.shape) > 1 and _dense(meta.shape, meta.stride):
        return meta.stride
    out, n = [], 1
    for d in reversed(meta.shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))
