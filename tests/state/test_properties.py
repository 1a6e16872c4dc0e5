"""Property-based tests across real ranks: random nested states survive a 2-rank `sync` unchanged.

Hypothesis draws a batch of random states in the test process; one spawn of two gloo ranks syncs them all
(rank 1 is the most tenured; rank 0 starts from other random values), and the test compares. A fixed
profile (see conftest.py) keeps CI deterministic.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import elastic
from dist_harness import TRANSPORTS, run_on_ranks, use_transport
from tree_values import same, values

SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]


@elastic.elastic_state(tenure="step")
@attrs.define
class Box:
    step: int = 0
    value: Any = None


def _sync_all(rank: int, world: int, batches: list[tuple[Any, Any]]) -> dict[str, list[Any]]:
    return {transport: _sync_on(rank, batches, transport) for transport in TRANSPORTS}


def _sync_on(rank: int, batches: list[tuple[Any, Any]], transport: str) -> list[Any]:
    # tensors spanning buckets, many buckets, and (broadcasts) some direct broadcasts
    use_transport(transport, bucket_bytes=256, direct_bytes=64)
    from elastic.state.nodes import kind_of

    out = []
    for src_value, other in batches:
        # the receiver holds another random value of the same kind (the schema requires it), or None
        dst_value = other if kind_of(other) == kind_of(src_value) else None
        box = Box(step=1, value=src_value) if rank == 1 else Box(step=0, value=dst_value)
        elastic.sync(box, timeout=20)
        out.append(box.value)
    return out


@pytest.mark.timeout(120)
@settings(
    max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(batches=st.lists(st.tuples(values, values), min_size=15, max_size=15))
def test_random_states_survive_a_two_rank_sync(batches: list[tuple[Any, Any]]) -> None:
    results = run_on_ranks(_sync_all, 2, args=(batches,))
    for transport in TRANSPORTS:  # both transports, in one spawn
        assert len(results[0][transport]) == len(batches)
        for (src_value, _), got0, got1 in zip(batches, results[0][transport], results[1][transport]):
            assert same(src_value, got1), f"{transport}: the source is unchanged"
            assert same(src_value, got0), f"{transport}: the receiver holds exactly the source's value"


def _tensor_marks(v: Any) -> set[str]:
    """The dtypes and shapes ("0-d", "empty", "n-d") of the tensors anywhere in `v`."""
    marks: set[str] = set()
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            marks.add(str(x.dtype))
            marks.add("0-d" if x.dim() == 0 else ("empty" if x.numel() == 0 else "n-d"))
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return marks


@pytest.mark.parametrize(
    "mark", ["torch.bfloat16", "torch.bool", "torch.int8", "torch.complex64", "0-d", "empty"]
)
def test_strategy_covers_the_hard_cases(mark: str) -> None:
    """The value strategy reaches bf16, bool, int8, complex, 0-d and empty tensors (`find` searches until
    it meets one, so a rare case is found, not missed by a fixed number of random examples)."""
    found = find(
        values, lambda v: mark in _tensor_marks(v), settings=settings(max_examples=5000, database=None)
    )
    assert mark in _tensor_marks(found)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: save then load returns the same values; any single flipped byte is detected.


@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OK)
@given(value=values, other=values)
def test_random_states_survive_save_then_load(tmp_path_factory: Any, value: Any, other: Any) -> None:
    from elastic.state.nodes import kind_of

    root = tmp_path_factory.mktemp("ckpt")
    elastic.save(Box(step=1, value=value), root)
    receiver = Box(step=0, value=other if kind_of(other) == kind_of(value) else None)
    report = elastic.load(receiver, root)
    assert report.source == "checkpoint" and report.tenure == 1
    assert same(value, receiver.value)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: Any) -> tuple[Any, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("flip")
    state = Box(step=7, value={"w": torch.randn(64, 64), "b": torch.arange(10), "note": "x", "xs": [1.5, 2]})
    path = elastic.save(state, root)
    files = {p.name: p.read_bytes() for p in path.iterdir()}
    return path, files


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_flipped_byte_is_detected(
    saved_checkpoint: tuple[Any, dict[str, bytes]], data: Any
) -> None:
    path, files = saved_checkpoint
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    offset = data.draw(st.integers(0, len(files[name]) - 1), label="offset")
    mask = data.draw(st.integers(1, 255), label="xor")
    damaged = bytearray(files[name])
    damaged[offset] ^= mask
    (path / name).write_bytes(bytes(damaged))
    try:
        with pytest.warns(RuntimeWarning, match=name), pytest.raises(elastic.CheckpointCorruptError):
            elastic.load(Box(), path)  # pointing at this one checkpoint: corruption is an error
    finally:
        (path / name).write_bytes(files[name])
    assert elastic.load(Box(), path).tenure == 7  # restored: loads again
