"""train.py end to end on the tiny config (CPU, seconds): exact resume, failure modes, logging, DDP."""

import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import train
from configs import load_config
from configs.errors import UserError
from data.tokenizer import tokenizer_from_manifest
from model import GPT, GPTConfig, generate
from model.checkpoint import load_checkpoint, load_model
from training.run import TrainingDiverged

ROOT = Path(__file__).resolve().parent.parent


def tiny(out_dir, data_root, *argv):
    cfg = load_config("tiny", ["--device", "cpu", "--sample-tokens", "0", *argv])
    return replace(cfg, out_dir=str(out_dir), data_root=str(data_root))


def records(run_dir, key):
    lines = (json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl"))
    return {r["step"]: r[key] for r in lines if key in r}


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
    recs = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]  # every record's keys
    steps = {"step", "loss", "lr", "tokens_per_s", "mfu", "grad_norm", "threads", "time"}
    evals = {"step", "train_loss", "val_loss", "time"}
    assert [(r["step"], set(r)) for r in recs] == [(0, evals)] + [
        (s, k) for s in range(1, 21) for k in ([steps, evals] if s % 5 == 0 else [steps])]
    # the lr each step trained with: 2 warmup steps to 1e-3, then the cosine to 1e-4 at step 20
    lr = [1e-3 * (s + 1) / 3 if s < 2 else 1e-4 + 9e-4 * (1 + math.cos(math.pi * (s - 2) / 18)) / 2 for s in range(20)]
    assert [r["lr"] for r in recs if "lr" in r] == pytest.approx(lr)
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["mfu"] is None for r in recs if "lr" in r)
    assert records(tmp_path / "full", "val_loss") == records(tmp_path / "half", "val_loss")
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "half")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["best_val"] == b["best_val"] == full["best_val"] and full["val_loss"] == resumed["val_loss"]
    assert resumed["val_loss"] < math.log(65)  # it learned something
    for name in ("ckpt.pt", "config.json", "manifest.json", "metrics.jsonl", "loss.png"):
        assert (tmp_path / "full" / name).is_file()
    assert (tmp_path / "full" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # --config <run dir> reads the config.json the run wrote: the same settings, vocab_size resolved
    ran = tiny(tmp_path / "full", data_root, *argv, "--max-iters", "20")
    assert load_config(str(tmp_path / "full")) == replace(ran, vocab_size=65, out_dir="out/tiny")

    model, ckpt = load_model(tmp_path / "full")
    tok = tokenizer_from_manifest(ckpt["manifest"])
    idx = torch.tensor([tok.encode("\n")])
    text = tok.decode([int(t[0]) for t in generate(model, idx, 20, generator=torch.Generator().manual_seed(0))])
    assert len(text) == 20


def test_the_loss_is_averaged_over_the_accumulated_micro_batches(tmp_path, data_root):
    # 8 rows a step: one micro-batch of 8, or 4 of 2 accumulated; the same rows, so the same loss and update
    same = ("--dtype", "float32", "--max-iters", "3", "--eval-interval", "100", "--tokens-per-step", "256")
    train.train(tiny(tmp_path / "one", data_root, *same, "--batch-size", "8"))
    train.train(tiny(tmp_path / "four", data_root, *same, "--batch-size", "2"))
    one, four = records(tmp_path / "one", "loss"), records(tmp_path / "four", "loss")
    assert one.keys() == four.keys() == {1, 2, 3} and all(abs(one[s] - four[s]) < 1e-5 for s in one)
    a, b = load_checkpoint(tmp_path / "one")["model"], load_checkpoint(tmp_path / "four")["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_dropout_is_the_runs_own_after_resume_and_init_from(tmp_path, data_root):
    from model.hf import export_run

    train.train(tiny(tmp_path / "a", data_root, "--max-iters", "2"))  # trained without dropout
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    export_run(tmp_path / "a", tmp_path / "hf")
    sources = {"b": ["--resume"], "c": ["--init-from", str(tmp_path / "a")], "d": ["--init-from", str(tmp_path / "hf")]}
    for name, extra in sources.items():
        train.train(tiny(tmp_path / name, data_root, "--dropout", "0.3", "--max-iters", "4", *extra))
        assert load_checkpoint(tmp_path / name)["model_config"]["dropout"] == 0.3, name
        model, _ = load_model(tmp_path / name)
        assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.3}, name


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
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 13.*last good checkpoint.*step 10"):
        train.train(tiny(tmp_path, data_root, "--eval-interval", "5"))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 10 and all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert max(records(tmp_path, "loss")) == 12


def test_eval_only_reproduces_the_runs_final_whole_split_eval(tmp_path, data_root, capsys):
    whole = ("--eval-iters", "0", "--eval-batch-size", "1024")  # the whole val split, in a few batches
    trained = train.train(tiny(tmp_path, data_root, *whole, "--max-iters", "5"))
    step = load_checkpoint(tmp_path)["step"]
    evaluated = train.train(tiny(tmp_path, data_root, *whole, "--eval-only"))
    assert evaluated["stopped"] == "eval_only" and load_checkpoint(tmp_path)["step"] == step  # nothing trained
    assert (evaluated["val_loss"], evaluated["train_loss"]) == (trained["val_loss"], trained["train_loss"])
    again = train.train(tiny(tmp_path / "other", data_root, *whole, "--eval-only", "--init-from", str(tmp_path)))
    assert again["val_loss"] == trained["val_loss"]  # the same run dir, as --init-from
    assert f"perplexity {math.exp(trained['val_loss']):.2f}" in capsys.readouterr().out
    with pytest.raises(UserError, match="--eval-only: no checkpoint in .*--init-from"):
        train.train(tiny(tmp_path / "none", data_root, "--eval-only"))


def test_max_time_budget_includes_final_eval_and_save(tmp_path, data_root):
    # one-time imports (torch.optim pulls in torch._dynamo, ~3 s cold) would eat a 3 s budget
    import matplotlib.pyplot  # noqa: F401
    import torch._dynamo  # noqa: F401

    # (whether the budget holds to the second is a benchmark's business: python -m benchmarks time-to-loss)
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
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a job started in the background
    assert train.main(argv) == 130
    assert load_checkpoint(tmp_path)["step"] == 4 and max(records(tmp_path, "val_loss")) == 4
    assert "stopped at step 4 (SIGINT)" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


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


def boom(gm, example_inputs):
    raise RuntimeError("no working C++ compiler\n(a long Inductor message)")


@pytest.fixture
def fresh_dynamo():
    """Compiled code is cached on GPT.forward's code object; a test's cache must not reach the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


FALLBACK_ARGV = ["--max-iters", "4", "--eval-interval", "2", "--dropout", "0.1"]  # dropout: RNG restored too


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory, data_root):
    run_dir = tmp_path_factory.mktemp("eager")
    return train.train(tiny(run_dir, data_root, *FALLBACK_ARGV)), records(run_dir, "loss")


@pytest.mark.parametrize("when", ["wrapping the model", "in the first step", "in the first backward"])
def test_compile_failure_continues_uncompiled_exactly(tmp_path, data_root, eager_run, monkeypatch, capsys,
                                                     fresh_dynamo, when):
    from torch._dynamo.backends.common import aot_autograd

    real_compile = torch.compile

    def failing_compile(model, **kw):
        if when == "wrapping the model":
            raise RuntimeError("torch.compile is not supported on this Python")
        # The backward compiles lazily, at the first backward: the step fails after its forward ran.
        backend = boom if when == "in the first step" else aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=boom)
        return real_compile(model, backend=backend)

    monkeypatch.setattr(torch, "compile", failing_compile)
    capsys.readouterr()
    fell_back = train.train(tiny(tmp_path, data_root, *FALLBACK_ARGV, "--compile"))
    out = capsys.readouterr().out
    first = out.splitlines()[0]  # the first line states the plan: compiling
    assert first.startswith("cpu") and first.endswith(", compile on")
    notes = [line for line in out.splitlines() if "torch.compile failed" in line]
    said = ("wrapping the model (RuntimeError: torch.compile is not supported on this Python)" if when == "wrapping the model"
            else "in the first step (RuntimeError: no working C++ compiler)")
    assert len(notes) == 1 and notes[0].endswith(f"torch.compile failed {said}; continuing uncompiled")
    eager, eager_losses = eager_run
    assert records(tmp_path, "loss") == eager_losses and fell_back["val_loss"] == eager["val_loss"]


def test_only_the_training_step_is_compiled(tmp_path, data_root, monkeypatch, fresh_dynamo):
    shapes, real_compile = [], torch.compile

    def recording(gm, example_inputs):  # a backend that records the token inputs and runs the graph as is
        shapes.extend(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor) and t.dtype == torch.long)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend=recording))
    # evaluation in batches of 7 and sampling one growing row: shapes a compiled step never sees
    result = train.train(tiny(tmp_path, data_root, "--compile", "--max-iters", "4", "--eval-interval", "2",
                              "--eval-batch-size", "7", "--sample-tokens", "8"))
    assert shapes and set(shapes) == {(4, 32)}  # (batch_size, block_size): idx and targets
    assert result["step"] == 4 and len(result["sample"]) == 8


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_the_compiled_step_runs_the_attention_the_config_names(attention, fresh_dynamo):
    """The aten ops of a compiled training forward and backward: SDPA's kernels for "sdpa", a
    spelled-out softmax for "explicit", never the other (on a GPU the explicit path cost 1.5x the
    step and 1.8x the memory of SDPA's, unseen, when compiling switched it)."""
    from torch._dynamo.backends.common import aot_autograd

    ops = []

    def record(gm, example_inputs):  # the graph's aten ops; it then runs as it is
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, attention=attention))
    step = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    x = torch.randint(0, 32, (2, 16))
    step(x, x)[1].backward()
    sdpa = [op for op in ops if "scaled_dot_product" in op]
    softmax = [op for op in ops if op.startswith("aten._softmax")]  # not the loss's log_softmax
    assert (bool(sdpa), bool(softmax)) == ((True, False) if attention == "sdpa" else (False, True)), ops
    assert len(sdpa if attention == "sdpa" else softmax) == 2  # the forward's and the backward's


