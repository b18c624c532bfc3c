"""Batches of (x, y) token windows from a token file, for training and evaluation.

A window is block_size + 1 consecutive tokens w, x = w[:-1], y = w[1:]; a batch is one numpy fancy
index into a sliding-window view of the memmap. Each optimizer step draws batch_size windows:
  "random"  starts uniform in [0, n - block_size), with replacement (as nanoGPT), seeded by (seed, step)
  "epoch"   the non-overlapping windows (starts at multiples of block_size), each epoch in a fresh
            order seeded by (seed, epoch); epochs run on end to end, so no window is skipped.
A draw depends only on (seed, sampling, batch_size, step): the loader's state is the step counter.

``GlobalBatchLoader`` cuts each draw into grad_accum x world_size slices; micro-step m of process r
takes slice m * world_size + r. A step's rows thus do not depend on how it is split between
processes and accumulation, and rank 0's saved state resumes a run on any process count.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from configs.errors import UserError

from .tokenfile import read_tokens

SAMPLINGS = ("random", "epoch")


def _load_windows(path: str | os.PathLike, block_size: int) -> tuple[np.ndarray, int]:
    """(sliding-window view of shape (n - block_size, block_size + 1), n) after a length check."""
    path = Path(path)
    data = np.asarray(read_tokens(path))  # a plain ndarray view of the memmap: no copy
    n = len(data)
    if n < block_size + 1:
        raise UserError(f"the {path.stem} split ({path}) has {n} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}; use a smaller --block-size or more data")
    return np.lib.stride_tricks.sliding_window_view(data, block_size + 1), n


def _split(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))


def to_device(x: torch.Tensor, y: torch.Tensor, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a CPU batch to device; on CUDA through pinned memory, without blocking."""
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)  # no copy when device is the CPU


class BatchLoader:
    """One draw of batch_size windows per step, endlessly; see the module docstring."""

    def __init__(self, path: str | os.PathLike, block_size: int, batch_size: int, seed: int = 1337,
                 sampling: str = "random") -> None:
        if sampling not in SAMPLINGS:
            raise UserError(f"unknown sampling {sampling!r}; choose one of: {', '.join(SAMPLINGS)}")
        self.block_size, self.batch_size, self.seed, self.sampling = block_size, batch_size, seed, sampling
        self._windows, self.n_tokens = _load_windows(path, block_size)
        self.n_windows = (self.n_tokens - 1) // block_size  # the non-overlapping ones ("epoch")
        self.step = 0
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._perm_cache[1]

    def _starts(self, step: int) -> np.ndarray:
        if self.sampling == "random":
            # the 0 is left from when each rank drew its own rows: one-process runs keep rank 0's batches
            return np.random.default_rng([self.seed, 0, step]).integers(0, len(self._windows), size=self.batch_size)
        pos = step * self.batch_size + np.arange(self.batch_size)
        epochs, idx = np.divmod(pos, self.n_windows)
        window = np.array([self._perm(int(e))[i] for e, i in zip(epochs, idx)], dtype=np.int64)
        return window * self.block_size

    def next_batch(self, rows: np.ndarray | slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's draw (only its windows at index `rows`): (x, y) int64 on the CPU."""
        windows = self._windows[self._starts(self.step)[rows]]
        self.step += 1
        return _split(windows)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sampling": self.sampling, "seed": self.seed,
                "block_size": self.block_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Only the counter matters; other fields are informational so a resumed run that
        # changes, say, --tokens-per-step still continues (just not bit-identically).
        self.step = int(state["step"])


class GlobalBatchLoader(BatchLoader):
    """This process's micro-batches of each optimizer step's draw; see the module docstring."""

    def __init__(self, path: str | os.PathLike, block_size: int, rows_per_step: int, grad_accum: int = 1,
                 rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu", seed: int = 1337,
                 sampling: str = "random") -> None:
        super().__init__(path, block_size, rows_per_step, seed, sampling)
        self.micro_rows = rows_per_step // (grad_accum * world_size)
        # (rows_per_step,) -> (grad_accum, world_size, micro_rows) -> this rank's (grad_accum * micro_rows,)
        self.mine = np.arange(rows_per_step).reshape(grad_accum, world_size, self.micro_rows)[:, rank].reshape(-1)
        self.device = torch.device(device)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """grad_accum (x, y) micro-batches, each (micro_rows, block_size) int64 on the device."""
        x, y = to_device(*self.next_batch(self.mine), self.device)  # only this rank's rows are read
        return list(zip(x.split(self.micro_rows), y.split(self.micro_rows)))


def eval_batches(path: str | os.PathLike, block_size: int, batch_size: int, device: str | torch.device = "cpu",
                 max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A deterministic pass over the non-overlapping windows from 0, block_size, ...; the last batch may be short."""
    windows, _ = _load_windows(path, block_size)  # checked now, not at the first next()
    starts = np.arange(0, len(windows), block_size)
    if max_batches is not None:
        starts = starts[: max_batches * batch_size]
    return (to_device(*_split(windows[starts[i : i + batch_size]]), device) for i in range(0, len(starts), batch_size))
