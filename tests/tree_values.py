"""Hypothesis strategies for the values a state's plain fields hold, and a strict equality on them."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

__all__ = ["same", "values"]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool]
DTYPES += [torch.complex64, torch.uint8]


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 100, shape, generator=g)
    if dtype == torch.bool:
        return t % 2 == 0
    if dtype.is_complex:
        return torch.complex(t.float(), -t.float()).to(dtype)
    out = t.to(dtype)
    if draw(st.booleans()) and out.dim() == 2:
        out = out.t()  # non-contiguous
    return out


plain = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=5)
)
values = st.recursive(
    st.one_of(plain, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text(max_size=3), children, max_size=3),
        st.tuples(children, children),
    ),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
