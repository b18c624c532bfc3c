"""Run directories on disk: one writer at a time, atomic writes, safe loads, RNG state capture.

A run directory (out/<config>/) holds ckpt.pt (the latest, what --resume continues), best.pt
(the checkpoint with the lowest val loss so far), config.json, manifest.json, metrics.jsonl,
loss.png and .lock (held by the run writing there: lock_run_dir). A checkpoint is one dict of
tensors and plain Python containers, so it loads with `torch.load(weights_only=True)` (no
pickled code runs when opening a checkpoint):

    model          state_dict of the raw module (never the compiled or DDP wrapper)
    model_config   dataclasses.asdict(GPTConfig)
    train_config   dataclasses.asdict(TrainConfig)
    optimizer, scaler, step, loader, rng, best_val, wandb_id, manifest, version

    path = find_checkpoint("out/small")          # a run dir (its ckpt.pt), a .pt file, or None -> out/small
    path = find_checkpoint("out/small", best=True)   # its best.pt when there is one
    model, ckpt = load_model(path, device="cpu")
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from errors import UserError

CKPT_NAME = "ckpt.pt"
BEST_NAME = "best.pt"
LOCK_NAME = ".lock"
DEFAULT_RUN = "out/small"
VERSION = 1


def atomic_write(path: Path, write) -> None:
    """Write via a temp file in the same directory, fsync, then os.replace.

    os.replace is atomic within a filesystem, so a reader (or a crash, or a full disk) sees the
    old file or the new one, never half of one. A failed write (disk full, file-size limit) is
    one UserError that says the old file is kept.
    """
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


@contextlib.contextmanager
def write_errors(path: Path) -> Iterator[None]:
    """Turn an OSError while writing path (torch.save wraps it in a RuntimeError) into one line."""
    try:
        yield
    except Exception as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise  # not a failed write: a bug, keep the traceback
        raise UserError(f"could not write {path} ({cause.strerror or cause}); its previous version, if any, is "
                        "kept; free disk space (or raise the file-size limit) or pick another --out-dir") from None


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Atomically write state (tensors and plain containers only) to run_dir/ckpt.pt."""
    path = Path(run_dir) / CKPT_NAME
    atomic_write(path, lambda f: torch.save({"version": VERSION, **state}, f))
    return path


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write(Path(path), lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def lock_run_dir(run_dir: str | Path) -> IO[str]:
    """Create run_dir and lock it for this process: a second run on it fails at once instead of
    mixing its files with ours. Keep the returned file open for the run; closing it releases the
    lock, and so does the process ending in any way (flock locks die with their process, so a
    kill -9 leaves no stale lock). Temp files left by killed saves are removed here."""
    import fcntl

    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / LOCK_NAME, "a+")
    except OSError as e:
        what = "is a file, not a directory" if run_dir.is_file() else f"cannot be written ({e.strerror}: {e.filename})"
        raise UserError(f"--out-dir {run_dir} {what}; pick another --out-dir") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise UserError(f"{run_dir} is in use by another run (pid {holder}); wait for it to finish, "
                        "or pick another --out-dir") from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    # Every writer of this directory holds the lock, so these temp files' writers are dead.
    stale = [p for p in run_dir.glob(".*.*.tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        print(f"note: removed {len(stale)} temp file(s) of interrupted saves from {run_dir}")
    return lock


def find_checkpoint(path: str | Path | None = None, best: bool = False) -> Path:
    """The checkpoint of a run dir (best=True: its best.pt if it has one, else ckpt.pt) or a
    .pt file; None means the default run, out/small."""
    p = Path(path if path is not None else DEFAULT_RUN)
    if p.is_dir() or p.suffix != ".pt":
        p = p / BEST_NAME if best and (p / BEST_NAME).is_file() else p / CKPT_NAME
    if p.is_file():
        return p
    runs = sorted(str(c.parent) for c in Path("out").glob(f"*/{CKPT_NAME}")) if Path("out").is_dir() else []
    hint = f" (runs with a checkpoint: {', '.join(runs)})" if runs else ""
    raise UserError(f"no checkpoint at {p}; train one first, e.g. `python train.py --config small`{hint}")


def keep_best(run_dir: str | Path) -> Path:
    """Make best.pt the ckpt.pt just written: a hard link (no copy; the next atomic replace of
    ckpt.pt makes a new file and leaves this one alone), or a copy where links are not allowed."""
    run_dir = Path(run_dir)
    best, tmp = run_dir / BEST_NAME, run_dir / f".{BEST_NAME}.{os.getpid()}.tmp"
    try:
        with write_errors(best):
            try:
                os.link(run_dir / CKPT_NAME, tmp)
            except OSError:
                shutil.copyfile(run_dir / CKPT_NAME, tmp)
            os.replace(tmp, best)
    finally:
        tmp.unlink(missing_ok=True)
    return best


def is_checkpoint(path: str | Path) -> bool:
    """A run directory holding ckpt.pt, or a checkpoint file."""
    p = Path(path)
    return (p / CKPT_NAME).is_file() or (p.suffix == ".pt" and p.is_file())


def load_checkpoint(path: str | Path | None = None, map_location: str | torch.device = "cpu",
                    best: bool = False) -> dict[str, Any]:
    """Load a checkpoint dict safely (weights_only); a clear UserError if it is not one."""
    p = find_checkpoint(path, best)
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, random bytes, pickled objects...: all unusable
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if reason.startswith("Weights only load failed"):  # not torch's advice: weights_only=False runs its code
            found = re.search(r"GLOBAL (\S+)", str(e))
            reason = f"it holds pickled Python objects{f' ({found[1]})' if found else ''}, which could run code"
        raise UserError(f"checkpoint {p} is corrupt or not a checkpoint ({reason}); "
                        "delete it or point to another run") from None
    if not isinstance(ckpt, dict) or not {"model", "model_config"} <= ckpt.keys():
        raise UserError(f"{p} is not a checkpoint of this project (no model/model_config); "
                        "for Hugging Face GPT-2 weights use --init-from <dir>")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], where: str | Path, **overrides: Any):
    """The GPT a checkpoint (the file `where`) describes, with its weights (overrides, e.g.
    dropout, go into GPTConfig)."""
    from model import GPT, GPTConfig

    try:
        model = GPT(GPTConfig.from_dict({**ckpt["model_config"], **overrides}))
        model.load_state_dict(ckpt["model"])
    except (TypeError, KeyError, RuntimeError, AttributeError) as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {where}: weights do not match its model_config ({reason}); "
                        "the file is damaged or from another project") from None
    return model


