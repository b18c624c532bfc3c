"""train.py end to end on the tiny config (CPU, seconds): exact resume, failure modes, logging, DDP."""

import glob
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import train
from checkpoint import load_checkpoint, load_model
from configs import load_config
from data import tokenizer_from_manifest
from errors import UserError
from model import GPT, GPTConfig
from optim import Muon, configure_optimizer, lr_multiplier, orthogonalize

ROOT = Path(__file__).resolve().parent.parent


def tiny(out_dir, data_root, *argv):
    cfg = load_config("tiny", ["--device", "cpu", "--sample-tokens", "0", *argv])
    return replace(cfg, out_dir=str(out_dir), data_root=str(data_root))


def records(run_dir, key):
    lines = (json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl"))
    return {r["step"]: r[key] for r in lines if key in r}


def test_lr_schedules():
    cfg = load_config("tiny", ["--max-iters", "100", "--warmup-iters", "10", "--lr", "1", "--min-lr", "0.1"])
    lrs = [lr_multiplier(s, (s - 10) / 90, cfg) for s in range(120)]
    assert lrs[0] < lrs[9] < 1 and lrs[10] == pytest.approx(1) and lrs[100:] == [0.1] * 20
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine never goes back up
    wsd = replace(cfg, lr_schedule="wsd", decay_frac=0.2)
    assert [lr_multiplier(s, (s - 10) / 90, wsd) for s in (10, 80, 82)] == [1, 1, 1]
    assert lr_multiplier(91, 0.9, wsd) == pytest.approx(0.55)


def test_muon_optimizer_trains_and_orthogonalizes():
    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g, dtype=torch.float32)
    s = torch.linalg.svdvals(o)
    assert o.shape == g.shape and s.min() > 0.6 and s.max() < 1.25  # all directions move alike
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16))
    opt = configure_optimizer(model, load_config("tiny", ["--optimizer", "muon"]), "cpu")
    muon = [o for o in opt.optimizers if isinstance(o, Muon)][0]
    assert {id(p) for p in muon.param_groups[0]["params"]} == {
        id(p) for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
    x = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        loss = model(x, x)[1]
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.8 * losses[0]
    state = opt.state_dict()
    again = configure_optimizer(model, load_config("tiny", ["--optimizer", "muon"]), "cpu")
    again.load_state_dict(state)
    assert torch.equal(again.optimizers[1].state[muon.param_groups[0]["params"][0]]["momentum_buffer"],
                       muon.state[muon.param_groups[0]["params"][0]]["momentum_buffer"])


def test_exact_resume_then_sample(tmp_path, data_root):
    # dropout > 0 so a lost torch RNG state would change the losses; lr_decay_iters pins the schedule
    argv = ["--dropout", "0.1", "--lr-decay-iters", "20", "--eval-interval", "5"]
    full = train.train(tiny(tmp_path / "full", data_root, *argv, "--max-iters", "20"))
    half = train.train(tiny(tmp_path / "half", data_root, *argv, "--max-iters", "10"))
    assert half["step"] == 10 and load_checkpoint(tmp_path / "half")["step"] == 10
    resumed = train.train(tiny(tmp_path / "half", data_root, *argv, "--max-iters", "20", "--resume"))
    assert full["step"] == resumed["step"] == 20 and full["stopped"] == "max_iters"
    losses = records(tmp_path / "full", "loss")
    assert sorted(losses) == list(range(1, 21)) and losses == records(tmp_path / "half", "loss")
    assert records(tmp_path / "full", "val_loss") == records(tmp_path / "half", "val_loss")
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "half")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["best_val"] == b["best_val"] == full["best_val"] and full["val_loss"] == resumed["val_loss"]
    assert resumed["val_loss"] < math.log(65)  # it learned something
    for name in ("ckpt.pt", "config.json", "manifest.json", "metrics.jsonl", "loss.png"):
        assert (tmp_path / "full" / name).is_file()
    assert (tmp_path / "full" / "loss.png").read_bytes()[:4] == b"\x89PNG"

    model, ckpt = load_model(tmp_path / "full")
    tok = tokenizer_from_manifest(ckpt["manifest"])
    idx = torch.tensor([tok.encode("\n")])
    text = tok.decode([int(t[0]) for t in model.generate(idx, 20, generator=torch.Generator().manual_seed(0))])
    assert len(text) == 20


