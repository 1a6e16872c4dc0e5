"""`tensor_in`: a tensor saved with `torch.save` read as a view of its bytes, or None when it is not plain."""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import pytest
import torch

from elastic.checkpoint.blob import tensor_in


def saved(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


CASES = [
    torch.randn(3, 4),
    torch.randn(6, 4)[::2],  # a view with a stride: torch.save keeps the whole storage
    torch.randn(5, 7).t(),
    torch.arange(10, dtype=torch.int64)[3:],  # a storage offset
    torch.randn(4, dtype=torch.bfloat16),
    torch.randn(4).half(),
    torch.tensor(3.5, dtype=torch.float64),
    torch.tensor([True, False, True]),
    torch.randn(2, 2, dtype=torch.complex64),
    torch.randint(-100, 100, (9,), dtype=torch.int8),
]


@pytest.mark.parametrize("value", CASES, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{t.stride()}")
def test_a_plain_tensor_is_a_view_of_the_buffer_at_any_offset(value: torch.Tensor) -> None:
    raw = saved(value)
    for lead in (0, 1, 3):  # misaligned starts too: a DCP blob starts wherever the previous one ended
        buf = bytearray(b"x" * lead + raw + b"tail")
        got = tensor_in(buf, lead, len(raw))
        assert got is not None
        assert got.dtype == value.dtype and got.shape == value.shape and got.stride() == value.stride()
        assert torch.equal(got, value)
        # it shares the buffer's memory: no copy was made
        base = got.untyped_storage().data_ptr()
        start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        assert start <= base < start + len(buf)


def test_what_is_not_a_plain_little_endian_tensor_is_left_to_torch_load() -> None:
    raw = saved(torch.randn(3))
    for other in (torch.randn(3).to(torch.float8_e4m3fn), {"a": torch.randn(2)}):  # no legacy storage; a dict
        blob = saved(other)
        assert tensor_in(bytearray(blob), 0, len(blob)) is None
    assert tensor_in(bytearray(raw[:-30]), 0, len(raw) - 30) is None  # truncated
    assert tensor_in(bytearray(os.urandom(200)), 0, 200) is None
    # a compressed record
    src = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name in src.namelist():
            z.writestr(name, src.read(name))
    packed = out.getvalue()
    assert tensor_in(bytearray(packed), 0, len(packed)) is None
    # big-endian data
    swapped = io.BytesIO()
    with zipfile.ZipFile(swapped, "w") as z:
        for name in src.namelist():
            z.writestr(name, b"big" if name.endswith("byteorder") else src.read(name))
    assert tensor_in(bytearray(swapped.getvalue()), 0, len(swapped.getvalue())) is None


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_naming_anything_else_is_never_run() -> None:
    raw = saved(torch.randn(3))
    src = zipfile.ZipFile(io.BytesIO(raw))
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as z:
        for name in src.namelist():
            data = pickle.dumps(_Boom(), protocol=2) if name.endswith("data.pkl") else src.read(name)
            z.writestr(name, data)
    calls: list[str] = []
    real = os.system
    os.system = lambda cmd: calls.append(cmd) or 0  # type: ignore[assignment]
    try:
        assert tensor_in(bytearray(evil.getvalue()), 0, len(evil.getvalue())) is None
    finally:
        os.system = real
    assert calls == []


def test_locate_reads_only_the_directory_and_pickle_and_extent_bounds_a_narrowed_piece() -> None:
    from elastic.checkpoint.blob import locate, view_of

    value = torch.randn(1000, 256)
    raw = saved(value)
    asked: list[tuple[int, int]] = []

    def read(a: int, b: int) -> memoryview:
        asked.append((a, b))
        return memoryview(raw)[a:b]

    layout = locate(read, len(raw))
    assert layout is not None and layout.size == (1000, 256) and layout.dtype == torch.float32
    assert sum(b - a for a, b in asked) <= 2 * 4096  # its head and its tail, never the values themselves
    lo, hi = layout.extent([100, 0], [50, 256])
    assert (lo, hi) == (100 * 256, 150 * 256)
    assert layout.extent([100, 8], [50, 16]) == (100 * 256 + 8, 149 * 256 + 8 + 16)
    assert layout.extent([990, 0], [20, 256]) is None  # beyond the saved piece
    assert layout.extent([0], [5]) is None  # another rank
    # the narrowed piece over just its bytes
    start = layout.data + lo * 4
    part = bytearray(raw[start : layout.data + hi * 4])
    got = view_of(part, 0, layout.dtype, hi - lo, [50, 256], layout.stride)
    assert torch.equal(got, value[100:150])
