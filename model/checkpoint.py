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

from configs import UserError, replacing

from .gpt import GPT, GPTConfig


def save_checkpoint(checkpoint: dict, path: Path) -> None:
    """Write path whole or not at all."""
    with replacing(path) as tmp:
        torch.save(checkpoint, tmp)


def keep_best(run_dir: Path) -> None:
    """Make best.pt the ckpt.pt just written: a hard link, which later saves (new files) spare."""
    with replacing(run_dir / "best.pt") as tmp:
        try:
            os.link(run_dir / "ckpt.pt", tmp)
        except OSError:  # a file system without hard links
            shutil.copyfile(run_dir / "ckpt.pt", tmp)


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
        with torch.device("meta"):  # its weights fit its shape: checked without memory
            model = GPT(GPTConfig(**checkpoint["model_config"]))
        shapes = lambda weights: {k: v.shape for k, v in weights.items()}
        if shapes(model.state_dict()) != shapes(checkpoint["model"]):
            raise ValueError("its weights are not of its model_config's shapes")
        checkpoint["manifest"]["vocab_size"]  # and a manifest that names its vocabulary
    except Exception as e:
        why = (str(e) or type(e).__name__).splitlines()[0][:120]  # an empty file's has no text
        raise UserError(
            f"{path} is not a checkpoint of this project ({why}); give another, or train again"
        ) from None
    return checkpoint


def model_from(checkpoint: dict, dropout: float = 0.0) -> GPT:
    """The GPT a checkpoint holds, with the dropout of the run that loads it."""
    model = GPT(GPTConfig(**{**checkpoint["model_config"], "dropout": dropout}))
    model.load_state_dict(checkpoint["model"])
    return model
