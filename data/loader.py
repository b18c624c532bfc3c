"""Token files (train.bin, val.bin), and the batches of windows drawn from them.

A token file is a 32-byte header (magic, version, bytes per token, count), then the ids: uint16
when the vocabulary fits, as GPT-2's does. A batch row is a window w of block_size + 1 tokens:
x = w[:-1], y = w[1:].
"""

import os
import struct

import numpy as np
import torch

from configs import UserError

HEADER = struct.Struct("<8sIIQ8x")  # magic, version, bytes per token, token count
MAGIC, VERSION = b"GPTTOK\0\0", 1


def write_tokens(path, chunks, vocab_size: int) -> int:
    """Write the arrays of ids in chunks to path, one after the other; return how many ids."""
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    with open(path, "wb") as f:
        f.seek(HEADER.size)  # the header goes in once the count is known, at the end
        for chunk in chunks:
            np.asarray(chunk, dtype).tofile(f)
        count = (f.tell() - HEADER.size) // dtype.itemsize
        f.seek(0)
        f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, count))
        f.flush()
        os.fsync(f.fileno())
    return count


def read_tokens(path) -> np.ndarray:
    """A token file's ids, memory-mapped, once its header agrees with its size."""
    fix = "prepare the dataset again, with --force"
    try:
        with open(path, "rb") as f:
            magic, version, itemsize, count = HEADER.unpack(
                f.read(HEADER.size).ljust(HEADER.size, b"\0")
            )
    except OSError as e:  # gone, unreadable, or a folder
        raise UserError(f"{path}: {e.strerror}; {fix}") from None
    if (magic, version) != (MAGIC, VERSION) or os.path.getsize(
        path
    ) != HEADER.size + itemsize * count:
        raise UserError(f"{path} is not a whole token file of this version; {fix}")
    dtype = np.uint16 if itemsize == 2 else np.uint32
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))


def windows(path, block_size: int) -> np.ndarray:
    """Every window of block_size + 1 tokens, as a view: (tokens - block_size, block_size + 1)."""
    tokens = read_tokens(path)
    if len(tokens) <= block_size:
        raise UserError(
            f"{path} holds {len(tokens)} tokens, not a block of {block_size} and one more; "
            "lower --block-size, or prepare more text"
        )
    return np.lib.stride_tricks.sliding_window_view(tokens, block_size + 1)


def to_device(rows: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows (B, T + 1) -> x, y (B, T) int64 on the device (to a GPU by pinned memory)."""
    rows = torch.from_numpy(rows.astype(np.int64))
    if torch.device(device).type == "cuda":
        rows = rows.pin_memory().to(device, non_blocking=True)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


class Batches:
    """The training batches. A step's rows are drawn at random from (seed, step) alone, so that a
    run resumes exactly, on any number of processes; each takes its share, as grad_accum batches."""

    def __init__(self, path, block_size, batch_size, grad_accum, rank, world_size, seed, device):
        self.windows, self.seed, self.device = windows(path, block_size), seed, device
        self.rows, self.batch_size = grad_accum * world_size * batch_size, batch_size
        # Micro-step m of process r takes rows [m, r] of the step's draw, whatever the processes.
        rows = np.arange(self.rows).reshape(grad_accum, world_size, batch_size)
        self.mine = rows[:, rank].reshape(-1)

    def __call__(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # The 0 names this stream of draws; it keeps the batches of this project's earlier versions.
        rng = np.random.default_rng([self.seed, 0, step])
        starts = rng.integers(0, len(self.windows), self.rows)
        x, y = to_device(self.windows[starts[self.mine]], self.device)
        return list(zip(x.split(self.batch_size), y.split(self.batch_size)))


def eval_batches(path, block_size, batch_size, device, limit=0, rank=0, world_size=1):
    """This process's share of the first `limit` batches (0: all) of the windows at 0, block_size,
    2 * block_size...; the last batch may be short."""
    every = windows(path, block_size)
    starts = np.arange(0, len(every), block_size)
    batches = [starts[i : i + batch_size] for i in range(0, len(starts), batch_size)][
        : limit or None
    ]
    return (to_device(every[rows], device) for rows in batches[rank::world_size])
