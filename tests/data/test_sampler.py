"""`ElasticSampler`: the arithmetic of splitting what is left of an epoch, then real ranks that change.

Most tests are single-process: several ranks are simulated by asking one sampler for the plan of each
rank of a world (`_plan(rank, world)`, `_left`, `_advance(world)`: the internal hook the public methods
call with the default group's world). The multi-process tests are few and grouped: one chain of three
`elastic.spawn` runs (3 -> 2 -> 3 workers, torchrun-style restarts through `save`/`load`, `DataLoader`
workers, a restart in the middle of the second epoch) and one in-process run with `elastic.run`.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, Dataset

import elastic
from elastic.state.nodes import kind_of


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(3))


class Indices(Dataset):
    """A dataset of its own indices; each item also says which process loaded it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, os.getpid()


@elastic.elastic_state(tenure="step")
@attrs.define
class Progress:
    sampler: elastic.ElasticSampler
    step: int = 0


def _steps(s: elastic.ElasticSampler, world: int) -> list[list[list[int]]]:
    """Every step left in the epoch for `world` simulated ranks: `steps[j][rank]` is rank's j-th batch."""
    per_rank = [list(BatchSampler(s._plan(r, world), s.batch_size, drop_last=False)) for r in range(world)]
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks yield different numbers of batches: {[len(b) for b in per_rank]}"
    for r in range(world):
        assert len(s._plan(r, world)) == s._left(r, world)  # len(sampler) is this rank's plan
    return [[per_rank[r][j] for r in range(world)] for j in range(counts.pop())]


# --- the order ------------------------------------------------------------------------------------------


def test_the_order_of_an_epoch_depends_only_on_seed_and_epoch() -> None:
    def order(seed: int, epoch: int, batch: int = 4) -> list[int]:
        s = elastic.ElasticSampler(range(50), batch_size=batch, seed=seed)
        s.set_epoch(epoch)
        return list(s)  # without a process group: world 1, the whole order

    assert sorted(order(0, 0)) == list(range(50))
    assert order(0, 0) == order(0, 0) == order(0, 0, batch=7)
    assert order(0, 1) != order(0, 0)
    assert order(1, 0) != order(0, 0)
    assert order(1, 0) != order(0, 1)  # not seed + epoch: the two numbers do not trade places
    plain = elastic.ElasticSampler(range(50), batch_size=4, shuffle=False)
    plain.set_epoch(3)
    assert list(plain) == list(range(50))


def test_a_step_takes_consecutive_runs_of_the_order_rank_by_rank() -> None:
    s = elastic.ElasticSampler(range(10), batch_size=2, shuffle=False)
    assert [s._plan(r, 3) for r in range(3)] == [[0, 1, 6, 7], [2, 3, 8], [4, 5, 9]]
    assert [s._left(r, 3) for r in range(3)] == [4, 3, 3]
    assert _steps(s, 3) == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8], [9]]]  # the last step is shorter
    s._advance(3)
    assert s.consumed == 6
    # the same epoch, now for a world of 2: what is left, nothing else
    assert _steps(s, 2) == [[[6, 7], [8, 9]]]
    s._advance(2)
    assert s.consumed == 10
    assert [s._plan(r, 2) for r in range(2)] == [[], []]


def test_the_last_step_is_split_as_evenly_as_possible() -> None:
    s = elastic.ElasticSampler(range(13), batch_size=4, shuffle=False)  # 13 = 4 * 3 + 1 for a world of 4
    assert [len(b) for b in _steps(s, 4)[-1]] == [4, 3, 3, 3]
    s = elastic.ElasticSampler(range(9), batch_size=4, shuffle=False)  # one step of 9 for 4 ranks
    assert _steps(s, 4) == [[[0, 1, 2], [3, 4], [5, 6], [7, 8]]]
    s._advance(4)
    assert s.consumed == 9  # fewer than world * batch at the epoch's end


