"""training/plan.py: memory estimates against the CPU's measured peak, the fit check, --batch-size auto."""

import json
import os
import re
from dataclasses import replace

import pytest
import torch

import train
from benchmarks.memory import check, measured_peak_bytes
from configs import load_config, micro_batch
from configs.errors import UserError
from model import GPT
from training import plan
from training.runtime import setup

SIZES = {"2x16": dict(n_layer=2, n_embd=16, n_head=2), "2x32": dict(n_layer=2, n_embd=32, n_head=4),
         "3x48": dict(n_layer=3, n_embd=48, n_head=4)}


def tiny(**fields):
    return replace(load_config("tiny", ["--device", "cpu"]), **fields)


def test_measured_peak_counts_live_tensor_bytes():
    def allocate():
        a = torch.empty(2**20, dtype=torch.uint8)
        b = torch.empty(2**21, dtype=torch.uint8)  # peak: a and b
        del a
        c = torch.empty(2**19, dtype=torch.uint8)
        return b, c

    assert measured_peak_bytes(allocate) == 3 * 2**20


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_memory_estimate_matches_measured_cpu_peak(size, block_size, attention):
    got = check(tiny(block_size=block_size, attention=attention, **size), 65, torch.bfloat16)
    assert 0.85 < got["ratio"] < 1.15 and 0.85 < got["beyond_states_ratio"] < 1.15, got


@pytest.mark.parametrize("fields, vocab, dtype", [
    (dict(pos_emb="rope", attention="explicit", optimizer="muon"), 65, torch.bfloat16),  # the small recipe
    (dict(norm="rmsnorm", activation="relu2", qk_norm=True, bias=False), 65, torch.float32),
    (dict(tie_weights=False), 1024, torch.bfloat16),  # the loss's backward is the peak
])
def test_memory_estimate_covers_architecture_switches(fields, vocab, dtype):
    got = check(tiny(block_size=32, **SIZES["2x32"], **fields), vocab, dtype)
    assert 0.85 < got["ratio"] < 1.15 and 0.85 < got["beyond_states_ratio"] < 1.15, got


def test_one_micro_step_peaks_below_the_estimate():
    """Without accumulation the gradients do not exist during the forward: the estimate is an upper bound."""
    got = check(tiny(block_size=32, **SIZES["2x32"]), 1024, torch.bfloat16, accum=1)
    assert 1.0 < got["ratio"] < 1.15, got


def test_largest_batch_is_the_last_that_fits_and_divides():
    cfg = load_config("gpt2", ["--n-layer", "24", "--n-embd", "1024", "--n-head", "16"])
    est = plan.Estimate.of(plan.meta_model(cfg.model_config(cfg.vocab_size)), cfg, low_precision=True)
    budget = 20 * plan.GiB
    fit = est.largest_batch(budget)
    assert est.memory(fit)["total"] <= budget < est.memory(fit + 1)["total"]
    keep = est.largest_batch(budget, divides=64)
    assert 64 % keep == 0 and keep <= fit < 2 * keep
    assert est.largest_batch(est.memory(0)["total"] - 1) == 0


def test_batch_size_auto_keeps_tokens_per_step(tmp_path, monkeypatch, capsys):
    from data.prepare import prepare

    assert micro_batch("auto") == 0 and micro_batch("8") == 8
    rt = setup(device="cpu", dtype="float32", seed=None)
    with pytest.raises(UserError, match="tokens-per-step"):
        plan.auto_batch_size(tiny(batch_size=0), GPT(tiny().model_config(65)), rt)

    cfg = load_config("tiny", ["--device", "cpu", "--dtype", "float32", "--batch-size", "auto", "--tokens-per-step",
                               "256", "--max-iters", "2", "--sample-tokens", "0"])
    cfg = replace(cfg, out_dir=str(tmp_path / "run"), data_root=str(prepare("shakespeare_char", out_root=tmp_path,
                                                                             verbose=False).parent))
    est = plan.Estimate.of(GPT(cfg.model_config(65)), cfg, low_precision=False)
    # 6 sequences fit, 7 do not; 6 does not divide the 8 sequences of a step, 4 does
    free = (est.memory(6)["total"] + est.memory(7)["total"]) / 2 / plan.USABLE
    monkeypatch.setattr(plan, "free_memory", lambda device: free)
    train.train(cfg)
    assert "batch-size auto: 4 sequences per micro-batch x 2 accumulation" in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["batch_size"] == 4 and saved["tokens_per_step"] == 256