def test_resume_without_checkpoint_is_a_user_error(tmp_path, data_root):
    with pytest.raises(UserError, match="no checkpoint at"):
        train.train(tiny(tmp_path / "none", data_root, "--resume"))


def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_root, monkeypatch):
    forward, calls = GPT.forward, []

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        calls.append(self.training)
        if self.training and calls.count(True) >= 13:  # the 13th training step goes bad
            loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(train.TrainingDiverged, match=r"loss became nan at step 13.*last good checkpoint.*step 10"):
        train.train(tiny(tmp_path, data_root, "--eval-interval", "5"))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 10 and all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert max(records(tmp_path, "loss")) == 12


def test_max_time_budget_includes_final_eval_and_save(tmp_path, data_root):
    # one-time imports (torch.optim pulls in torch._dynamo, ~3 s cold) would eat a 3 s budget
    import matplotlib.pyplot  # noqa: F401
    import torch._dynamo  # noqa: F401

    # (whether the budget holds to the second is a benchmark's business: bench.py time-to-loss)
    result = train.train(tiny(tmp_path, data_root, "--max-iters", "1000000", "--max-time", "3",
                              "--eval-interval", "50"))
    assert result["stopped"] == "max_time"
    assert records(tmp_path, "val_loss").keys() >= {result["step"]}  # the final eval ran
    assert load_checkpoint(tmp_path)["step"] == result["step"] > 20


def test_sigint_saves_and_exits_130(tmp_path, data_root, monkeypatch, capsys):
    forward, calls = GPT.forward, []

    def interrupted(self, idx, targets=None, **kw):
        calls.append(self.training)
        if self.training and calls.count(True) == 4:
            os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C were pressed during step 4
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", interrupted)
    argv = ["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--out-dir", str(tmp_path),
            "--data-root", str(data_root)]
    assert train.main(argv) == 130
    assert load_checkpoint(tmp_path)["step"] == 4 and max(records(tmp_path, "val_loss")) == 4
    assert "stopped at step 4 (SIGINT)" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_wandb_offline_logs_into_the_run_dir(tmp_path, data_root, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = train.train(tiny(tmp_path, data_root, "--wandb", "--max-iters", "4", "--eval-interval", "2",
                              "--sample-tokens", "8"))
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    blob = Path(runs[0]).read_bytes()  # wandb's record log: keys are stored as plain strings
    assert all(key in blob for key in (b"val_loss", b"train_loss", b"tokens_per_s", b"n_layer", b"samples"))
    assert load_checkpoint(tmp_path)["wandb_id"] in runs[0] and result["step"] == 4


def test_ddp_two_processes_match_one(tmp_path, data_root):
    # Same global batch: 1 process x 4 rows vs 2 processes x 2 rows (each rank keeps its rows of
    # the shared global batch), 2 accumulation micro-steps so no_sync is exercised.
    argv = ["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--sample-tokens", "0", "--max-iters", "6",
            "--eval-interval", "3", "--tokens-per-step", "256", "--data-root", str(data_root)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *argv, "--batch-size", "2", "--out-dir", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train.main([*argv, "--batch-size", "4", "--out-dir", str(tmp_path / "one")]) == 0
    ddp, one = records(tmp_path / "ddp", "loss"), records(tmp_path / "one", "loss")
    assert sorted(ddp) == sorted(one) == list(range(1, 7))
    assert torch.allclose(torch.tensor(list(ddp.values())), torch.tensor(list(one.values())), rtol=1e-5, atol=1e-6)
    a, b = load_checkpoint(tmp_path / "ddp")["model"], load_checkpoint(tmp_path / "one")["model"]
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