def test_fewer_samples_than_ranks_are_padded_with_repeats_or_dropped() -> None:
    s = elastic.ElasticSampler(range(8), batch_size=3, shuffle=False)
    s._advance(2)
    assert s.consumed == 6
    # 2 samples left for 4 ranks: ranks 2 and 3 repeat samples of that step, so every rank has a batch
    assert _steps(s, 4) == [[[6], [7], [6], [7]]]
    s._advance(4)
    assert s.consumed == 8  # the repeats are not counted
    dropping = elastic.ElasticSampler(range(8), batch_size=3, shuffle=False, drop_last=True)
    dropping._advance(2)
    assert _steps(dropping, 4) == []
    assert [dropping._left(r, 4) for r in range(4)] == [0, 0, 0, 0]


def test_drop_last_drops_the_incomplete_last_step_of_the_current_world() -> None:
    s = elastic.ElasticSampler(range(10), batch_size=2, shuffle=False, drop_last=True)
    assert _steps(s, 3) == [[[0, 1], [2, 3], [4, 5]]]
    s._advance(3)
    assert _steps(s, 3) == []
    with pytest.raises(RuntimeError, match=r"epoch 0 has no step left for a world of 3 \(4 left"):
        s._advance(3)
    assert s.consumed == 6  # unchanged by the refused advance
    # the 4 samples a world of 3 cannot use make a full step for a world of 2
    assert _steps(s, 2) == [[[6, 7], [8, 9]]]
    s._advance(2)
    with pytest.raises(RuntimeError, match=r"set_epoch\(1\)"):
        s._advance(2)


def test_iteration_never_advances_and_an_iteration_keeps_its_plan() -> None:
    s = elastic.ElasticSampler(range(10), batch_size=3, seed=5)
    it = iter(s)
    first = next(it)
    s.advance()  # world 1 without a group: 3 samples
    assert s.consumed == 3
    rest = list(it)
    assert [first, *rest] == s._order().tolist()  # the started iteration is not cut short
    assert len(list(s)) == 7 == len(s)
    assert s.consumed == 3  # iterating twice consumed nothing


def test_dataloader_batches_in_one_process() -> None:
    data = Indices(11)
    s = elastic.ElasticSampler(data, batch_size=4, seed=2)
    loader = DataLoader(data, batch_size=4, sampler=s)
    assert len(loader) == 3
    seen: list[int] = []
    for idx, _pid in loader:
        seen += idx.tolist()
        s.advance()
    assert seen == s._order().tolist()
    assert s.consumed == 11
    assert len(loader) == 0 and list(loader) == []
    s.set_epoch(1)
    assert len(loader) == 3 and s.consumed == 0


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 60),
    batch=st.integers(1, 5),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    phases=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5), st.booleans()), min_size=0, max_size=6),
    last_world=st.integers(1, 6),
)
def test_every_sample_once_across_any_sequence_of_worlds(
    n: int, batch: int, drop_last: bool, shuffle: bool, phases: list[tuple[int, int, bool]], last_world: int
) -> None:
    """Phases of (world, steps, a lost step in flight at the end), then one world to the epoch's end."""
    s = elastic.ElasticSampler(range(n), batch_size=batch, shuffle=shuffle, seed=n, drop_last=drop_last)
    order = s._order().tolist()
    used: Counter[int] = Counter()  # samples of advanced steps, padding removed
    again: Counter[int] = Counter()  # samples of steps lost in flight
    for world, steps, lost in [*phases, (last_world, 10**6, False)]:
        plan = _steps(s, world)
        for j, step in enumerate(plan[: steps + lost]):
            flat = [i for b in step for i in b]
            count = s._step_samples(world)
            expected = order[s.consumed : s.consumed + count]
            assert set(flat) == set(expected)  # a step takes the next samples of the order
            assert len(flat) == max(count, world)  # padded only to give every rank one sample
            assert not drop_last or len(flat) == world * batch  # with drop_last every batch is full
            if j == steps:  # in flight when the world ends: processed, never advanced
                again.update(expected)
                break
            used.update(expected)
            s._advance(world)
    left = order[s.consumed :]
    assert s.consumed + len(left) == n
    if drop_last:
        assert len(left) < last_world * batch  # only what cannot make a full step is dropped
    else:
        assert left == []
    assert used == Counter(order[: s.consumed])  # every used sample of the epoch, each exactly once
    if not drop_last:
        assert set(again) <= set(used)  # a lost step's samples are used again (once: see above)


