"""Files written whole or not at all: a temporary file beside the target, fsync, then a rename.

A reader, a crash or a full disk then meets the old file or the new one, never half of one.
"""

import contextlib
import ctypes
import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from configs.errors import UserError


def is_dataset(folder: str | Path) -> bool:
    """Whether folder is data.prepare's output. Runs and exports keep a manifest.json too, but no token files."""
    return (Path(folder) / "manifest.json").is_file() and (Path(folder) / "train.bin").is_file()


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write path by write(f) into a temporary file beside it, then rename that. A failed write is one UserError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with write_errors(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def swap_dir(new: Path, dst: Path) -> None:
    """Move folder new to dst in one step. An existing dst goes to new's name, for the caller to delete."""
    libc, a, b = ctypes.CDLL(None, use_errno=True), os.fsencode(new), os.fsencode(dst)
    if not dst.exists():
        os.rename(new, dst)
    elif not ((hasattr(libc, "renameat2") and libc.renameat2(-100, a, -100, b, 2) == 0)  # Linux: RENAME_EXCHANGE
              or (hasattr(libc, "renamex_np") and libc.renamex_np(a, b, 2) == 0)):  # macOS: RENAME_SWAP
        # A filesystem without a swap, such as NFS, takes three renames; a kill between them leaves dst missing.
        os.rename(dst, aside := new.with_name(new.name + ".old"))
        os.rename(new, dst)
        os.rename(aside, new)


@contextlib.contextmanager
def write_errors(path: Path) -> Iterator[None]:
    """Turn an OSError while writing path, which torch.save wraps in a RuntimeError, into one line."""
    try:
        yield
    except UserError:
        raise  # already one line, such as a source that failed while its tokens were being written
    except Exception as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise  # not a failed write but a bug, so keep the traceback
        full = cause.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # not read-only, no permission, ...
        long = cause.errno == errno.ENAMETOOLONG  # a save writes beside its target, under a name 20 characters longer
        files = cause.errno in (errno.EMFILE, errno.ENFILE)
        raise UserError(f"could not write {path} ({cause.strerror or cause}); its previous version, if any, is kept; "
                        + ("free disk space (or raise the file-size limit) or " if full else "")
                        + ("use a shorter name" if long else "raise the open-files limit (ulimit -n)" if files
                           else "pick another output folder")) from None


def write_json(path: str | Path, obj: Any, ensure_ascii: bool = True) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=ensure_ascii) + "\n"
    atomic_write(Path(path), lambda f: f.write(text.encode()))
