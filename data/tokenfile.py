"""Token files (train.bin / val.bin): a 32-byte header followed by the raw token ids.

Header (little-endian): magic b"GPTTOK\\0\\0" (8 bytes), format version (uint32), dtype code
(uint32: 2 = uint16, 4 = uint32, i.e. bytes per token), token count (uint64), 8 reserved zero
bytes. uint16 is used whenever the vocabulary fits (GPT-2's 50257 does), halving disk and page
cache. ``read_tokens`` checks every header field against the file size and returns a read-only
memmap (no copy). ``write_tokens`` writes a temporary file beside the target and renames it into
place, so a crash never leaves a half-written token file under the real name.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from errors import UserError

MAGIC = b"GPTTOK\0\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, dtype code, token count, reserved
HEADER_SIZE = HEADER.size  # 32: keeps the token array 4- and 8-byte aligned in the memmap
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest supported dtype holding ids 0..vocab_size-1."""
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def _bad(path: Path, problem: str) -> UserError:
    return UserError(f"token file {path} {problem}; re-run `python -m data.prepare` to rebuild it")


def read_header(path: str | os.PathLike) -> tuple[np.dtype, int]:
    """(dtype, token count) of a token file, after checking magic, version, dtype and size."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token file {path} does not exist; run `python -m data.prepare` first")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        raise _bad(path, f"is truncated ({size} bytes, shorter than its {HEADER_SIZE}-byte header)")
    magic, version, code, count = HEADER.unpack(head)
    if magic != MAGIC:
        raise _bad(path, "is not a token file (bad magic bytes)")
    if version != VERSION:
        raise _bad(path, f"has format version {version}, this code reads version {VERSION}")
    if code not in _DTYPES:
        raise _bad(path, f"has unknown dtype code {code}")
    dtype = _DTYPES[code]
    expected = HEADER_SIZE + count * dtype.itemsize
    if size != expected:
        raise _bad(path, f"has {size} bytes but its header promises {count} tokens ({expected} bytes)")
    return dtype, count


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """The tokens of ``path`` as a read-only numpy memmap (shape (count,), uint16 or uint32)."""
    dtype, count = read_header(path)
    if count == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(count,))


def write_tokens(
    path: str | os.PathLike,
    tokens: np.ndarray | Iterable[np.ndarray] | Iterable[int],
    vocab_size: int,
) -> int:
    """Write ``tokens`` (an array, or an iterable of arrays for streaming) atomically; returns the count.

    The dtype is chosen from ``vocab_size``; ids outside 0..vocab_size-1 are a bug and raise.
    """
    path = Path(path)
    dtype = dtype_for_vocab(vocab_size)
    if isinstance(tokens, np.ndarray):
        chunks: Iterable = [tokens]
    elif isinstance(tokens, (list, tuple)) and (not tokens or np.isscalar(tokens[0])):
        chunks = [np.asarray(tokens, dtype=np.int64)]
    else:
        chunks = tokens
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, 0))  # count is patched in below
            for chunk in chunks:
                chunk = np.asarray(chunk)
                if chunk.size == 0:
                    continue
                lo, hi = int(chunk.min()), int(chunk.max())
                if lo < 0 or hi >= vocab_size:
                    bad = hi if hi >= vocab_size else lo
                    raise ValueError(f"token id {bad} outside vocab of size {vocab_size}")
                f.write(memoryview(np.ascontiguousarray(chunk, dtype=dtype)))
                count += chunk.size
            f.seek(0)
            f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, count))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return count


def truncate_tokens(path: str | os.PathLike, count: int) -> None:
    """Keep only the first ``count`` tokens of a token file, in place (no mmap of it may be open)."""
    path = Path(path)
    dtype, total = read_header(path)
    if not 0 <= count <= total:
        raise ValueError(f"cannot truncate {total} tokens to {count}")
    with open(path, "r+b") as f:
        f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, count))
        f.truncate(HEADER_SIZE + count * dtype.itemsize)
        f.flush()
        os.fsync(f.fileno())
