"""Checkpoints: written whole or not at all, found in a run folder, loaded without running code.

A run folder (out/<name>/) holds ckpt.pt, the latest (what --resume continues), and best.pt, the
one with the lowest val loss (what sample.py reads). A checkpoint is a dict of tensors and plain
values: model, model_config, config (the run's settings), optimizer, scaler, state (train.py's
TrainState) and manifest (the data's, which names its tokenizer).
"""

import os
import shutil
from pathlib import Path

import torch

from configs import UserError

from .gpt import GPT, GPTConfig


def save_checkpoint(checkpoint: dict, path: Path) -> None:
    """Write path by way of a temporary file beside it: a crash, a full disk or Ctrl-C leaves the
    old one whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def keep_best(run_dir: Path) -> None:
    """Make best.pt the ckpt.pt just written: a hard link, which later saves (new files) spare."""
    tmp = run_dir / ".best.pt.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(run_dir / "ckpt.pt", tmp)
    except OSError:  # a file system without hard links
        shutil.copyfile(run_dir / "ckpt.pt", tmp)
    os.replace(tmp, run_dir / "best.pt")


def checkpoint_file(path) -> Path:
    """The file a checkpoint is read from: a .pt file, or a run folder's best.pt (else ckpt.pt)."""
    path = Path(path)
    if path.suffix != ".pt":
        path = path / "best.pt" if (path / "best.pt").is_file() else path / "ckpt.pt"
    return path


def load_checkpoint(path) -> dict:
    """A checkpoint on the CPU, from checkpoint_file(path)."""
    path = checkpoint_file(path)
    if not path.is_file():
        hint = "python train.py --config small writes out/small"
        raise UserError(f"no checkpoint at {path}; train one first ({hint})")
    try:  # weights_only: loading a file cannot run code that it holds
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        GPTConfig(**checkpoint["model_config"])
    except Exception as e:
        why = str(e).splitlines()[0][:120]
        raise UserError(f"{path} is not a checkpoint of this project ({why})") from None
    return checkpoint


def model_from(checkpoint: dict, dropout: float = 0.0) -> GPT:
    """The GPT a checkpoint holds, with the dropout of the run that loads it."""
    model = GPT(GPTConfig(**{**checkpoint["model_config"], "dropout": dropout}))
    model.load_state_dict(checkpoint["model"])
    return model


def load_weights(name: str, dropout: float = 0.0) -> tuple[GPT, dict]:
    """--init-from NAME: (the model, the manifest of its data) of a run folder or .pt file of ours,
    else of a Hugging Face GPT-2 folder or hub id (model/hf.py)."""
    path = Path(name)
    if path.suffix == ".pt" or (path / "ckpt.pt").is_file() or (path / "best.pt").is_file():
        checkpoint = load_checkpoint(path)
        return model_from(checkpoint, dropout), checkpoint["manifest"]
    if name.startswith(("/", ".", "~")) and not path.exists():  # a path, not a hub id
        raise UserError(f"--init-from {name}: no such file or folder")
    from .hf import load_gpt2

    return load_gpt2(name, dropout)