def test_deterministic_is_stated_first_and_repeats_bit_for_bit(tmp_path, data_root, capsys):
    """--deterministic (bit-identical repeats on a GPU; CPU kernels already are): accepted, stated in
    the first line, and two runs end with the same weights, bit for bit."""
    try:
        weights = []
        for run in ("a", "b"):
            train.train(tiny(tmp_path / run, data_root, "--deterministic", "--max-iters", "3", "--dropout", "0.1"))
            assert capsys.readouterr().out.splitlines()[0].endswith(", deterministic")
            weights.append(load_checkpoint(tmp_path / run)["model"])
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
        assert torch.are_deterministic_algorithms_enabled()
        train.train(tiny(tmp_path / "c", data_root, "--max-iters", "1"))  # a later run without it
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_same_result_whatever_the_split_between_processes_and_accumulation(tmp_path, data_root):
    # 8 rows of 32 tokens per step, 2 rows per micro-batch: 1 process x 4 micro-steps, 2 x 2
    # (gloo, no_sync on the first micro-step) and 4 x 1 train on the same rows each step.
    argv = ["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--sample-tokens", "0", "--batch-size", "2",
            "--tokens-per-step", "256", "--eval-interval", "3", "--data-root", str(data_root)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # train.py's main, then the names of the threads the process still has: gloo's workers left
    # running into interpreter exit abort a finished job now and then (see Runtime.close)
    script = tmp_path / "train_then_list_threads.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, train
        code = train.main(sys.argv[1:])
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        os.write(1, f"threads left: {names}\\n".encode())  # one write: the ranks share stdout
        sys.exit(code)
        """))

    def run(processes, name, *extra):
        args = [*argv, "--out-dir", str(tmp_path / name), *extra]
        if processes == 1:
            assert train.main(args) == 0
            return
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(script), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        left = re.findall(r"threads left: (\[.*?\])", proc.stdout)  # whole, though maybe mid-line
        assert len(left) == processes and not any("gloo" in names for names in left), proc.stdout[-3000:]

    def max_diff(a, b):
        a, b = load_checkpoint(tmp_path / a)["model"], load_checkpoint(tmp_path / b)["model"]
        return max((a[k] - b[k]).abs().max().item() for k in a)

    run(1, "1x4_3", "--max-iters", "3")
    run(1, "1x4", "--max-iters", "6")
    run(4, "4x1", "--max-iters", "3")
    run(2, "2x2", "--max-iters", "6")
    shutil.copytree(tmp_path / "4x1", tmp_path / "4x1_then_1x4")
    run(1, "4x1_then_1x4", "--max-iters", "6", "--resume")  # 4 processes for 3 steps, then 1
    diffs = {"4x1": max_diff("4x1", "1x4_3"), "2x2": max_diff("2x2", "1x4"),
             "4x1_then_1x4": max_diff("4x1_then_1x4", "1x4")}
    print(f"max weight difference from 1 process x 4 micro-steps: {diffs}")
    assert all(d < 1e-5 for d in diffs.values()) and max_diff("1x4_3", "1x4") > 1e-3  # not vacuous
    one = records(tmp_path / "1x4", "loss")
    assert sorted(one) == list(range(1, 7)) and load_checkpoint(tmp_path / "4x1_then_1x4")["loader"]["step"] == 6
    for name in ("2x2", "4x1_then_1x4"):  # the resumed run continued with steps 4-6's batches
        losses = records(tmp_path / name, "loss")
        assert losses.keys() == one.keys() and all(abs(losses[s] - one[s]) < 1e-5 for s in one)


def scripted_evals(monkeypatch, val_losses, log=None):
    """train.evaluate returns these val losses in turn (train loss 1.0), noting what was on disk."""
    vals = iter(val_losses)

    def fake(model, ds_dir, cfg, rt):
        if log is not None:
            ckpt = Path(cfg.out_dir) / "ckpt.pt"
            log.append(load_checkpoint(ckpt)["step"] if ckpt.is_file() else None)
        return {"val_loss": next(vals), "train_loss": 1.0}

    monkeypatch.setattr(train, "evaluate", fake)


def test_best_pt_keeps_the_lowest_val_while_ckpt_pt_is_the_latest(tmp_path, data_root, monkeypatch):
    scripted_evals(monkeypatch, [4.0, 3.0, 2.0, 2.5, 2.7])  # steps 0, 5, 10, 15, 20: overfits after 10
    result = train.train(tiny(tmp_path, data_root, "--eval-interval", "5"))
    assert load_checkpoint(tmp_path)["step"] == 20 and result["best_val"] == 2.0
    best = load_checkpoint(tmp_path, best=True)
    assert best["step"] == 10 and best["best_val"] == 2.0
    from model.checkpoint import find_checkpoint
    assert find_checkpoint(tmp_path, best=True).name == "best.pt"  # what sample.py and --init-from read


def test_a_non_finite_val_loss_stops_before_saving(tmp_path, data_root, monkeypatch):
    scripted_evals(monkeypatch, [4.0, 3.0, float("nan")])
    with pytest.raises(TrainingDiverged, match=r"val loss became nan at step 10.*last good checkpoint.*step 5"):
        train.train(tiny(tmp_path, data_root, "--eval-interval", "5"))
    assert load_checkpoint(tmp_path)["step"] == 5 and load_checkpoint(tmp_path, best=True)["step"] == 5


def test_sigterm_saves_before_it_evaluates(tmp_path, data_root, monkeypatch):
    on_disk = []
    scripted_evals(monkeypatch, [4.0, 3.0], log=on_disk)
    forward, calls = GPT.forward, []

    def preempted(self, idx, targets=None, **kw):
        calls.append(self.training)
        if self.training and calls.count(True) == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # the cluster preempts during step 7
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", preempted)
    result = train.train(tiny(tmp_path, data_root, "--eval-interval", "100"))
    assert result["stopped"] == "SIGTERM" and result["step"] == 7
    assert on_disk == [None, 7]  # the eval after the signal found step 7 already saved


def test_changed_lr_takes_effect_on_resume(tmp_path, data_root):
    train.train(tiny(tmp_path, data_root, "--max-iters", "10"))
    with pytest.raises(TrainingDiverged, match="loss became"):  # lr 1e3 diverges within steps
        train.train(tiny(tmp_path, data_root, "--max-iters", "60", "--resume", "--lr", "1e3", "--min-lr", "1e3",
                         "--grad-clip", "0"))


def test_second_ctrl_c_quits_in_one_line(tmp_path, data_root, monkeypatch, capsys):
    forward, calls = GPT.forward, []

    def pressed_twice(self, idx, targets=None, **kw):
        calls.append(self.training)
        if self.training and calls.count(True) == 13:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", pressed_twice)
    argv = ["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--out-dir", str(tmp_path),
            "--data-root", str(data_root), "--eval-interval", "5"]
    assert train.main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"quit at step 12 without saving; kept {tmp_path / 'ckpt.pt'} (step 10)"
    assert load_checkpoint(tmp_path)["step"] == 10


class FakeWandbRun:
    """What wandb.init returns, without a server: starting_step is what a resumed run's server holds (its
    last step + 1); logged is every log call, its step included."""
    id, settings = "abc", type("S", (), {"mode": "online"})()

    def __init__(self, starting_step=0):
        self.starting_step, self.logged, self.summary, self.finished = starting_step, [], {}, None

    def log(self, values, step):
        self.logged.append(values | {"step": step})

    def finish(self, exit_code=0):
        self.finished = exit_code


def fake_wandb(monkeypatch, run):
    table = staticmethod(lambda columns, data: [row[0] for row in data])  # a samples table: its steps
    monkeypatch.setitem(sys.modules, "wandb", type("W", (), {"init": staticmethod(lambda **kw: run),
                                                             "Table": table}))
    monkeypatch.setenv("WANDB_MODE", "online")


def test_runlog_wandb_exit_code_best_summary_and_no_relogged_steps(tmp_path, monkeypatch):
    from training.runlog import RunLog
    fake = FakeWandbRun(starting_step=31)  # wandb holds steps up to 30
    fake_wandb(monkeypatch, fake)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "val_loss": v}) + "\n"
                                                    for s, v in ((10, 3.0), (20, 2.0), (30, 1.0))))
    log = RunLog(tmp_path, started=0.0, resume_step=20)  # crashed after step 30, saved at 20
    log.start_wandb("p", "n", {}, "abc")
    for step, val in ((21, None), (30, 2.5), (31, 2.2)):
        log.log({"step": step, "loss": 1.0, **({"val_loss": val} if val else {})})
    log.close(exit_code=1)
    assert [r["step"] for r in fake.logged] == [31] and fake.finished == 1
    assert fake.summary == {"best_val_loss": 2.0}  # the redone step 30's 1.0 is gone; its 2.0 at step 20 is the best
    assert fake.logged[0]["val_loss"] == 2.2  # and wandb's own summary keeps the last val_loss
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [10, 20, 21, 30, 31]


@pytest.mark.parametrize("held", [30, 95])  # at the kill, wandb lagged behind metrics.jsonl's 90, or got past it
def test_runlog_resumed_after_kill_9_gives_wandb_what_metrics_jsonl_holds(tmp_path, monkeypatch, held):
    from training.runlog import RunLog

    def attempt(resume_step, starting_step, steps):
        run = FakeWandbRun(starting_step)
        fake_wandb(monkeypatch, run)
        log = RunLog(tmp_path, started=0.0, resume_step=resume_step)
        log.start_wandb("p", "n", {}, "abc")
        for step in steps:  # a redone step logs the same numbers: resume is bit-exact
            log.log({"step": step, "loss": 10 - step / 100, "mfu": None})
            if step % 50 == 0:  # an eval: its record and a sample at the same step
                log.log({"step": step, "val_loss": 9 - step / 100})
                log.log_sample(step, f"text at {step}")
        return run

    first, path = attempt(None, 0, range(5, 100, 5)), tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()  # kill -9 after step 95: its line was lost
    path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= 90))
    second = attempt(50, held + 1, range(55, 125, 5))  # resumed from the checkpoint at step 50
    sent = [r for r in first.logged if r["step"] <= held] + second.logged
    metrics = [{k: v for k, v in json.loads(line).items() if v is not None} for line in open(path)]
    assert [r for r in sent if "samples" not in r] == metrics  # each record once, in order, none missing
    samples = [r["step"] for r in sent if "samples" in r]  # not in metrics.jsonl: those past the checkpoint
    assert len(samples) == len(set(samples)) and 100 in samples


def test_sigterm_during_an_eval_stops_it_saves_and_exits_without_another_step(tmp_path, data_root, monkeypatch,
                                                                            capsys):
    forward, steps, evals_at_10 = GPT.forward, [], []

    def preempted(self, idx, targets=None, **kw):
        if self.training:
            steps.append(1)
        elif len(steps) == 10:  # the eval at step 10 (or the save's probe of the weights)
            evals_at_10.append(1)
            if len(evals_at_10) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", preempted)
    assert train.main(args := ["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--out-dir",
                               str(tmp_path), "--data-root", str(data_root)]) == 143
    assert len(steps) == 10 and load_checkpoint(tmp_path)["step"] == 10
    assert len(evals_at_10) == 2  # the eval's first batch, then the save's probe: no more eval batches
    assert max(records(tmp_path, "val_loss")) == 0  # the cut eval is not recorded, and none ran after it
    out = capsys.readouterr().out
    assert "stopped at step 10 (SIGTERM, during its eval)" in out and "final:" not in out
    monkeypatch.setattr(GPT, "forward", forward)
    assert train.main([*args, "--resume"]) == 0 and load_checkpoint(tmp_path)["step"] == 20


def test_a_second_ctrl_c_during_the_save_lets_it_finish_then_quits_in_one_line(tmp_path, data_root, monkeypatch,
                                                                               capsys):
    forward, save, steps = GPT.forward, torch.save, []

    def pressed(self, idx, targets=None, **kw):
        steps.append(self.training)
        if steps.count(True) == 4 and self.training:
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, during step 4: save, then eval
        return forward(self, idx, targets, **kw)

    class PressedAgain:  # the file torch.save writes: the second Ctrl-C lands in the middle of the write
        def __init__(self, f):
            self.f, self.pressed = f, False

        def write(self, data):
            if not self.pressed:
                self.pressed = True
                os.kill(os.getpid(), signal.SIGINT)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(GPT, "forward", pressed)
    monkeypatch.setattr(torch, "save", lambda obj, f, **kw: save(obj, PressedAgain(f), **kw))
    assert train.main(["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--out-dir", str(tmp_path),
                       "--data-root", str(data_root)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"quit at step 4; kept {tmp_path / 'ckpt.pt'} (step 4)"
    assert "Traceback" not in err and "Error" not in err
    assert load_checkpoint(tmp_path)["step"] == 4 and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2, signal.SIGXCPU])  # USR2: Grid Engine's warning
def test_a_stop_signal_during_training_skips_the_end_of_run_sample(tmp_path, data_root, monkeypatch, capsys, sig):
    trunk, decoded, steps = GPT.trunk, [], []

    def stopped_at_step_5(self, *a, **kw):
        if kw.get("kv_cache") is not None:  # a decoding step of the sample
            decoded.append(1)
        elif torch.is_grad_enabled() and self.training:  # a training step (not the time probe: say_if_long)
            steps.append(1)
            if len(steps) == 5:
                os.kill(os.getpid(), sig)
        return trunk(self, *a, **kw)

    monkeypatch.setattr(GPT, "trunk", stopped_at_step_5)
    assert train.main(["--config", "tiny", "--device", "cpu", "--sample-tokens", "200", "--out-dir", str(tmp_path),
                       "--data-root", str(data_root)]) == 128 + sig
    assert decoded == []  # a scheduler waited for all 200 tokens
    assert f"stopped at step 5 ({sig.name})" in capsys.readouterr().out and load_checkpoint(tmp_path)["step"] == 5


def test_sigterm_during_the_end_of_run_sample_stops_it_and_says_the_run_is_saved(tmp_path, data_root, monkeypatch,
                                                                                capsys):
    trunk, decoded = GPT.trunk, []

    def preempted(self, *a, **kw):
        if kw.get("kv_cache") is not None:  # a decoding step of the sample
            decoded.append(1)
            if len(decoded) == 5:
                os.kill(os.getpid(), signal.SIGTERM)
        return trunk(self, *a, **kw)

    monkeypatch.setattr(GPT, "trunk", preempted)
    assert train.main(["--config", "tiny", "--device", "cpu", "--sample-tokens", "200", "--out-dir", str(tmp_path),
                       "--data-root", str(data_root)]) == 143
    assert len(decoded) == 5  # stopped at once, not after 200 tokens
    out, err = capsys.readouterr()
    assert f"SIGTERM: the sample was cut short; kept {tmp_path / 'ckpt.pt'} (step 20)" in err
    assert "nothing was saved" not in err + out and "sample (python sample.py" not in out
    assert load_checkpoint(tmp_path)["step"] == 20


def ctrl_c(cmd, when, cwd=ROOT):
    """Run cmd, press Ctrl-C (SIGINT) as soon as when(pid) is true; (exit code, stderr)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None and not when(proc.pid):
            pass
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=60), proc.stderr.read()
    finally:
        proc.kill()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="watches /proc/PID/maps for a library")
