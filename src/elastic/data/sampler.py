"""`ElasticSampler`: every sample of an epoch used once, across membership changes and restarts.

A `DistributedSampler` is built for one world: rebuilt for another, it starts the epoch again. This sampler
keeps its progress (seed, epoch, samples consumed) as plain data in the elastic state, so the most tenured
progress wins every `sync` and `load`, and splits the samples not yet consumed among whatever world
iterates next.

The arithmetic, for `n` samples left in the epoch, a world of `W` ranks and `B` samples per rank and step:
the epoch's order (a permutation that depends only on the seed and the epoch) is cut into steps of `W * B`
consecutive samples, rank `r` taking the `r`-th run of `B` in each. The last `t < W * B` samples form one
shorter step (split as evenly as possible: every rank gets `t // W` or one more) or, with `drop_last`, are
not used in this epoch.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["ElasticSampler"]

logger = logging.getLogger("elastic")

_KEYS = ("seed", "epoch", "consumed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _default_world() -> tuple[int, int]:
    """`(rank, world_size)` of the default process group; `(0, 1)` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _generator_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed for `torch.Generator` that depends on both numbers (unlike `seed + epoch`)."""
    digest = hashlib.blake2b(f"elastic-sampler:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ElasticSampler(Sampler[int]):
    """A sampler for map-style datasets whose progress survives membership changes and restarts.

    Put it in the elastic state (it is a stateful field: its `state_dict()` is plain data, synced and saved
    like any other, and loading it needs no ``trusted=True``) and give it to a `DataLoader` built with the
    same ``batch_size``:

    ```python
    state.sampler = elastic.ElasticSampler(dataset, batch_size=32)
    loader = DataLoader(dataset, batch_size=32, sampler=state.sampler, num_workers=4)
    while state.sampler.epoch < epochs:
        for batch in loader:
            ...  # forward, backward, optimizer step
            state.sampler.advance()
        state.sampler.set_epoch(state.sampler.epoch + 1)
    ```

    - The order of an epoch depends only on ``seed`` and the epoch (``shuffle=False``: the dataset's
      order). Loading or syncing a state takes the saved seed, so that ``consumed`` always counts
      samples of the same order.
    - Iterating yields this rank's indices of the samples not yet consumed in the epoch, for the world of
      the default process group when iteration starts (world 1 without one). ``batch_size`` is per
      rank. Every rank yields the same number of batches, so no rank waits in a step's collective for a
      rank that ran out.
    - The last step of an epoch, when fewer than ``world_size * batch_size`` samples are left, is
      **shorter** with ``drop_last=False`` (the default): its samples are split as evenly as possible,
      each rank getting one batch of ``left // world_size`` or one more. When fewer samples are left
      than there are ranks, the ranks without one are **padded** with repeated samples of that step, so
      those samples are used twice. With ``drop_last=True`` that last, incomplete step is **dropped**:
      every batch is full and the dropped samples are not used in this epoch. Keep the `DataLoader`'s own
      ``drop_last`` at its default (False).
    - Progress advances only through `advance`, called by every rank once after each optimizer step;
      iterating never counts (prefetching loaders pull batches early). After a failure the samples of
      the step in flight, not yet advanced, are used again; nothing else is.

    Args:
        dataset: a map-style dataset (one with ``__len__``).
        batch_size: samples per rank per step, the `DataLoader`'s ``batch_size``.
        shuffle: False keeps the dataset's order.
        seed: the seed of the order; a saved or synced progress brings its own.
        drop_last: True drops the epoch's last, incomplete step instead of splitting it.

    Raises:
        TypeError: `dataset` has no length (an ``IterableDataset`` must shard itself), or `seed` is not an
            int.
        ValueError: `batch_size` is not an int >= 1.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        try:
            size = len(dataset)
        except TypeError:
            msg = (
                f"ElasticSampler needs a map-style dataset with a length, got {type(dataset).__qualname__} "
                "without __len__; an IterableDataset must shard itself instead"
            )
            raise TypeError(msg) from None
        if not _is_int(batch_size) or batch_size < 1:
            msg = f"ElasticSampler(batch_size=...) must be an int >= 1 (per rank), got {batch_size!r}"
            raise ValueError(msg)
        if not _is_int(seed):
            msg = f"ElasticSampler(seed=...) must be an int, got {seed!r}"
            raise TypeError(msg)
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._size = size
        self._seed = seed
        self._epoch = 0
        self._consumed = 0

    # --- progress -------------------------------------------------------------------------------------

    @property
    def seed(self) -> int:
        """The seed of the order (the saved or synced one after `load_state_dict`)."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The current epoch (0 first)."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch counted as consumed by `advance`."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` with nothing consumed.

        Setting the epoch the sampler is already in keeps its progress, so the `DistributedSampler` idiom
        ``for e in range(state.sampler.epoch, epochs): state.sampler.set_epoch(e)`` resumes a restored
        epoch where it stopped instead of using its first samples twice.

        Args:
            epoch: the epoch to start (0 first).

        Raises:
            ValueError: `epoch` is not an int >= 0.
        """
        if not _is_int(epoch) or epoch < 0:
            msg = f"ElasticSampler.set_epoch(epoch) needs an int >= 0, got {epoch!r}"
            raise ValueError(msg)
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    def advance(self) -> None:
        """Count one optimizer step of the current world as consumed.

        Every rank calls it once after each optimizer step: it adds ``world_size * batch_size`` samples
        (the samples left, at the epoch's shorter last step) to `consumed`, for the world of the default
        process group at this call.

        Raises:
            RuntimeError: the epoch has no step left for this world (start the next with `set_epoch`).
        """
        self._advance(_default_world()[1])

    def _advance(self, world: int) -> None:
        step = self._step_samples(world)
        if step == 0:
            left = self._size - self._consumed
            dropped = f" ({left} left, dropped by drop_last=True)" if left else ""
            msg = (
                f"ElasticSampler.advance(): epoch {self._epoch} has no step left for a world of {world}"
                f"{dropped}; advance() once per optimizer step, and start the next epoch with "
                f"set_epoch({self._epoch + 1})"
            )
            raise RuntimeError(msg)
        self._consumed += step

    def _step_samples(self, world: int) -> int:
        """Samples the next step of a world of `world` ranks consumes (0: the epoch has none left)."""
        left = self._size - self._consumed
        full = world * self.batch_size
        if left >= full:
            return full
        return 0 if self.drop_last else left

    # --- plan -----------------------------------------------------------------------------------------

    def _order(self) -> torch.Tensor:
        """The epoch's order: a permutation of the dataset's indices."""
        if not self.shuffle:
            return torch.arange(self._size)
        g = torch.Generator()
        g.manual_seed(_generator_seed(self._seed, self._epoch))
        return torch.randperm(self._size, generator=g)

    def _shape(self, world: int) -> tuple[int, int]:
        """`(full steps, samples of the last, shorter step)` left for a world of `world` ranks."""
        left = self._size - self._consumed
        full, tail = divmod(left, world * self.batch_size)
        return full, 0 if self.drop_last else tail

    def _tail_span(self, tail: int, world: int, rank: int) -> tuple[int, int]:
        """`(offset, count)` of `rank`'s share in a last step of `tail` samples (count 0: padding)."""
        each, extra = divmod(tail, world)
        return rank * each + min(rank, extra), each + (1 if rank < extra else 0)

    def _left(self, rank: int, world: int) -> int:
        full, tail = self._shape(world)
        if tail == 0:
            return full * self.batch_size
        return full * self.batch_size + max(1, self._tail_span(tail, world, rank)[1])

    def _plan(self, rank: int, world: int) -> list[int]:
        """The indices `rank` of a world of `world` ranks yields for the rest of the epoch."""
        if not 0 <= rank < world:
            msg = f"ElasticSampler: rank {rank} is outside a world of {world}"
            raise ValueError(msg)
        full, tail = self._shape(world)
        b = self.batch_size
        start = self._consumed
        order = self._order()
        steps = order[start : start + full * world * b].view(full, world, b)
        mine = steps[:, rank, :].reshape(-1).tolist()
        if tail:
            base = start + full * world * b
            offset, count = self._tail_span(tail, world, rank)
            if count == 0:  # fewer samples left than ranks: repeat one of the step's samples
                offset, count = rank % tail, 1
            mine.extend(order[base + offset : base + offset + count].tolist())
        return mine

    # --- Sampler --------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """This rank's indices of the samples not yet consumed, for the world of the default group now.

        The plan is computed here, at once, so that advancing while a loader prefetches changes nothing
        in an iteration already started.

        Returns:
            An iterator over dataset indices; every rank of the world gets the same number.
        """
        rank, world = _default_world()
        plan = self._plan(rank, world)
        logger.debug(
            "ElasticSampler: epoch %d, %d of %d consumed; rank %d of %d takes %d samples",
            self._epoch,
            self._consumed,
            self._size,
            rank,
            world,
            len(plan),
        )
        return iter(plan)

    def __len__(self) -> int:
        """This rank's indices left in the epoch, for the world of the default group now.

        Returns:
            How many indices iterating now would yield on this rank.
        """
        rank, world = _default_world()
        return self._left(rank, world)

    # --- Stateful -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The progress as plain data.

        Returns:
            ``{"seed": int, "epoch": int, "consumed": int}``.
        """
        return {"seed": self._seed, "epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take saved or synced progress, its seed included.

        Args:
            state_dict: what `state_dict` returned, here or on another rank.

        Raises:
            ValueError: other keys, or values that are no progress of this dataset (ints, epoch >= 0,
                0 <= consumed <= its length).
        """
        if not isinstance(state_dict, dict) or set(state_dict) != set(_KEYS):
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__qualname__
            msg = f"ElasticSampler.load_state_dict needs the keys {list(_KEYS)}, got {found}"
            raise ValueError(msg)
        seed, epoch, consumed = (state_dict[k] for k in _KEYS)
        bad = {k: state_dict[k] for k in _KEYS if not _is_int(state_dict[k])}
        if bad or epoch < 0 or not 0 <= consumed <= self._size:
            msg = (
                f"ElasticSampler.load_state_dict: {state_dict!r} is not a progress of this dataset of "
                f"{self._size} samples (ints, epoch >= 0, 0 <= consumed <= {self._size}); was it saved "
                "with another dataset?"
            )
            raise ValueError(msg)
        self._seed, self._epoch, self._consumed = seed, epoch, consumed

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(epoch={self._epoch}, consumed={self._consumed}/{self._size}, "
            f"batch_size={self.batch_size}, shuffle={self.shuffle}, seed={self._seed}, "
            f"drop_last={self.drop_last})"
        )