# --- progress and its state ------------------------------------------------------------------------------


def test_set_epoch_starts_a_new_epoch_and_keeps_the_current_one() -> None:
    s = elastic.ElasticSampler(range(10), batch_size=2)
    s.advance()
    s.set_epoch(0)  # the epoch it is in: progress kept (the DistributedSampler idiom resumes)
    assert (s.epoch, s.consumed) == (0, 2)
    s.set_epoch(1)
    assert (s.epoch, s.consumed) == (1, 0)
    s.advance()
    s.set_epoch(0)
    assert (s.epoch, s.consumed) == (0, 0)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match=r"set_epoch\(epoch\) needs an int >= 0, got"):
            s.set_epoch(bad)  # type: ignore[arg-type]


def test_state_dict_is_plain_data_and_loading_takes_the_saved_seed() -> None:
    a = elastic.ElasticSampler(range(20), batch_size=3, seed=11)
    a.set_epoch(2)
    a.advance()
    sd = a.state_dict()
    assert sd == {"seed": 11, "epoch": 2, "consumed": 3}
    assert all(type(v) is int for v in sd.values())
    b = elastic.ElasticSampler(range(20), batch_size=3, seed=99)
    b.load_state_dict(sd)
    assert (b.seed, b.epoch, b.consumed) == (11, 2, 3)
    assert list(b) == list(a)
    assert kind_of(a) == "stateful"
    assert "consumed=3/20" in repr(a)


@pytest.mark.parametrize(
    ("sd", "match"),
    [
        ({"seed": 0, "epoch": 0}, r"needs the keys \['seed', 'epoch', 'consumed'\], got \['epoch', 'seed'\]"),
        ([1, 2, 3], r"needs the keys .*, got list"),
        ({"seed": 0, "epoch": 0, "consumed": 21}, r"dataset of 20 samples .* 0 <= consumed <= 20"),
        ({"seed": 0, "epoch": -1, "consumed": 0}, r"epoch >= 0"),
        ({"seed": "0", "epoch": 0, "consumed": 0}, r"is not a progress of this dataset"),
        ({"seed": 0, "epoch": 0, "consumed": True}, r"is not a progress of this dataset"),
    ],
)
def test_load_state_dict_rejects_another_progress(sd: Any, match: str) -> None:
    s = elastic.ElasticSampler(range(20), batch_size=3)
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(sd)
    assert s.state_dict() == {"seed": 0, "epoch": 0, "consumed": 0}


def test_constructor_errors_name_the_value() -> None:
    with pytest.raises(TypeError, match=r"map-style dataset with a length, got Stream without"):
        elastic.ElasticSampler(Stream(), batch_size=2)  # type: ignore[arg-type]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"batch_size=...\) must be an int >= 1 \(per rank\), got"):
            elastic.ElasticSampler(range(3), batch_size=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"seed=...\) must be an int, got '1'"):
        elastic.ElasticSampler(range(3), batch_size=1, seed="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank 3 is outside a world of 3"):
        elastic.ElasticSampler(range(3), batch_size=1)._plan(3, 3)


