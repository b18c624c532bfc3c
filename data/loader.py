"""Batches of (x, y) token windows from a token file, for training and evaluation.

A window is block_size + 1 consecutive tokens w, with x = w[:-1] and y = w[1:]. Each optimizer step draws
batch_size windows. "random" starts them uniformly in [0, n - block_size), with replacement, as nanoGPT does;
"epoch" takes the non-overlapping windows, each epoch in a fresh order, so none is skipped. A draw depends only
on (seed, sampling, batch_size, step), so the step counter is the loader's whole state. ``GlobalBatchLoader``
gives micro-step m of process r slice m * world_size + r of the draw, so a step's rows do not depend on the
process count, and rank 0's state resumes a run on any.
"""

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from configs.errors import UserError

from .tokenfile import read_tokens


def _load_windows(path: str | os.PathLike, block_size: int) -> tuple[np.ndarray, int]:
    """A sliding-window view of the split, shape (n - block_size, block_size + 1), and n, its length."""
    path = Path(path)
    data = np.asarray(read_tokens(path))  # a plain ndarray view of the memmap, not a copy
    n = len(data)
    if n < block_size + 1:
        raise UserError(f"the {path.stem} split ({path}) has {n} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}; use a smaller --block-size or more data")
    return np.lib.stride_tricks.sliding_window_view(data, block_size + 1), n


def _batch(rows: np.ndarray, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 from windows, on device. CUDA gets them through pinned memory, without blocking."""
    x, y = torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)  # no copy when device is the CPU


class BatchLoader:
    """One draw of batch_size windows per step, endlessly (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, block_size: int, batch_size: int, seed: int = 1337,
                 sampling: str = "random") -> None:
        self.block_size, self.batch_size, self.seed, self.sampling = block_size, batch_size, seed, sampling
        self._windows, self.n_tokens = _load_windows(path, block_size)
        self.n_windows = n_windows = (self.n_tokens - 1) // block_size  # the non-overlapping ones, for "epoch"
        self.step = 0
        self._perm = functools.lru_cache(maxsize=1)(
            lambda epoch: np.random.default_rng([seed, epoch]).permutation(n_windows))

    def _starts(self, step: int) -> np.ndarray:
        if self.sampling == "random":
            # The 0 is left from when each rank drew its own rows; it keeps one-process runs' batches as they were.
            return np.random.default_rng([self.seed, 0, step]).integers(0, len(self._windows), size=self.batch_size)
        pos = step * self.batch_size + np.arange(self.batch_size)
        epochs, idx = np.divmod(pos, self.n_windows)
        window = np.array([self._perm(int(e))[i] for e, i in zip(epochs, idx)], dtype=np.int64)
        return window * self.block_size

    def next_batch(self, rows: np.ndarray | slice = slice(None),
                   device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's draw, only its windows at index `rows`, as (x, y) int64 on device."""
        windows = self._windows[self._starts(self.step)[rows]]
        self.step += 1
        return _batch(windows, device)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sampling": self.sampling, "seed": self.seed,
                "block_size": self.block_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Only the counter, so a resumed run that changes, say, --tokens-per-step goes on, if not bit-identically."""
        self.step = int(state["step"])


class GlobalBatchLoader(BatchLoader):
    """This process's micro-batches of each optimizer step's draw (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, block_size: int, rows_per_step: int, grad_accum: int = 1,
                 rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu", seed: int = 1337,
                 sampling: str = "random") -> None:
        super().__init__(path, block_size, rows_per_step, seed, sampling)
        self.micro_rows = rows_per_step // (grad_accum * world_size)
        self.mine = np.arange(rows_per_step).reshape(grad_accum, world_size, self.micro_rows)[:, rank].reshape(-1)
        self.device = torch.device(device)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """grad_accum (x, y) micro-batches, each (micro_rows, block_size) int64 on the device."""
        x, y = self.next_batch(self.mine, self.device)  # reads only this rank's rows
        return list(zip(x.split(self.micro_rows), y.split(self.micro_rows)))


def eval_batches(path: str | os.PathLike, block_size: int, batch_size: int, device: str | torch.device = "cpu",
                 max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A deterministic pass over the non-overlapping windows at 0, block_size, ... The last batch may be short."""
    windows, _ = _load_windows(path, block_size)  # checked now, not at the first next()
    starts = np.arange(0, len(windows), block_size)
    if max_batches is not None:
        starts = starts[: max_batches * batch_size]
    return (_batch(windows[starts[i : i + batch_size]], device) for i in range(0, len(starts), batch_size))