@pytest.mark.parametrize("command, library", [
    ("train.py --config tiny --out-dir OUT", "libtorch"), ("sample.py --config tiny --out-dir OUT", "libtorch"),
    ("-m model --config tiny", "libtorch"), ("-m model.hf export OUT OUT/hf", "libtorch"),
    ("-m data.prepare shakespeare_char --out-root OUT", "_multiarray_umath")])  # numpy's
def test_ctrl_c_while_a_script_imports_is_one_line(tmp_path, command, library):
    def importing(pid):
        return library in Path(f"/proc/{pid}/maps").read_text()

    code, err = ctrl_c([sys.executable, *command.replace("OUT", str(tmp_path)).split()], importing)
    assert (code, err.strip()) == (130, "interrupted; nothing was changed")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_after_a_scripts_main_returns_ctrl_c_is_ignored(monkeypatch):
    from configs.errors import entry_point

    def main():
        return 0

    monkeypatch.setattr(main, "__module__", "__main__")  # as when run as a script
    monkeypatch.setattr(signal, "signal", lambda sig, handler: calls.append((sig, handler)))
    calls = []
    assert entry_point(main)() == 0  # a Ctrl-C ~10 ms after data.prepare finished hit torch's atexit: a traceback
    assert calls == [(signal.SIGINT, signal.SIG_IGN)]


