"""Every command in benchmarks/' usage docstrings, run as written plus flags that shrink it to
seconds (a repeated flag's last value wins), and the JSON lines it prints."""

import functools
import importlib
import json
import math
import pkgutil
import shlex
from pathlib import Path

import pytest
import torch

import benchmarks
from benchmarks import decode, runs
from benchmarks.__main__ import main


def bench(capsys, command: str, *shrink: str) -> list[dict]:
    """A documented `python -m benchmarks ...` command with `shrink` appended, in this process."""
    argv = [*shlex.split(command.removeprefix("python -m benchmarks ")), *shrink]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile as the identity: the compiled paths run, without minutes of compiling."""
    from model import kv_cache

    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)
    kv_cache.compiled_decode_steps.cache_clear()  # made once per process: not one compiled elsewhere
    yield
    kv_cache.compiled_decode_steps.cache_clear()


@pytest.fixture
def train_in_process(monkeypatch):
    """runs._train's `python train.py ...` in this process: the same run, without importing torch again."""
    monkeypatch.setattr(runs, "_train", runs._train_quietly)


def test_every_documented_command_has_a_test():
    modules = [benchmarks, *(importlib.import_module(f"benchmarks.{m.name}")
                             for m in pkgutil.iter_modules(benchmarks.__path__))]
    documented = {line.split("#")[0].strip() for m in modules for line in m.__doc__.splitlines()
                  if line.strip().startswith("python -m benchmarks")}
    source = Path(__file__).read_text()
    assert len(documented) >= 10 and [c for c in documented if f'"{c}"' not in source] == []


def test_sample(capsys, eager_compile):
    lines = bench(capsys, "python -m benchmarks sample", "--new-tokens", "4", "--repeats", "1", "--block-size", "16",
                  "--device", "cpu")
    assert [(r["mode"], r["dtype"]) for r in lines] == [("eager", "float32"), ("compiled", "float32"),
                                                        ("recompute", "float32")]
    assert all(r["model"] == "small" and r["new_tokens"] == 4 and r["tokens_per_s"] > 0 for r in lines)
    assert "reference" not in lines[0] and {r["reference"] for r in lines[1:]} == {"eager float32"}
    assert all(r["speedup_vs_reference"] > 0 and "bytes_per_step" not in r for r in lines[1:])


def test_sample_gpt2_beside_transformers(capsys, eager_compile, monkeypatch):
    """GPT-2's shape shrunk to one narrow layer: the random weights are still made by
    transformers, saved, and loaded by both sides."""
    import transformers

    monkeypatch.setattr(transformers, "GPT2Config", functools.partial(
        transformers.GPT2Config, n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=128))
    monkeypatch.setattr(decode, "stream_copy_gb_s", functools.partial(decode.stream_copy_gb_s, nbytes=2**20))
    lines = bench(capsys, "python -m benchmarks sample --model gpt2 --modes eager,compiled,hf --dtypes float32,bfloat16",
                  "--new-tokens", "4", "--repeats", "1", "--device", "cpu")
    by = {(r["mode"], r["dtype"]): r for r in lines}
    assert set(by) == {(m, d) for m in ("eager", "compiled") for d in ("float32", "bfloat16")} | {("hf", "float32")}
    hf = by.pop(("hf", "float32"))
    assert hf["impl"] == "transformers" and "reference" not in hf and hf["prompt_len"] == 8
    assert all(r["impl"] == "ours" and r["reference"] == "hf float32" and r["gb_per_s"] > 0 for r in by.values())
    assert by["eager", "bfloat16"]["bytes_per_step"] < by["eager", "float32"]["bytes_per_step"]


def test_train(capsys, data_root):
    [r] = bench(capsys, "python -m benchmarks train --config small --iters 200",
                "--iters", "2", "--warmup", "0", "--device", "cpu", "--data-root", str(data_root))
    assert (r["impl"], r["optimizer"], r["pos_emb"], r["iters"]) == ("ours", "muon", "rope", 2)
    assert r["tokens_per_step"] == 16 * 64 and r["ms_per_iter"] > 0 and r["peak_rss_mb"] > 0 and r["mfu"] is None
    assert abs(r["first_loss"] - math.log(65)) < 0.5  # an untrained model's first step


