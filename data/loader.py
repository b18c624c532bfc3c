"""Batches of (x, y) token windows from a token file, for training and evaluation.

Each window is block_size + 1 consecutive tokens w; x = w[:-1], y = w[1:]. Windows are gathered
with one numpy fancy index into a sliding-window view of the memmap (no Python loop per row).

Sampling (``BatchLoader``):
  "random"  each batch draws batch_size start positions uniformly from [0, n - block_size)
            (overlapping windows, with replacement, as nanoGPT does).
  "epoch"   the split is cut into non-overlapping windows starting at multiples of block_size;
            every epoch visits each window exactly once in a fresh random order (a permutation
            seeded by (seed, epoch)). Rank r of world_size takes permutation entries r,
            r + world_size, ... so ranks never share a window; each rank gets
            n_windows // world_size windows per epoch (a few leftovers are skipped that epoch).
            Batches run on across epoch boundaries, so nothing is dropped within an epoch.
Randomness is a pure function of (seed, rank, step) (random) or (seed, epoch) (epoch), so the
loader state is just the step counter: ``state_dict()``/``load_state_dict()`` resume exactly,
and because the counter is the same on every rank, rank 0's saved state resumes all ranks.
On CUDA the batch is copied from pinned memory with non_blocking=True.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from errors import UserError

from .tokenfile import read_tokens

SAMPLINGS = ("random", "epoch")


def _load_windows(path: str | os.PathLike, block_size: int) -> tuple[np.ndarray, int]:
    """(sliding-window view of shape (n - block_size, block_size + 1), n) after a length check."""
    path = Path(path)
    if block_size < 1:
        raise UserError(f"block_size must be at least 1, got {block_size}")
    data = np.asarray(read_tokens(path))  # a plain ndarray view of the memmap: no copy
    n = len(data)
    if n < block_size + 1:
        raise UserError(
            f"the {path.stem} split ({path}) has {n} tokens, fewer than block_size + 1 = "
            f"{block_size + 1}; use a smaller --block-size or more data"
        )
    return np.lib.stride_tricks.sliding_window_view(data, block_size + 1), n


def _split(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))


def to_device(x: torch.Tensor, y: torch.Tensor, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a CPU batch to device; on CUDA through pinned memory, without blocking."""
    device = torch.device(device)
    if device.type == "cuda":
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    if device.type != "cpu":
        return x.to(device), y.to(device)
    return x, y


class BatchLoader:
    """Endless stream of training batches; see the module docstring for the sampling modes."""

    def __init__(
        self,
        path: str | os.PathLike,
        block_size: int,
        batch_size: int,
        device: str | torch.device = "cpu",
        seed: int = 1337,
        rank: int = 0,
        world_size: int = 1,
        sampling: str = "random",
    ) -> None:
        if sampling not in SAMPLINGS:
            raise UserError(f"unknown sampling {sampling!r}; choose one of: {', '.join(SAMPLINGS)}")
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.path = Path(path)
        self.block_size, self.batch_size = block_size, batch_size
        self.device = torch.device(device)
        self.seed, self.rank, self.world_size, self.sampling = seed, rank, world_size, sampling
        self._windows, self.n_tokens = _load_windows(self.path, block_size)
        self.step = 0
        if sampling == "epoch":
            self.n_windows = (self.n_tokens - 1) // block_size
            self.windows_per_rank = self.n_windows // world_size
            if self.windows_per_rank == 0:
                raise UserError(
                    f"the {self.path.stem} split has {self.n_windows} windows of block_size "
                    f"{block_size}, fewer than world_size {world_size}; use more data or fewer ranks"
                )
            self._perm_cache: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            mine = perm[self.rank : self.windows_per_rank * self.world_size : self.world_size]
            self._perm_cache = (epoch, mine)
        return self._perm_cache[1]

    def _starts(self, step: int) -> np.ndarray:
        if self.sampling == "random":
            rng = np.random.default_rng([self.seed, self.rank, step])
            return rng.integers(0, len(self._windows), size=self.batch_size)
        pos = step * self.batch_size + np.arange(self.batch_size)
        epochs, idx = np.divmod(pos, self.windows_per_rank)
        window = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(epochs):  # one or two epochs per batch unless batches exceed an epoch
            sel = epochs == e
            window[sel] = self._perm(int(e))[idx[sel]]
        return window * self.block_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (batch_size, block_size) int64 on the loader's device."""
        rows = self._windows[self._starts(self.step)]
        self.step += 1
        return to_device(*_split(rows), self.device)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sampling": self.sampling, "seed": self.seed,
                "block_size": self.block_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Only the counter matters; other fields are informational so a resumed run that
        # changes, say, batch_size still continues (just not bit-identically).
        self.step = int(state["step"])


def eval_batches(
    path: str | os.PathLike,
    block_size: int,
    batch_size: int,
    device: str | torch.device = "cpu",
    max_batches: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic pass over the non-overlapping windows starting at 0, block_size, 2*block_size...

    The last batch may be smaller than batch_size. With max_batches, stops after that many.
    """
    windows, _ = _load_windows(path, block_size)  # checked now, not at the first next()
    starts = np.arange(0, len(windows), block_size)
    if max_batches is not None:
        starts = starts[: max_batches * batch_size]
    device = torch.device(device)
    return (to_device(*_split(windows[starts[i : i + batch_size]]), device)
            for i in range(0, len(starts), batch_size))