def test_ctrl_c_during_data_prepare_is_one_line_and_keeps_the_dataset(tmp_path):
    from data.prepare import prepare

    text = (ROOT / "data" / "corpora" / "tinyshakespeare" / "input.txt").read_text()
    (tmp_path / "small.txt").write_text(text)
    (tmp_path / "big.txt").write_text(text * 30)  # 33 MB: seconds to tokenize
    before = prepare(text=tmp_path / "small.txt", tokenizer="char", name="ds", out_root=tmp_path, verbose=False)
    manifest = (before / "manifest.json").read_text()
    code, err = ctrl_c([sys.executable, "-m", "data.prepare", "--text", str(tmp_path / "big.txt"), "--name", "ds",
                        "--tokenizer", "char", "--out-root", str(tmp_path), "--force"],
                       lambda pid: (tmp_path / ".ds.tmp").exists())  # the rebuild beside the dataset started
    assert (code, err.strip()) == (130, "interrupted; nothing was changed")
    assert (before / "manifest.json").read_text() == manifest and not (tmp_path / ".ds.tmp").exists()


def test_a_second_ctrl_c_after_the_save_still_names_the_checkpoint_kept(tmp_path, data_root, monkeypatch, capsys):
    from training.runlog import RunLog
    forward, plot, steps = GPT.forward, RunLog.plot, []

    def pressed(self, idx, targets=None, **kw):
        steps.append(self.training)
        if steps.count(True) == 4 and self.training:
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, during step 4: save, eval, plot
        return forward(self, idx, targets, **kw)

    def pressed_again(self, force=True):  # the final plot, ~0.1 s after the save: where the second one landed
        if force:
            os.kill(os.getpid(), signal.SIGINT)
        plot(self, force)

    monkeypatch.setattr(GPT, "forward", pressed)
    monkeypatch.setattr(RunLog, "plot", pressed_again)
    assert train.main(["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--out-dir", str(tmp_path),
                       "--data-root", str(data_root)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"quit at step 4; kept {tmp_path / 'ckpt.pt'} (step 4)"
    assert "nothing was changed" not in err and load_checkpoint(tmp_path)["step"] == 4
