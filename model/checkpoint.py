"""Checkpoints: saved atomically, found in a run directory, loaded safely, turned back into a GPT.

A run directory (out/<config>/) holds ckpt.pt (the latest, what --resume continues) and best.pt (the lowest
val loss so far). A checkpoint is one dict of tensors and plain containers, so torch.load(weights_only=True)
runs no pickled code: model (a state_dict), model_config, train_config, optimizer, scaler, step, loader, rng,
best_val, wandb_id, manifest, version.
"""

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from configs.errors import UserError, first_line
from configs.model import GPTConfig
from data.files import atomic_write, is_dataset, write_errors

from .gpt import GPT

CKPT_NAME = "ckpt.pt"
BEST_NAME = "best.pt"
VERSION = 1


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Atomically write state (tensors and plain containers only) to run_dir/ckpt.pt."""
    path = Path(run_dir) / CKPT_NAME
    atomic_write(path, lambda f: torch.save({"version": VERSION, **state}, f))
    return path


def find_checkpoint(path: str | Path | None = None, best: bool = False, config: str = "") -> Path:
    """The checkpoint of a run directory (with best, its best.pt if any, else ckpt.pt) or a .pt file; None is
    out/small. config is the --config the run came from, for the hint when there is no checkpoint."""
    if path is not None and not str(path):  # Path("") is ".": it would name the current folder
        raise UserError("an empty run path names nothing; give a run directory or a .pt file")
    p = Path(path if path is not None else "out/small")
    if p.is_file() and p.suffix != ".pt":  # not p/ckpt.pt: no training makes a file a run directory
        raise UserError(f"{p} is a file, not a checkpoint (.pt) or run directory; give a run directory or a .pt file")
    if p.is_dir() or p.suffix != ".pt":
        p = p / BEST_NAME if best and (p / BEST_NAME).is_file() else p / CKPT_NAME
    if p.is_file():
        return p
    run = p.parent
    if p.name == CKPT_NAME and (run / BEST_NAME).is_file():  # what --resume asks for, of a run that kept only best.pt
        raise UserError(f"{run} has {BEST_NAME} but no {CKPT_NAME} to resume; fine-tune from it with --init-from "
                        f"{run}, or copy {run / BEST_NAME} to {p} to resume from there")
    if is_dataset(run):  # training into it is refused, so say what it is
        raise UserError(f"{run} is a prepared dataset, not a run; give a run directory or a .pt file")
    if any((run / w).is_file() for w in ("model.safetensors", "pytorch_model.bin")):  # e.g. an export's output
        raise UserError(f"{run} is an exported Hugging Face model, not a run; load it with transformers, or "
                        f"fine-tune from it with `python train.py --init-from {run}`")
    out_dir = "" if run == Path("out/small") else f" --out-dir {run}"
    train = f"--config {config}" if config else f"--config small{out_dir}"
    runs = sorted(str(c.parent) for c in Path("out").glob(f"*/{CKPT_NAME}"))
    hint = f" (runs with a checkpoint: {', '.join(runs)})" if runs else ""
    raise UserError(f"no checkpoint at {p}; train one first: `python train.py {train}`{hint}")


def keep_best(run_dir: str | Path) -> None:
    """Make best.pt a hard link to the ckpt.pt just written (its next atomic replace leaves best.pt alone),
    or a copy where links are not allowed."""
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


def is_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / CKPT_NAME).is_file() or (p.suffix == ".pt" and p.is_file())


def load_checkpoint(path: str | Path | None = None, best: bool = False) -> dict[str, Any]:
    """Load a checkpoint dict safely (weights_only) onto the CPU; a clear UserError if it is not one."""
    p = find_checkpoint(path, best)
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, random bytes, pickled objects: all unusable
        # At most torch's first sentence, never its advice (weights_only=False would run the file's code).
        reason = f" ({first_line(e).split('. ')[0]})"
        if isinstance(e, pickle.UnpicklingError):  # random bytes (torch's text is only advice), or pickled objects
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(p)
            except (ValueError, RuntimeError):  # not a torch.save zip, or no pickle inside
                unsafe = []
            reason = f" (it holds pickled Python objects ({', '.join(unsafe)}), which could run code)" if unsafe else ""
        raise UserError(f"checkpoint {p} is corrupt or not a checkpoint{reason}; "
                        "delete it or point to another run") from None
    if not isinstance(ckpt, dict) or not {"model", "model_config"} <= ckpt.keys():
        raise UserError(f"{p} is not a checkpoint of this project (no model/model_config); "
                        "for Hugging Face GPT-2 weights use --init-from <dir>")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], where: str | Path, **overrides: Any) -> GPT:
    """The GPT that checkpoint `where` describes, with its weights. overrides (e.g. dropout) go into GPTConfig."""
    try:
        model = GPT(GPTConfig.from_dict(ckpt["model_config"], **overrides))
        model.load_state_dict(ckpt["model"])
    except (TypeError, KeyError, RuntimeError, AttributeError) as e:
        raise UserError(f"checkpoint {where}: weights do not match its model_config ({first_line(e)}); "
                        "the file is damaged or from another project") from None
    if bad := [name for name, p in model.named_parameters() if not p.isfinite().all()]:
        raise UserError(f"checkpoint {where} holds nan/inf weights ({bad[0]}, {len(bad)} tensors in all): it "
                        "diverged before it was saved; use an earlier checkpoint or train again")
    return model


def load_model(path: str | Path | None = None) -> tuple[GPT, dict[str, Any]]:
    """(GPT, checkpoint dict) from a run dir or ckpt file, in eval mode on the CPU."""
    ckpt = load_checkpoint(path)
    return model_from_checkpoint(ckpt, find_checkpoint(path)).eval(), ckpt
