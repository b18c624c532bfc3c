"""Token files (train.bin, val.bin): a 32-byte little-endian header, then the raw token ids.

Ids are uint16 whenever the vocabulary fits, as GPT-2's 50257 does: half the disk and page cache of uint32.
"""

import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import numpy as np

from configs.errors import UserError

from .files import atomic_write

MAGIC = b"GPTTOK\0\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, dtype code (bytes per token), token count, reserved
HEADER_SIZE = HEADER.size  # 32, which keeps the token array 4- and 8-byte aligned in the memmap
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest supported dtype that holds ids 0..vocab_size-1."""
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def read_header(path: str | os.PathLike) -> tuple[np.dtype, int]:
    """The dtype and token count of a token file, after its magic, version, dtype and size are checked."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token file {path} does not exist; run `python -m data.prepare` first")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    magic, version, code, count = HEADER.unpack(head.ljust(HEADER_SIZE, b"\0"))
    expected = HEADER_SIZE + count * code  # the code is the bytes per token
    problem = (f"is truncated ({size} bytes, shorter than its {HEADER_SIZE}-byte header)" if len(head) < HEADER_SIZE
               else "is not a token file (bad magic bytes)" if magic != MAGIC
               else f"has format version {version}, this code reads version {VERSION}" if version != VERSION
               else f"has unknown dtype code {code}" if code not in _DTYPES
               else f"has {size} bytes but its header promises {count} tokens ({expected} bytes)" if size != expected
               else None)
    if problem:
        raise UserError(f"token file {path} {problem}; re-run `python -m data.prepare` to rebuild it")
    return _DTYPES[code], count


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """The tokens of ``path`` as a read-only numpy memmap (shape (count,), uint16 or uint32)."""
    dtype, count = read_header(path)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(count,))


def write_tokens(path: str | os.PathLike, tokens: np.ndarray | Iterable[int] | Iterator[np.ndarray],
                 vocab_size: int) -> int:
    """Write ``tokens`` (an array or a list of ids, or an iterator of arrays, streamed) whole or not at all, and
    return the count. The dtype follows ``vocab_size``; an id outside 0..vocab_size-1 is a bug (ValueError)."""
    dtype = dtype_for_vocab(vocab_size)
    chunks = tokens if isinstance(tokens, Iterator) else [tokens]

    def write(f: IO[bytes]) -> None:
        f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, 0))  # the count is patched in below
        for chunk in map(np.asarray, chunks):
            if (bad := chunk[(chunk < 0) | (chunk >= vocab_size)]).size:
                raise ValueError(f"token id {bad[0]} outside vocab of size {vocab_size}")
            f.write(memoryview(np.ascontiguousarray(chunk, dtype=dtype)))
        count = (f.tell() - HEADER_SIZE) // dtype.itemsize
        f.seek(0)
        f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, count))

    atomic_write(Path(path), write)
    return (Path(path).stat().st_size - HEADER_SIZE) // dtype.itemsize


def truncate_tokens(path: str | os.PathLike, count: int) -> None:
    """Keep only the first ``count`` tokens of a token file, in place. No memmap of it may be open."""
    dtype, _ = read_header(path)
    with open(path, "r+b") as f:
        f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, count))
        f.truncate(HEADER_SIZE + count * dtype.itemsize)
        f.flush()
        os.fsync(f.fileno())