def test_train_both_against_plain_pytorch(capsys, data_root):
    shrink = ("--iters", "2", "--warmup", "0", "--block", "1", "--device", "cpu", "--data-root", str(data_root))
    command = "python -m benchmarks train --config small --impl both --iters 200 --override pos_emb=learned optimizer=adamw activation=gelu"
    ours, plain, both = bench(capsys, command, *shrink)
    assert (ours["impl"], plain["impl"], plain["optimizer"]) == ("ours", "plain", "torch.optim.AdamW")
    assert ours["params"] == plain["params"] and both["same_first_loss"] and both["ours_over_plain"] > 0
    # without activation=gelu, the error names what to add
    assert main(["train", "--config", "small", "--impl", "both", "--override", "pos_emb=learned",
                 "optimizer=adamw", *shrink]) == 2
    assert "add --override activation=gelu" in capsys.readouterr().err


def test_train_gpu_config_on_cpu(capsys, data_root, eager_compile):
    """No GPU here: the GPU config shrunk, its compile on (through the identity)."""
    lines = bench(capsys, "python -m benchmarks train --config shakespeare_gpu --impl both --override dropout=0 optimizer=adamw",
                  "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "2",
                  "--iters", "2", "--warmup", "0", "--device", "cpu", "--data-root", str(data_root))
    assert [r.get("impl") for r in lines] == ["ours", "plain", None] and all(r["compile"] for r in lines[:2])
    assert lines[2]["same_first_loss"]


def test_time_to_loss(capsys, data_root, train_in_process):
    [r] = bench(capsys, "python -m benchmarks time-to-loss --config small --max-time 45 --target 1.88",
                "--config", "tiny", "--max-time", "1", "--target", "5", "--data-root", str(data_root))
    assert (r["run"], r["config"], r["stopped"], r["reached"]) == ("ours", "tiny", "max_time", True)
    assert r["flags"][:2] == ["--max-time", "1.0"] and 0 < r["train_s"] <= r["wall_s"] + 0.05  # train.py prints 0.1 s


def test_time_to_loss_fixed_steps_in_a_process_of_its_own(capsys, data_root):
    [r] = bench(capsys, "python -m benchmarks time-to-loss --config small --max-iters 1500",
                "--config", "tiny", "--max-iters", "2", "--data-root", str(data_root))
    assert (r["steps"], r["stopped"], r["target"]) == (2, "max_iters", 1.88) and r["val_loss"] > 0


def test_time_to_loss_vs_nanogpt(capsys, data_root, train_in_process, monkeypatch):
    """nanoGPT's recipe shrunk to four steps of a narrow layer; fractions of 1 and 2 of its
    wall time, as smaller ones leave no time after start-up in so short a run."""
    monkeypatch.setattr(runs, "NANOGPT_CPU", [*runs.NANOGPT_CPU, "--n-layer", "1", "--n-embd", "16", "--max-iters", "4",
                                              "--lr-decay-iters", "4", "--warmup-iters", "1", "--eval-interval", "2",
                                              "--eval-iters", "2", "--data-root", str(data_root)])
    command = "python -m benchmarks time-to-loss --config small --vs-nanogpt --fractions 0.25 1 --target 1.55"
    nano, *ours, one, two = bench(capsys, command, "--config", "tiny", "--fractions", "1", "2", "--data-root", str(data_root))
    assert (nano["run"], nano["steps"], nano["stopped"]) == ("nanogpt", 4, "max_iters")
    assert [r["run"] for r in ours] == ["ours", "ours"] and all(r["stopped"] == "max_time" for r in ours)
    assert (one["fraction"], two["fraction"], one["medians_of"]) == (1, 2, 1)
    assert one["nanogpt_val"] == nano["val_loss"] and one["ours_val"] == ours[0]["val_loss"]


@pytest.mark.parametrize("command, shrink", [
    ("python -m benchmarks memory --config small", ["--n-layer", "1", "--batch-size", "2"]),
    ("python -m benchmarks memory --config small --n-layer 8 --block-size 256",
     ["--config", "tiny", "--n-layer", "3", "--block-size", "16"]),
])
def test_memory(capsys, data_root, command, shrink):
    [r] = bench(capsys, command, *shrink, "--data-root", str(data_root))
    assert r["n_layer"] == int(shrink[shrink.index("--n-layer") + 1]) and r["vocab_size"] == 65
    assert 0.9 < r["ratio"] < 1.1 and r["measured_mb"] > 0



def test_hellaswag(capsys):
    [r] = bench(capsys, "python -m benchmarks hellaswag --config gpt2 --items 100", "--items", "3", "--n-layer", "1",
                "--n-embd", "32", "--n-head", "2", "--device", "cpu")
    assert r["items"] == 3 and r["seconds_per_100_items"] > 0 and r["whole_split_s"] > 0 and r["device"] == "cpu"