def test_save_and_load_need_no_trust_and_take_the_saved_progress(tmp_path: Path) -> None:
    p = Progress(elastic.ElasticSampler(range(30), batch_size=4, seed=3))
    p.sampler.set_epoch(1)
    p.sampler.advance()
    p.step = 1
    path = elastic.save(p, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["objects"] == []  # nothing pickled
    assert {f["name"]: f["kind"] for f in manifest["fields"]}["sampler"] == "stateful"
    q = Progress(elastic.ElasticSampler(range(30), batch_size=4, seed=42))
    sampler = q.sampler
    report = q.load(tmp_path)  # trusted=False
    assert report.source == "checkpoint"
    assert q.sampler is sampler  # restored in place: a DataLoader holding it sees the progress
    assert (sampler.seed, sampler.epoch, sampler.consumed) == (3, 1, 4)
    assert list(sampler) == list(p.sampler)


# --- real ranks: torchrun-style restarts through save/load -------------------------------------------------

N = 41  # neither a multiple of the batch nor of any world's step
B = 2
EPOCHS = 2


def _record(folder: str, name: str, **entry: Any) -> None:
    with open(Path(folder) / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def _records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(folder.iterdir()) if f.suffix == ".jsonl" for line in f.open()]


def _phase(phase: str, ckpt: str, folder: str, kill_at: int | None, workers: int) -> dict[str, Any]:
    """One torchrun-style launch: load, train to `kill_at` (that step dies in flight) or to the end."""
    rank = dist.get_rank()
    data = Indices(N)
    state = Progress(elastic.ElasticSampler(data, batch_size=B, seed=7 + rank))  # seeds differ: loaded
    report = state.load(ckpt)  # trusted=False: the sampler's progress is plain data
    out: dict[str, Any] = {"source": report.source, "seed": state.sampler.seed, "lens": []}
    out["start"] = (state.sampler.epoch, state.sampler.consumed, state.step)
    loader = DataLoader(data, batch_size=B, sampler=state.sampler, num_workers=workers)
    while state.sampler.epoch < EPOCHS:
        out["lens"].append(len(loader))
        for idx, pids in loader:
            _record(
                folder,
                f"rank{rank}",
                phase=phase,
                epoch=state.sampler.epoch,
                step=state.step,
                idx=idx.tolist(),
            )
            out.setdefault("pids", set()).update(pids.tolist())
            if state.step == kill_at:
                dist.barrier()  # every rank has recorded its batch of the step in flight
                if rank == dist.get_world_size() - 1:
                    os._exit(3)  # killed in flight: the others fail in the all-reduce below
            dist.all_reduce(torch.ones(1))  # the "gradients"
            state.step += 1
            state.sampler.advance()
            state.save(ckpt, keep=2)
        state.sampler.set_epoch(state.sampler.epoch + 1)
    return out


@pytest.mark.timeout(120)
def test_a_world_of_3_then_2_then_3_across_restarts_uses_every_sample_once(tmp_path: Path) -> None:
    ckpt, rec = str(tmp_path / "ckpt"), tmp_path / "records"
    rec.mkdir()
    # 3 workers: 3 steps of 6 samples, the 4th dies in flight
    with pytest.raises(elastic.WorkerError):
        elastic.spawn(_phase, 3, args=("a", ckpt, str(rec), 3, 0), timeout=60)
    # 2 workers, DataLoader workers: the rest of epoch 0 (23 = 5 * 4 + 3), 2 steps of epoch 1, 1 in flight
    with pytest.raises(elastic.WorkerError):
        elastic.spawn(_phase, 2, args=("b", ckpt, str(rec), 11, 2), timeout=60)
    # 3 workers again, restarted in the middle of the second epoch: its rest (33 = 5 * 6 + 3)
    final = elastic.spawn(_phase, 3, args=("c", ckpt, str(rec), None, 2), timeout=60)

    assert [r["source"] for r in final] == ["checkpoint"] * 3
    assert [r["start"] for r in final] == [(1, 8, 11)] * 3  # epoch 1, 2 steps of 4 consumed, step 11
    assert [r["seed"] for r in final] == [7, 7, 7]  # the saved seed, not the rank's own
    assert [r["lens"] for r in final] == [[6]] * 3  # every rank the same number of batches
    assert all(os.getpid() not in r["pids"] and len(r["pids"]) == 2 for r in final)  # loader workers

    records = _records(rec)
    expected = elastic.ElasticSampler(range(N), batch_size=B, seed=7)
    for epoch, (lost_phase, lost_step) in enumerate([("a", 3), ("b", 11)]):
        expected.set_epoch(epoch)
        order = expected._order().tolist()
        mine = [r for r in records if r["epoch"] == epoch]
        counts = Counter(i for r in mine for i in r["idx"])
        in_flight = [i for r in mine if (r["phase"], r["step"]) == (lost_phase, lost_step) for i in r["idx"]]
        assert len(in_flight) == (6 if epoch == 0 else 4)  # the whole step of the killed world
        assert counts == Counter(range(N)) + Counter(in_flight)  # once each; the lost step twice
        first = [r for r in mine if r["phase"] == lost_phase and r["step"] < lost_step]
        done = len({i for r in first for i in r["idx"]})
        assert {i for r in first for i in r["idx"]} == set(order[:done])  # the epoch's order, seed 7
        assert set(in_flight) == set(order[done : done + len(in_flight)])


# --- real ranks: in-process recovery with elastic.run ------------------------------------------------------


def _in_process(folder: str) -> dict[str, Any]:
    """A worker of `spawn(restart="worker")`: slot 2 dies in flight at step 3 (a world of 3 becomes 2);
    its replacement joins once the survivors have trained as a world of 2 (and it becomes 3 again)."""
    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    marker = Path(folder) / "world-of-2"
    deadline = time.monotonic() + 60
    while life and not marker.exists():  # the replacement waits until the world of 2 trains
        if time.monotonic() > deadline:
            raise RuntimeError("the survivors never formed a world of 2")
        time.sleep(0.05)
    data = Indices(N)
    state = Progress(elastic.ElasticSampler(data, batch_size=B, seed=7 + slot))  # seeds differ: synced

    def train(state: Progress, world: Any) -> dict[str, Any]:
        loader = DataLoader(data, batch_size=B, sampler=state.sampler)  # built for this generation
        steps = 0
        while state.sampler.epoch < 1:
            for idx, _ in loader:
                entry = {"generation": world.generation, "world": world.size, "rank": world.rank}
                entry.update(slot=slot, step=state.step)
                _record(folder, f"slot{slot}-{life}", **entry, idx=idx.tolist())
                if (slot, life, state.step) == (2, 0, 3):
                    os._exit(3)  # killed in flight: the survivors' all-reduce fails, they regroup
                dist.all_reduce(torch.ones(1))
                state.step += 1
                state.sampler.advance()
                steps += 1
                world.check()
                if world.size == 2 and steps == 2:
                    marker.touch()
                    for _ in range(3000):  # idle until the replacement waits to join
                        world.check()
                        time.sleep(0.01)
                    raise RuntimeError("the replacement never joined")
            state.sampler.set_epoch(state.sampler.epoch + 1)
        return {"progress": state.sampler.state_dict(), "step": state.step, "generation": world.generation}

    return elastic.run(train, state, timeout=20, join_timeout=60)


@pytest.mark.timeout(120)
def test_a_world_of_3_then_2_then_3_in_process_uses_every_sample_once(tmp_path: Path) -> None:
    results = elastic.spawn(
        _in_process, 3, args=(str(tmp_path),), restart="worker", max_restarts=1, timeout=90
    )
    records = _records(tmp_path)
    seed = 7 + next(r["slot"] for r in records if (r["generation"], r["rank"]) == (0, 0))  # gen 0's rank 0
    # 41 samples: 3 steps of 6, the 4th lost; 2 steps of 4; 2 steps of 6 and a last one of 3
    assert [r["progress"] for r in results] == [{"seed": seed, "epoch": 1, "consumed": 0}] * 3
    assert [r["step"] for r in results] == [8] * 3  # the newcomer received the survivors' progress
    worlds = {r["generation"]: r["world"] for r in records}
    assert [w for _, w in sorted(worlds.items())] == [3, 2, 3]
    counts = Counter(i for r in records for i in r["idx"])
    in_flight = [i for r in records if (r["generation"], r["step"]) == (0, 3) for i in r["idx"]]
    assert len(in_flight) == 6
    assert counts == Counter(range(N)) + Counter(in_flight)  # once each; the lost step twice
    order = elastic.ElasticSampler(range(N), batch_size=B, seed=seed)._order().tolist()
    assert set(in_flight) == set(order[18:24])
