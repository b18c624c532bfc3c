"""Checkpoints: atomic writes, safe loads, RNG capture, clear errors."""

import argparse
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from configs.errors import UserError
from model import GPT, GPTConfig, checkpoint
from model.checkpoint import find_checkpoint, load_checkpoint, load_model, save_checkpoint
from training.run import lock_run_dir
from training.runtime import capture_rng_state, restore_rng_state

ROOT = Path(__file__).resolve().parent.parent


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    return {"model": model.state_dict(), "model_config": model.config.to_dict(), "step": seed,
            "rng": capture_rng_state()}


def test_roundtrip_is_weights_only_and_loads_a_model(tmp_path):
    path = save_checkpoint(tmp_path, _state(1))
    raw = torch.load(path, weights_only=True)
    assert raw["step"] == 1 and raw["version"] == checkpoint.VERSION
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in raw["model"])
    model, ckpt = load_model(tmp_path)
    assert find_checkpoint(tmp_path) == find_checkpoint(path) == path
    assert not model.training and torch.equal(model.lm_head.weight, raw["model"]["lm_head.weight"])


def test_rng_state_restores_every_stream():
    state = capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    torch.save(state, buf := __import__("io").BytesIO())
    buf.seek(0)
    restore_rng_state(torch.load(buf, weights_only=True))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(1))
    real_save = torch.save

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip")  # some bytes land on disk, then the disk "fills up"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(UserError, match=r"could not write .*ckpt.pt \(No space left on device\); its previous"):
        save_checkpoint(tmp_path, _state(2))
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(tmp_path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temp file left behind


def test_missing_and_corrupt_checkpoints_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no checkpoint at"):
        find_checkpoint(tmp_path / "nothing")
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(tmp_path)
    torch.save({"weights": torch.zeros(1)}, tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match="not a checkpoint of this project"):
        load_checkpoint(tmp_path)
    torch.save({"model": {}, "args": argparse.Namespace()}, tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match=r"pickled Python objects \(argparse.Namespace\), which could run code") as e:
        load_checkpoint(tmp_path)
    assert "weights_only" not in str(e.value)  # torch's advice to load it anyway is wrong for an untrusted file


def test_run_dir_lock_dies_with_its_process_and_its_temp_files_are_removed(tmp_path):
    code = "import sys, time; from training.run import lock_run_dir; lock = lock_run_dir(sys.argv[1]); print('locked'); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-u", "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(UserError, match=rf"{tmp_path} is in use by another run \(pid {holder.pid}\)"):
            lock_run_dir(tmp_path)
        for name in ("ckpt.pt", "best.pt"):  # as if killed while saving
            (tmp_path / f".{name}.{holder.pid}.tmp").write_bytes(b"half a checkpoint")
    finally:
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait()
    lock_run_dir(tmp_path).close()  # no stale lock
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_a_missing_checkpoint_names_its_own_run_and_a_lone_best_pt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"no checkpoint at out/tiny/ckpt.pt; train one first: `python train.py --config tiny`"):
        find_checkpoint("out/tiny", config="tiny")  # sample.py --config tiny
    with pytest.raises(UserError, match=r"train one first: `python train.py --config small --out-dir out/mine`"):
        find_checkpoint("out/mine")  # no preset is named mine: was `--config mine`
    with pytest.raises(UserError, match=r"train one first: `python train.py --config small --out-dir runs/mine`"):
        find_checkpoint("runs/mine")
    save_checkpoint(tmp_path / "runs/kept", _state(1))
    (tmp_path / "runs/kept/ckpt.pt").rename(tmp_path / "runs/kept/best.pt")
    assert find_checkpoint("runs/kept", best=True).name == "best.pt"
    with pytest.raises(UserError, match=r"runs/kept has best.pt but no ckpt.pt to resume; fine-tune from it with "
                                        r"--init-from runs/kept, or copy runs/kept/best.pt to runs/kept/ckpt.pt"):
        load_checkpoint(Path("runs/kept/ckpt.pt"))  # what train.py --resume loads


def test_a_plain_file_or_an_empty_path_is_not_taken_for_a_run_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(UserError, match=r"notes.txt is a file, not a checkpoint \(.pt\) or run directory; give a run"):
        find_checkpoint(tmp_path / "notes.txt", best=True)  # was: no checkpoint at notes.txt/ckpt.pt; train one
    with pytest.raises(UserError, match=r"^an empty run path names nothing; give a run directory or a .pt file$"):
        find_checkpoint("")  # was: no checkpoint at ckpt.pt; ... --out-dir .


def test_random_bytes_are_not_called_code_and_a_truncated_file_is_one_short_line(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(UserError, match="corrupt or not a checkpoint") as e:
        load_checkpoint(tmp_path)
    assert "pickled" not in str(e.value) and "could run code" not in str(e.value)
    save_checkpoint(tmp_path, _state(1))
    whole = (tmp_path / "ckpt.pt").read_bytes()
    (tmp_path / "ckpt.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match="corrupt or not a checkpoint") as e:
        load_checkpoint(tmp_path)
    assert len(str(e.value)) < 250 and "miniz" not in str(e.value), str(e.value)


def test_a_prepared_dataset_is_not_taken_for_a_run_to_train_into(tmp_path):
    for name in ("manifest.json", "train.bin", "val.bin"):  # what data.prepare writes
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(UserError, match=rf"^{tmp_path} is a prepared dataset, not a run; give a run directory or a "
                                        r"\.pt file$"):  # was: no checkpoint at ...; train one first: ... --out-dir
        find_checkpoint(tmp_path, best=True)