def run_args(out_dir, data_root, *extra):
    return ["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--out-dir", str(out_dir),
            "--data-root", str(data_root), *extra]


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


def test_a_run_that_cannot_fit_is_refused_before_the_model_is_built(tmp_path, data_root, monkeypatch, capsys):
    import training.run

    argv = run_args(tmp_path, data_root, "--block-size", "2048", "--batch-size", "16", "--attention", "explicit")
    cfg = load_config("tiny", argv)
    rt = setup(device="cpu", dtype="auto", seed=None)
    need = plan.Estimate.of(plan.meta_model(cfg.model_config(65)), cfg, rt.dtype != torch.float32).memory(16)["total"]
    assert need > plan.GiB  # the (2048, 2048) attention scores of 16 sequences, per head and layer
    monkeypatch.setattr(plan, "free_memory", lambda device: need / 2)
    monkeypatch.setattr(training.run, "build_model", lambda *a: pytest.fail("built the model"))
    assert train.main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"needs about {need / plan.GiB:.1f} GiB but the cpu has " \
           f"{need / 2 / plan.GiB:.1f} GiB available; use --batch-size auto, a smaller --block-size" in line
    assert not (tmp_path / "ckpt.pt").exists()


def test_the_issues_command_is_refused_within_a_4_gb_address_space(tmp_path, data_root):
    """The issue's command, run so that today's code cannot take the machine down: it died with a
    traceback, allocating its first 10 GB mask; now the plan refuses it before any big allocation."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    cmd = [sys.executable, "train.py", *run_args(tmp_path, data_root, "--config", "small", "--block-size", "100000",
                                                  "--max-iters", "1")]
    proc = subprocess.run(cmd, cwd=Path(train.__file__).parent, capture_output=True, text=True, timeout=120,
                          preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2 and re.search(r"this run needs about [\d,.]+ GiB but the "
                                              r"cpu has [\d.]+ GiB available; use --batch-size auto", line), line


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
], ids=["cuda", "cpu", "python"])
def test_out_of_memory_in_training_is_one_line_and_keeps_the_checkpoint(error, tmp_path, data_root, monkeypatch,
                                                                        capsys):
    real, steps, saved = GPT.forward, [], {}

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.training:  # a training step (evals run without grad, the time probe in eval mode)
            steps.append(len(steps) + 1)
            if len(steps) == 3:
                saved.update({p.name: p.read_bytes() for p in tmp_path.glob("*.pt")})
                raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", forward)
    assert train.main(run_args(tmp_path, data_root, "--max-iters", "4", "--eval-interval", "2")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: out of memory on cpu (") and "use --batch-size auto, a smaller --block-size" in line
    assert f"({plan.first_line(error)}); " in line  # torch's first line, the size it tried to allocate included
    assert line.endswith(f"; {tmp_path / 'ckpt.pt'} is kept")
    assert "ckpt.pt" in saved and saved == {p.name: p.read_bytes() for p in tmp_path.glob("*.pt")}
    assert plan.out_of_memory(RuntimeError("an unrelated bug"), "cpu") is None  # keeps its traceback
    assert "kept" not in str(plan.out_of_memory(error, "cpu", tmp_path / "none.pt"))  # no checkpoint: none claimed


@pytest.mark.parametrize("n_embd, message", [
    (2**28, r"this run needs about [\d,.]+ GiB but the cpu has [\d.]+ GiB available; use "),
    (2**31 - 1, r"this model is too big to plan, let alone train \(Storage size calculation overflowed with sizes=\["
                r"6442450941, 2147483647\]\); use a smaller --n-embd, --n-layer or --vocab-size$")],
    ids=["probe", "overflow"])
def test_a_model_too_big_for_the_attention_probe_is_one_line(tmp_path, data_root, n_embd, message):
    """setup()'s attention-kernel probe allocated 8 x n_embd values before the plan could refuse the run."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    cmd = [sys.executable, "train.py", *run_args(tmp_path, data_root, "--n-embd", str(n_embd), "--n-head", "1",
                                                  "--max-iters", "1")]
    proc = subprocess.run(cmd, cwd=Path(train.__file__).parent, capture_output=True, text=True, timeout=120,
                          preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2 and re.search(message, line), line
    assert not (tmp_path / "ckpt.pt").exists()