def checkpoint_manifest(path: Path, ckpt: dict[str, Any]) -> dict[str, Any]:
    """The data manifest the checkpoint at path was trained with: the copy inside it, which the
    manifest.json beside it must match; that file alone for a checkpoint without a copy."""
    from data.manifest import check_manifest, differences, read_manifest

    file, saved = path.parent / "manifest.json", ckpt.get("manifest")
    if saved is None:
        if not file.is_file():
            raise UserError(f"{path.parent} has no manifest.json, so the tokenizer is unknown; copy "
                            "data/prepared/<dataset>/manifest.json into the run dir")
        return read_manifest(file, "copy data/prepared/<dataset>/manifest.json there again")
    saved = check_manifest(saved, f"the manifest inside {path}", "the checkpoint is damaged")
    if file.is_file():
        on_disk = read_manifest(file, f"delete it: {path.name} carries its own copy")
        if changes := differences(saved, on_disk):
            raise UserError(f"{file} is not the data {path.name} was trained on ({', '.join(changes)}): the run "
                            f"dir mixes two runs; delete that manifest.json to sample {path.name} with its own copy")
    return saved


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu", best: bool = False):
    """(GPT, checkpoint dict) from a run dir or ckpt file, in eval mode on `device`."""
    path = find_checkpoint(path, best)
    ckpt = load_checkpoint(path, map_location="cpu")
    return model_from_checkpoint(ckpt, path).to(device).eval(), ckpt


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step can touch, as tensors/lists (weights_only-safe)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    # a checkpoint moved to a machine with a different GPU count keeps the other RNGs as seeded
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.cpu() for t in cuda])
