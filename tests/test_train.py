"""train.py end to end on the tiny preset (CPU, seconds): exact resume, stop signals, failures,
the run folder, and what a run leaves and prints."""

import copy
import errno
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, in_process, one_error_line, script, tiny, tiny_args

import train
from configs import UserError, parse_args, run, settings
from data.loader import Batches
from model.checkpoint import load_checkpoint, save_checkpoint
from model.gpt import GPT, GPTConfig
from training.optim import lr_factor

LONG = ("--max-iters", "100000", "--eval-interval", "100000")  # still training when signalled


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records(run_dir) if "val_loss" in r}


def saved_step(path) -> int:
    return load_checkpoint(path)["state"]["step"]


def assert_same(a, b, where="checkpoint"):
    """Equal values, tensors equal bit for bit, all the way down."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def assert_same_run(a, b):
    """Two run folders hold the same training: checkpoints bit for bit (but for where they are)
    and the same metrics (but for the clock)."""
    ca, cb = (torch.load(d / "ckpt.pt", weights_only=True) for d in (a, b))
    for c in ca, cb:
        del c["config"]["out_dir"], c["state"]["seconds"]  # where, and the clock
    assert_same(ca, cb)
    clock = ("time", "tokens_per_s")
    ra, rb = ([{k: v for k, v in r.items() if k not in clock} for r in records(d)] for d in (a, b))
    assert ra == rb


def calling(hook):
    """train.Batches, calling hook(step) as each step asks for its batches."""

    class Hooked(Batches):
        def __call__(self, step):
            hook(step)
            return super().__call__(step)

    return Hooked


def signal_at(sig, at_step):
    def hook(step):
        if step == at_step:
            os.kill(os.getpid(), sig)

    return calling(hook)


def initial_weights(monkeypatch) -> dict:
    """The weights of the next run's model before its first step, once it has started."""
    start, make_optimizers = {}, train.make_optimizers

    def keep(model, cfg, rt):
        start.update(copy.deepcopy(model.state_dict()))
        return make_optimizers(model, cfg, rt)

    monkeypatch.setattr(train, "make_optimizers", keep)
    return start


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_run_stopped_by_a_signal_and_resumed_ends_bit_for_bit_as_the_uninterrupted_one(
    tmp_path, data_root, monkeypatch, optimizer
):
    """Dropout 0.1, so that the resumed run must draw the same dropout masks too."""
    fields = dict(dropout=0.1, optimizer=optimizer)
    full = train.train(tiny(tmp_path / "full", data_root, **fields))
    assert full["step"] == 20 and full["stop_signal"] == 0
    handler = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(train, "Batches", signal_at(signal.SIGUSR1, 7))
    cfg = tiny(tmp_path / "half", data_root, **fields)
    stopped = train.train(cfg)
    assert (stopped["step"], stopped["stop_signal"]) == (8, signal.SIGUSR1)  # step 7 finished
    assert signal.getsignal(signal.SIGUSR1) is handler  # the run's handlers are gone
    assert saved_step(tmp_path / "half" / "run" / "ckpt.pt") == 8
    monkeypatch.setattr(train, "Batches", Batches)
    resumed = train.train(replace(cfg, resume=True))
    assert resumed == full
    assert_same_run(tmp_path / "full" / "run", tmp_path / "half" / "run")
    # the lr each step trained with: warmup over 2 steps, then the cosine down to min_lr
    c = tiny(tmp_path, data_root)
    expected = [c.lr * lr_factor(s, c, (s - 2) / 18) for s in range(20)]
    logged = [r["lr"] for r in records(tmp_path / "full" / "run") if "lr" in r]
    assert logged == pytest.approx(expected, rel=1e-12)


def test_the_logged_loss_is_the_mean_of_the_accumulated_micro_batches_losses(
    tmp_path, data_root, monkeypatch
):
    start, drawn = initial_weights(monkeypatch), []

    class Kept(Batches):
        def __call__(self, step):
            drawn.append(super().__call__(step))
            return drawn[-1]

    monkeypatch.setattr(train, "Batches", Kept)
    cfg = tiny(tmp_path, data_root, dtype="float32", tokens_per_step=4 * 4 * 32, max_iters=1)
    train.train(cfg)
    [micro_batches] = drawn
    model = GPT(GPTConfig(**load_checkpoint(tmp_path / "run")["model_config"]))
    model.load_state_dict(start)
    with torch.no_grad():
        each = [model(x, y)[1].item() for x, y in micro_batches]
    mean = sum(each) / 4
    assert len(each) == 4 and min(abs(loss - mean) for loss in each) > 1e-4  # they differ
    assert losses(tmp_path / "run") == {1: pytest.approx(mean, rel=1e-6)}


TRAIN_THEN_LIST_THREADS = """\
import os, sys
import torch
import train


class Recorded(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print(f"buffers broadcast: {self.will_sync_module_buffers()}", flush=True)


torch.nn.parallel.DistributedDataParallel = Recorded
if os.environ["RANK"] == os.environ.get("PERTURB_RANK"):  # its weights leave the others'
    evaluate = train.evaluate

    def perturbed(model, *args, **kwargs):
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
        return evaluate(model, *args, **kwargs)

    train.evaluate = perturbed
code = train.main()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
os.write(1, f"threads left: {names}\\n".encode())  # one write: the processes share stdout
sys.exit(code)
"""


def torchrun(tmp_path, *args, nodes=1, **env) -> list[subprocess.Popen]:
    """TRAIN_THEN_LIST_THREADS under torchrun (gloo): two processes on one node, or one on each of
    two "nodes" (two torchrun commands on this machine), each with its own data root."""
    (tmp_path / "train_then_list_threads.py").write_text(TRAIN_THEN_LIST_THREADS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(3 - nodes)]
    launch += ["--nnodes", str(nodes), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return [
        subprocess.Popen(
            [
                *launch,
                "--node-rank",
                str(node),
                tmp_path / "train_then_list_threads.py",
                *map(str, args),
            ]
            + ["--data-root", tmp_path / f"data{node}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(nodes)
    ]


@pytest.mark.parametrize("optimizer, nodes", [("adamw", 1), ("muon", 2)])
def test_the_same_result_whatever_the_split_between_processes_and_accumulation(
    tmp_path, data_root, monkeypatch, optimizer, nodes
):
    """8 rows of 32 tokens a step: 2 processes x 2 micro-batches of 2 rows (gloo; only the last
    micro-batch all-reduces; on one node, or on two that each prepare their data), or 1 process
    x 4 micro-batches: the same rows, the same update. DDP broadcasts no buffer (the masks)."""
    same = ["--dtype", "float32", "--threads", "1", "--batch-size", "2", "--optimizer", optimizer]
    same += ["--tokens-per-step", "256", "--max-iters", "4", "--eval-interval", "2"]
    procs = torchrun(tmp_path, *tiny_args(tmp_path / "ddp", data_root, *same), nodes=nodes)
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outputs]
    out = "".join(out for out, _ in outputs)
    assert "2 x 2 processes x 2 rows" in out
    assert out.count("buffers broadcast: False") == 2
    # each node prepared the data it reads; only the first process writes the run
    assert all(
        (tmp_path / f"data{n}" / "shakespeare_char" / "train.bin").is_file() for n in range(nodes)
    )
    # gloo's threads left running into interpreter exit can abort a finished job (SIGABRT)
    left = re.findall(r"threads left: (\[.*?\])", out)
    assert len(left) == 2 and not any("gloo" in names for names in left), out[-3000:]
    start = initial_weights(monkeypatch)
    one = parse_args(tiny_args(tmp_path / "one", data_root, *same))
    assert train.train(one)["step"] == 4
    a, b = (load_checkpoint(tmp_path / d / "run" / "ckpt.pt") for d in ("ddp", "one"))
    close = {"best_val": pytest.approx(b["state"]["best_val"], abs=1e-6)}
    assert a["state"] == b["state"] | close | {"seconds": a["state"]["seconds"]}
    diff = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    assert diff < 1e-6
    moved = max((start[k] - b["model"][k]).abs().max().item() for k in b["model"])
    assert moved > 1e-3  # the tolerance is not vacuous
    la, lb = losses(tmp_path / "ddp" / "run"), losses(tmp_path / "one" / "run")
    assert la.keys() == lb.keys() == {1, 2, 3, 4}
    assert all(la[s] == pytest.approx(lb[s], abs=1e-6) for s in la)
    va, vb = val_losses(tmp_path / "ddp" / "run"), val_losses(tmp_path / "one" / "run")
    assert va.keys() == vb.keys() == {2, 4}
    assert all(va[s] == pytest.approx(vb[s], abs=1e-6) for s in va)


def test_a_run_resumes_in_float16_with_muon_and_a_loss_scaler(tmp_path, data_root):
    """float16 trains with a GradScaler, which a float32 run's checkpoint holds nothing of."""
    train.train(tiny(tmp_path, data_root, optimizer="muon", dtype="float32", max_iters=4))
    args = tiny_args(tmp_path, data_root, "--resume", "--dtype", "float16", "--max-iters", 8)
    resumed = train.train(parse_args(args))
    assert resumed["step"] == 8 and math.isfinite(resumed["val_loss"])
    assert load_checkpoint(tmp_path / "run")["scaler"]["scale"] > 0


def test_a_process_whose_weights_left_the_others_is_named_at_each_eval(tmp_path, data_root):
    args = tiny_args(tmp_path, data_root, "--max-iters", 2, "--eval-interval", 1)
    [proc] = torchrun(tmp_path, *args, "--tokens-per-step", 256, PERTURB_RANK="1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert err.count("warning: process 1's weights differ from process 0's") == 2, err[-3000:]


SIGNAL_RANK_1 = """\
import os, signal, sys
import train
from data.loader import Batches

at = os.environ.get("SIGNAL_AT") if os.environ["RANK"] == "1" else None
if at == "eval":  # as the first eval starts

    def signalled(*args, evaluate=train.evaluate):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*args)

    train.evaluate = signalled
elif at:  # as step `at` starts

    class Signalled(Batches):
        def __call__(self, step):
            if step == int(at):
                os.kill(os.getpid(), signal.SIGTERM)
            return super().__call__(step)

    train.Batches = Signalled
sys.exit(train.main())
"""


def two_processes(tmp_path, data_root, *flags, **env) -> list[int]:
    """SIGNAL_RANK_1's exit statuses, run as rank 0 and 1 of a gloo group (as torchrun starts them,
    but each status seen)."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "two.py").write_text(SIGNAL_RANK_1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    group = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = [
        subprocess.Popen(
            [sys.executable, tmp_path / "two.py", *tiny_args(tmp_path, data_root, *flags)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **group, **env, "RANK": r, "LOCAL_RANK": r},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in ("0", "1")
    ]
    try:
        return [p.wait(timeout=60) for p in procs]  # well before --ddp-timeout's 300 s
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("at, saved", [("eval", 5), ("7", 8)])  # at step 5's eval; between evals
def test_sigterm_to_one_process_stops_both_at_once_and_the_run_resumes_bit_for_bit(
    tmp_path, data_root, at, saved
):
    flags = ["--max-iters", 10, "--eval-interval", 5, "--log-interval", 10]
    flags += ["--tokens-per-step", 256, "--dtype", "float32", "--threads", 1, "--ddp-timeout", 300]
    assert two_processes(tmp_path / "cut", data_root, *flags, SIGNAL_AT=at) == [143, 143]
    assert saved_step(tmp_path / "cut" / "run" / "ckpt.pt") == saved
    assert two_processes(tmp_path / "cut", data_root, "--resume") == [0, 0]
    assert two_processes(tmp_path / "whole", data_root, *flags) == [0, 0]
    a, b = (
        torch.load(d / "run" / "ckpt.pt", weights_only=True)
        for d in (tmp_path / "cut", tmp_path / "whole")
    )
    for c in a, b:
        del c["config"]["out_dir"], c["state"]["seconds"]  # where, and the clock
    assert_same(a, b)


def test_a_shorter_context_than_the_weights_crops_the_model(tmp_path, data_root):
    """--init-from a run of block 32 with --block-size 16: one block_size, the checkpoint's."""
    train.train(tiny(tmp_path / "long", data_root, max_iters=2, pos_emb="learned"))
    cfg = tiny(tmp_path, data_root, max_iters=2, init_from=str(tmp_path / "long" / "run"))
    train.train(replace(cfg, block_size=16))
    checkpoint = load_checkpoint(tmp_path / "run")
    assert checkpoint["model_config"]["block_size"] == checkpoint["config"]["block_size"] == 16
    assert checkpoint["model"]["transformer.wpe.weight"].shape == (16, 16)
    model = GPT(GPTConfig(**checkpoint["model_config"]))
    model.load_state_dict(checkpoint["model"])
    assert model.transformer.h[0].attn.future.shape == (16, 16)


def start(tmp_path, data_root, *extra, **kwargs) -> subprocess.Popen:
    """train.py on the tiny preset in tmp_path/run, its output in tmp_path/out.txt, err.txt."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        return subprocess.Popen(
            [sys.executable, "train.py", *tiny_args(tmp_path, data_root, *extra)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            **kwargs,
        )


def output(tmp_path) -> tuple[str, str]:
    return (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()


def wait_until(ready, proc, tmp_path, timeout=120):
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, output(tmp_path)
        assert time.monotonic() < deadline, output(tmp_path)
        time.sleep(0.02)


def logged(run_dir, at_least=1):
    """Whether metrics.jsonl has at_least lines (by the first, the run's signal handlers are in
    place)."""
    path = run_dir / "metrics.jsonl"
    return lambda: path.is_file() and path.read_text().count("\n") >= at_least


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_saves_the_step_in_progress_and_exits_128_plus_its_number(
    tmp_path, data_root, sig
):
    proc = start(tmp_path, data_root, *LONG, "--sample-tokens", "16")
    try:
        wait_until(logged(tmp_path / "run", 2), proc, tmp_path)
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    out, err = output(tmp_path)
    assert code == 128 + sig, err[-2000:]
    run_dir = tmp_path / "run"
    step = saved_step(run_dir / "ckpt.pt")
    assert step >= 1 and max(losses(run_dir)) == step  # the last step logged is the one saved
    assert val_losses(run_dir) == {}  # a signal skips the final eval
    assert f"stopped at step {step} by {sig.name}" in out
    assert f"checkpoint {run_dir / 'ckpt.pt'}" in out and "a sample" not in out
    assert "Traceback" not in err


def test_a_second_ctrl_c_quits_at_once(tmp_path, data_root, monkeypatch, capsys):
    def pressed_twice(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the run's handler: stop after this step
            os.kill(os.getpid(), signal.SIGINT)  # Python's again: KeyboardInterrupt, now

    monkeypatch.setattr(train, "Batches", calling(pressed_twice))
    monkeypatch.setattr(sys, "argv", ["train.py", *tiny_args(tmp_path, data_root)])
    pipe, handler = signal.getsignal(signal.SIGPIPE), signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as e:
            run(train.main)  # as `python train.py` runs it
    finally:
        signal.signal(signal.SIGPIPE, pipe)
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert max(losses(tmp_path / "run")) == 3  # step 3 (the 4th) neither finished nor saved
    assert not (tmp_path / "run" / "ckpt.pt").exists()
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it(tmp_path, data_root):
    """`cmd &` starts a job with SIGINT ignored: a Ctrl-C meant for the shell's foreground job
    must not stop it. SIGTERM still does."""
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = start(tmp_path, data_root, *LONG, preexec_fn=ignore)
    try:
        wait_until(logged(tmp_path / "run"), proc, tmp_path)
        proc.send_signal(signal.SIGINT)
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().count("\n")
        wait_until(logged(tmp_path / "run", lines + 5), proc, tmp_path)  # 5 more steps: going on
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert code == 128 + signal.SIGTERM
    assert "by SIGTERM" in output(tmp_path)[0]


def poison_after(monkeypatch, good_steps):
    """GPT.forward's training loss becomes nan after good_steps steps (one micro-batch each)."""
    forward, calls = GPT.forward, []

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        if self.training:
            calls.append(1)
            if len(calls) > good_steps:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)


def test_a_nan_loss_stops_without_saving_and_names_the_last_good_checkpoint(
    tmp_path, data_root, monkeypatch
):
    poison_after(monkeypatch, 12)
    run_dir = tmp_path / "run"
    kept = re.escape(f"keeping {run_dir / 'ckpt.pt'} (step 10)")
    with pytest.raises(UserError, match=rf"^the loss became nan at step 13; stopped, {kept}"):
        train.train(tiny(tmp_path, data_root, eval_interval=5))
    checkpoint = load_checkpoint(run_dir / "ckpt.pt")
    assert checkpoint["state"]["step"] == 10
    assert all(t.isfinite().all() for t in checkpoint["model"].values())
    assert max(losses(run_dir)) == 12


def scripted_evals(monkeypatch, val_losses):
    """train.evaluate returns these val losses in turn (and a train loss of 1)."""
    values = iter(val_losses)
    monkeypatch.setattr(train, "evaluate", lambda *a: {"val_loss": next(values), "train_loss": 1.0})


def test_best_pt_keeps_the_lowest_val_loss_while_ckpt_pt_is_the_latest(
    tmp_path, data_root, monkeypatch
):
    scripted_evals(monkeypatch, [3.0, 2.0, 2.5, 2.7])  # steps 5, 10, 15, 20
    result = train.train(tiny(tmp_path, data_root, eval_interval=5))
    run_dir = tmp_path / "run"
    assert result["val_loss"] == 2.7
    latest, best = (load_checkpoint(run_dir / n) for n in ("ckpt.pt", "best.pt"))
    assert latest["state"]["step"] == 20 and latest["state"]["best_val"] == 2.0
    assert best["state"]["step"] == 10  # saved before the eval that made it the best
    assert load_checkpoint(run_dir)["state"]["step"] == 10  # what sample.py reads: best.pt
    assert val_losses(run_dir) == {5: 3.0, 10: 2.0, 15: 2.5, 20: 2.7}  # step 0 is not evaluated


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_val_loss_stops_the_run_and_best_pt_keeps_the_last_good_eval(
    tmp_path, data_root, monkeypatch, bad
):
    """The steps before an eval are saved before it (their weights are finite): ckpt.pt has them."""
    scripted_evals(monkeypatch, [3.0, bad])  # steps 5 and 10
    run_dir = tmp_path / "run"
    kept = re.escape(f"keeping {run_dir / 'ckpt.pt'} (step 10)")
    with pytest.raises(UserError, match=rf"^the val loss became {bad} at step 10; .*{kept}"):
        train.train(tiny(tmp_path, data_root, eval_interval=5))
    assert (saved_step(run_dir / "ckpt.pt"), saved_step(run_dir / "best.pt")) == (10, 5)
    assert val_losses(run_dir) == {5: 3.0}


def test_eval_only_reproduces_a_finished_runs_final_whole_split_val_loss(
    tmp_path, data_root, capsys
):
    trained = train.train(tiny(tmp_path, data_root, max_iters=5, eval_iters=0, eval_batch_size=512))
    run_dir = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    capsys.readouterr()
    # --eval-only reads all of val whatever --eval-iters says (tiny's: 2 batches)
    evaluated = train.train(tiny(tmp_path, data_root, eval_only=True, eval_batch_size=512))
    assert evaluated["val_loss"] == trained["val_loss"]
    assert evaluated["train_loss"] == trained["train_loss"]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # nothing trained
    out = capsys.readouterr().out
    assert (
        f"val_loss {trained['val_loss']:.4f}  perplexity {math.exp(trained['val_loss']):.2f}" in out
    )


def test_max_time_stops_the_run_with_its_final_eval_and_save_done(tmp_path, data_root, capsys):
    cfg = tiny(tmp_path, data_root, max_iters=1_000_000, max_time=3.0, eval_interval=1_000_000)
    result = train.train(cfg)
    step = result["step"]
    assert 0 < step < cfg.max_iters and result["stop_signal"] == 0
    assert val_losses(tmp_path / "run").keys() == {step}  # the final eval, and no eval at step 0
    state = load_checkpoint(tmp_path / "run" / "ckpt.pt")["state"]
    assert state["step"] == state["evaluated"] == step
    assert f"stopped at step {step} by max_time" in capsys.readouterr().out


def test_a_changed_lr_takes_effect_on_resume_and_config_json_then_holds_it(tmp_path, data_root):
    train.train(parse_args(tiny_args(tmp_path, data_root, "--max-iters", "4")))
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "config.json").read_text())["lr"] == 1e-3
    # min_lr = lr: the cosine's floor is its peak, so every step's lr is 5e-3
    again = ("--resume", "--max-iters", "8", "--lr", "5e-3", "--min-lr", "5e-3")
    train.train(parse_args(tiny_args(tmp_path, data_root, *again)))
    lrs = {r["step"]: r["lr"] for r in records(run_dir) if "lr" in r}
    assert all(lrs[s] <= 1e-3 for s in range(1, 5)) and [lrs[s] for s in range(5, 9)] == [5e-3] * 4
    checkpoint = load_checkpoint(run_dir / "ckpt.pt")
    assert [g["lr"] for g in checkpoint["optimizer"][0]["param_groups"]] == [5e-3, 5e-3]
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved == checkpoint["config"] and (saved["lr"], saved["max_iters"]) == (5e-3, 8)


def test_resuming_a_finished_run_adds_no_eval_and_no_step(tmp_path, data_root, monkeypatch):
    cfg = tiny(tmp_path, data_root, max_iters=4)
    train.train(cfg)
    run_dir = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    calls = []
    evaluate = train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda *a: calls.append("eval") or evaluate(*a))
    monkeypatch.setattr(train, "Batches", calling(lambda step: calls.append(step)))
    result = train.train(replace(cfg, resume=True))
    assert result == {"step": 4, "stop_signal": 0} and calls == []
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_resume_drops_the_metrics_past_its_checkpoint_then_appends(tmp_path, data_root):
    cfg = tiny(tmp_path, data_root, max_iters=6, eval_interval=3)
    train.train(cfg)
    metrics = tmp_path / "run" / "metrics.jsonl"
    kept = metrics.read_text()
    # a run that went on past the checkpoint at step 6 and was killed before its next save
    bogus = [{"step": 7, "loss": 99.0}, {"step": 9, "val_loss": 99.0, "train_loss": 99.0}]
    metrics.write_text(kept + "".join(json.dumps(r) + "\n" for r in bogus))
    train.train(replace(cfg, max_iters=8, resume=True))
    assert metrics.read_text().startswith(kept)
    lines = [(r["step"], "loss" in r) for r in records(tmp_path / "run")]
    evals = [(s, False) for s in (3, 6, 8)]
    steps = [(s, True) for s in range(1, 9)]
    assert lines == sorted(evals + steps, key=lambda line: (line[0], not line[1]))
    assert 99.0 not in [v for r in records(tmp_path / "run") for v in r.values()]


def test_config_json_holds_the_settings_and_resume_keeps_the_saved_thread_count(
    tmp_path, data_root, monkeypatch
):
    """The thread count changes how a CPU sums, so a resumed run keeps the one it started with,
    however many cores are idle then."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = []
    monkeypatch.setattr(
        train, "Batches", calling(lambda step: threads.append(torch.get_num_threads()))
    )
    monkeypatch.setattr("training.runtime.idle_cores", lambda: 1)
    cfg = parse_args(tiny_args(tmp_path, data_root, "--max-iters", "2"))
    train.train(cfg)
    run_dir = tmp_path / "run"
    vocab_size = load_checkpoint(run_dir / "ckpt.pt")["model_config"]["vocab_size"]
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved == settings(replace(cfg, threads=1, vocab_size=vocab_size))
    assert saved == load_checkpoint(run_dir / "ckpt.pt")["config"] and threads == [1, 1]
    monkeypatch.setattr("training.runtime.idle_cores", lambda: 2)
    threads.clear()
    train.train(parse_args(tiny_args(tmp_path, data_root, "--resume", "--max-iters", "4")))
    assert threads == [1, 1]
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["threads"], saved["max_iters"], saved["resume"]) == (1, 4, False)
    threads.clear()  # a fresh run takes the idle cores
    train.train(parse_args(tiny_args(tmp_path / "fresh", data_root, "--max-iters", "1")))
    assert threads == [2]


@contextmanager
def busy_process():
    """Another program keeping a core busy. Niced: it takes what the run leaves idle, so that a
    run counting idle cores counts one fewer, and slows the run itself but little."""
    busy = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19)
    )
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


# Two threads, so that how the CPU sums could change; given, since the idle cores that a run would
# otherwise count change with whatever else runs on the machine (the other tests, other users).
BUSY = ("--threads", "2", "--dropout", "0.1", "--max-iters", "6", "--eval-interval", "3")


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, data_root):
    """A run with nothing else busy on purpose: its folder."""
    base = tmp_path_factory.mktemp("undisturbed")
    done = script("train.py", *tiny_args(base, data_root, *BUSY))
    assert done.returncode == 0, done.stderr[-3000:]
    return base / "run"


def test_the_same_command_gives_the_same_weights_when_a_busy_process_starts_during_the_run(
    tmp_path, data_root, undisturbed
):
    proc = start(tmp_path, data_root, *BUSY)
    try:
        wait_until(lambda: output(tmp_path)[0].count("\n") >= 1, proc, tmp_path)  # its first line
        with busy_process():
            code = proc.wait(timeout=300)
    finally:
        proc.kill()
    assert code == 0, output(tmp_path)[1][-3000:]
    assert output(tmp_path)[0].startswith("cpu, 2 threads")
    assert_same_run(undisturbed, tmp_path / "run")


def test_a_run_stopped_by_ctrl_c_and_resumed_beside_a_busy_process_ends_as_the_undisturbed_one(
    tmp_path, data_root, undisturbed
):
    """Beside the busy process, a count of idle cores would find one fewer than the run's two
    threads: the resumed run keeps the two it started with."""
    proc = start(tmp_path, data_root, *BUSY)
    try:
        wait_until(logged(tmp_path / "run", 2), proc, tmp_path)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, output(tmp_path)
    finally:
        proc.kill()
    assert saved_step(tmp_path / "run" / "ckpt.pt") < 6
    with busy_process():
        resumed = script("train.py", *tiny_args(tmp_path, data_root, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.startswith("cpu, 2 threads")
    assert_same_run(undisturbed, tmp_path / "run")


def wandb_env(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return env | {"WANDB_MODE": mode, "WANDB_SILENT": "true"}


def test_wandb_offline_writes_under_the_run_folder_and_the_run_finishes(tmp_path, data_root):
    argv = tiny_args(tmp_path, data_root, "--wandb", "--max-iters", "4")
    done = script("train.py", *argv, env=wandb_env("offline"))
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    checkpoint = load_checkpoint(run_dir / "ckpt.pt")
    wandb_id = checkpoint["state"]["wandb_id"]
    assert checkpoint["state"]["step"] == 4 and wandb_id
    [log] = (run_dir / "wandb").glob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb")
    blob = log.read_bytes()  # wandb's record log: keys are stored as plain strings
    assert all(k in blob for k in (b"val_loss", b"train_loss", b"tokens_per_s", b"n_layer"))


def test_wandb_that_cannot_start_is_one_line_and_no_step_is_trained(tmp_path, data_root):
    done = script("train.py", *tiny_args(tmp_path, data_root, "--wandb"), env=wandb_env("bogus"))
    assert one_error_line(done).startswith("error: --wandb: wandb did not start (")
    assert not {"ckpt.pt", "metrics.jsonl", "config.json"} & set(os.listdir(tmp_path / "run"))


def test_a_second_run_is_refused_while_the_first_holds_the_folder_and_the_lock_dies_with_it(
    tmp_path, data_root
):
    run_dir = tmp_path / "run"
    proc = start(tmp_path, data_root, *LONG)
    try:
        wait_until(logged(run_dir), proc, tmp_path)
        for resume in (False, True):
            with pytest.raises(UserError, match=f"^{re.escape(str(run_dir))} is in use by another"):
                train.train(tiny(tmp_path, data_root, max_iters=2, resume=resume))
    finally:
        proc.kill()  # SIGKILL: no chance to clean up
        proc.wait()
    # killed before its first save: a new run may take the folder
    assert {".lock", "config.json", "metrics.jsonl"} <= set(os.listdir(run_dir))
    assert not (run_dir / "ckpt.pt").exists()
    assert train.train(tiny(tmp_path, data_root, max_iters=2))["step"] == 2
    assert min(losses(run_dir)) == 1 and saved_step(run_dir / "ckpt.pt") == 2


def contents(folder) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_fresh_run_refuses_a_trained_run_and_a_users_folder_and_leaves_them_untouched(
    tmp_path, data_root
):
    trained = tmp_path / "run"
    train.train(tiny(tmp_path, data_root, max_iters=2))
    before = contents(trained)
    with pytest.raises(UserError, match=f"^{re.escape(str(trained))} holds a trained run; "):
        train.train(tiny(tmp_path, data_root, max_iters=2))
    assert contents(trained) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "config.json").write_text("{}")
    before = contents(mine)
    with pytest.raises(UserError, match=r"holds files no run wrote \(notes.txt\); pick another"):
        train.train(tiny(tmp_path, data_root, out_dir=str(mine), max_iters=2))
    assert contents(mine) == before


def test_a_fresh_run_may_reuse_the_folder_of_a_run_that_never_saved(tmp_path, data_root):
    unsaved = tmp_path / "run"
    unsaved.mkdir()
    (unsaved / "config.json").write_text('{"lr": 1}')
    (unsaved / "metrics.jsonl").write_text(json.dumps({"step": 50, "loss": 99.0}) + "\n")
    assert train.train(tiny(tmp_path, data_root, max_iters=2))["step"] == 2
    assert records(unsaved)[0]["step"] == 1 and 50 not in losses(unsaved)
    assert json.loads((unsaved / "config.json").read_text())["lr"] == 1e-3


def test_a_save_that_fails_midway_keeps_the_previous_checkpoint_whole(
    tmp_path, data_root, monkeypatch
):
    real_save, run_dir, kept = torch.save, tmp_path / "run", []

    def disk_full_at_step_10(obj, f, *args, **kwargs):
        if obj["state"]["step"] == 10:
            kept.append((run_dir / "ckpt.pt").read_bytes())
            with open(f, "wb") as out:  # some bytes land, then the disk is full
                out.write(b"PK\x03\x04 half a zip")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_10)
    with pytest.raises(OSError, match="No space left"):
        train.train(tiny(tmp_path, data_root, eval_interval=5))
    monkeypatch.setattr(torch, "save", real_save)
    assert (run_dir / "ckpt.pt").read_bytes() == kept[0]
    assert saved_step(run_dir / "ckpt.pt") == 5
    assert not [name for name in os.listdir(run_dir) if name.endswith(".tmp")]


def test_save_checkpoint_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": torch.tensor(1)}, path)
    save_checkpoint({"step": torch.tensor(2)}, path)
    assert torch.load(path, weights_only=True)["step"] == 2
    before = path.read_bytes()

    def broken(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError):
        save_checkpoint({"step": torch.tensor(3)}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]


def test_the_end_of_a_run_says_where_its_files_are_and_samples_what_sample_py_continues(
    tmp_path, data_root, capsys
):
    cfg = tiny(tmp_path, data_root, sample_tokens=32, dtype="float32")
    train.train(cfg)
    out = capsys.readouterr().out
    run_dir = tmp_path / "run"
    lines = out.splitlines()
    assert f"checkpoint {run_dir / 'ckpt.pt'} (the latest, for --resume)" in lines
    assert f"best       {run_dir / 'best.pt'} (the lowest val loss: sample.py's)" in lines
    assert f"metrics    {run_dir / 'metrics.jsonl'} and {run_dir / 'loss.png'}" in lines
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = f"a sample (python sample.py --out-dir {run_dir} for more):\n"
    assert out.count(header) == 1 and out.endswith("\n")
    sample = out.split(header)[1][:-1]
    assert len(sample) == 32
    assert saved_step(run_dir / "best.pt") == 20  # sample.py reads best.pt: the final weights
    more = script("sample.py", "--out-dir", run_dir, "--seed", cfg.seed, "--max-new-tokens", 64)
    assert more.returncode == 0, more.stderr
    assert more.stdout.startswith(sample) and len(more.stdout) > len(sample)


def test_an_eval_that_fails_loses_no_step_the_steps_before_it_are_saved_first(
    tmp_path, data_root, monkeypatch
):
    evaluate, calls = train.evaluate, []

    def fails_at_step_5(*args):
        calls.append(1)
        if len(calls) == 1:  # the first eval: step 5's (step 0 has none)
            raise RuntimeError("the eval died")
        return evaluate(*args)

    monkeypatch.setattr(train, "evaluate", fails_at_step_5)
    with pytest.raises(RuntimeError, match="the eval died"):
        train.train(tiny(tmp_path, data_root, eval_interval=5))
    assert saved_step(tmp_path / "run" / "ckpt.pt") == 5


@pytest.mark.parametrize("at_eval", [0, 1])  # the first eval (step 5), and step 10's
def test_a_signal_during_an_eval_ends_it_at_once_and_no_step_is_trained_after_it(
    tmp_path, data_root, monkeypatch, capsys, at_eval
):
    """SIGTERM comes with the second val batch of eval number at_eval: that batch is not used, no
    more are asked for, train's batches are not read, and the run saves what it had and stops."""
    batches, reads, handed = train.eval_batches, [], []

    def signalled(path, *args):
        reads.append(path.name)
        for i, batch in enumerate(batches(path, *args)):
            if path.name == "val.bin" and reads.count("val.bin") == at_eval + 1 and i == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            handed.append(path.name)
            yield batch

    monkeypatch.setattr(train, "eval_batches", signalled)
    capsys.readouterr()
    result = train.train(tiny(tmp_path, data_root, eval_interval=5, eval_iters=4))
    assert (result["step"], result["stop_signal"]) == (5 + 5 * at_eval, signal.SIGTERM)
    assert ("loss.png" in capsys.readouterr().out) is bool(at_eval)  # named only when drawn
    assert reads == ["val.bin", "train.bin"] * at_eval + ["val.bin"]
    assert handed == (["val.bin"] * 4 + ["train.bin"] * 4) * at_eval + ["val.bin"] * 2
    assert val_losses(tmp_path / "run").keys() == ({5} if at_eval else set())
    assert saved_step(tmp_path / "run" / "ckpt.pt") == 5 + 5 * at_eval  # saved before the eval


def test_resume_goes_on_with_a_max_time_runs_schedule_where_it_stopped(
    tmp_path, data_root, monkeypatch
):
    """The schedule of a --max-time run runs on the clock: stopped 2.5 s into 6, the resumed run's
    first lr is about the last one's (it began again at the peak before), and the time left is
    what the checkpoint had."""
    started, sent = time.time(), []

    def stop_once_late(step):
        if time.time() - started > 2.5 and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(train, "Batches", calling(stop_once_late))
    cfg = tiny(tmp_path, data_root, max_iters=10**6, eval_interval=10**6, max_time=6.0)
    stopped = train.train(cfg)
    assert stopped["stop_signal"] == signal.SIGUSR1
    spent = load_checkpoint(tmp_path / "run" / "ckpt.pt")["state"]["seconds"]
    assert 2.0 < spent < 6.0
    monkeypatch.setattr(train, "Batches", Batches)
    resumed_at = time.time()
    train.train(replace(cfg, resume=True))
    assert time.time() - resumed_at < cfg.max_time - spent + 2  # the time left, not 6 s more
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "run") if "lr" in r}
    last, first = lrs[stopped["step"]], lrs[stopped["step"] + 1]
    assert last < 0.8 * cfg.lr and first == pytest.approx(last, rel=0.15)


def test_eval_only_names_the_file_it_scores_also_from_a_runs_config_json(
    tmp_path, data_root, capsys
):
    """best.pt (the lowest val loss) is what it scores, and names; with the run's config.json as
    --config, that run's, wherever the command is typed."""
    train.train(tiny(tmp_path, data_root, max_iters=4, eval_interval=2, eval_batch_size=512))
    run_dir = tmp_path / "run"
    capsys.readouterr()
    for argv in (
        tiny_args(tmp_path, data_root, "--eval-only", "--eval-batch-size", "512"),
        ["--config", str(run_dir / "config.json"), "--eval-only"],
    ):
        train.train(parse_args(argv))
        first = capsys.readouterr().out.splitlines()[1]
        assert first.startswith(f"{run_dir / 'best.pt'} on shakespeare_char, windows of 32")
    (run_dir / "best.pt").unlink()
    train.train(
        parse_args(tiny_args(tmp_path, data_root, "--eval-only", "--eval-batch-size", "512"))
    )
    assert capsys.readouterr().out.splitlines()[1].startswith(f"{run_dir / 'ckpt.pt'} on ")


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_folder_that_cannot_be_written_is_one_line(tmp_path, data_root, monkeypatch, resume):
    cfg = tiny(tmp_path, data_root, max_iters=2)
    if resume:
        train.train(cfg)
        real_open, real_os_open = open, os.open

        def refused(path):
            if str(path).startswith(str(tmp_path / "run")):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))

        def read_only(path, mode="r", *args, **kwargs):
            if "w" in mode:
                refused(path)
            return real_open(path, mode, *args, **kwargs)

        def os_read_only(path, flags, *args, **kwargs):  # how the lock opens its file
            if flags & (os.O_WRONLY | os.O_RDWR):
                refused(path)
            return real_os_open(path, flags, *args, **kwargs)

        monkeypatch.setattr("builtins.open", read_only)
        monkeypatch.setattr(os, "open", os_read_only)
        fix = "make it writable to resume it"
    else:
        (tmp_path / "file").write_text("")
        cfg = replace(cfg, out_dir=str(tmp_path / "file" / "run"))
        fix = "pick another --out-dir"
    with pytest.raises(UserError) as e:
        train.train(replace(cfg, resume=resume, max_iters=4))
    why = "Permission denied" if resume else "Not a directory"
    assert str(e.value) == f"cannot write in {cfg.run_dir} ({why}); {fix}"


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path, data_root):
    cfg = tiny(tmp_path, data_root, max_iters=4)
    train.train(cfg)
    metrics = tmp_path / "run" / "metrics.jsonl"
    kept = metrics.read_text()
    metrics.write_text(kept + '{"step": 5, "lo')
    train.train(replace(cfg, max_iters=6, resume=True))
    assert metrics.read_text().startswith(kept) and '"lo\n' not in metrics.read_text()
    assert sorted({r["step"] for r in records(tmp_path / "run")}) == list(range(1, 7))


def test_a_max_time_too_short_for_a_step_is_one_line_before_the_run_starts(tmp_path, data_root):
    line = one_error_line(
        in_process(train.main, *tiny_args(tmp_path, data_root, "--max-time", 0.5))
    )
    assert re.fullmatch(
        r"error: --max-time 0.5 leaves no time for a step: -?[\d.]+ s of it are left after "
        r"start-up; give more",
        line,
    )
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_a_resume_past_max_iters_says_so_and_a_signal_ends_the_last_sample(
    tmp_path, data_root, monkeypatch, capsys
):
    cfg = tiny(tmp_path, data_root, max_iters=4)
    train.train(cfg)
    train.train(replace(cfg, max_iters=2, resume=True))
    assert "stopped at step 4 by max_iters" in capsys.readouterr().out
    generate, drawn = train.generate, []

    def signalled(*args):
        for i, t in enumerate(generate(*args)):
            if i == 3:
                os.kill(os.getpid(), signal.SIGINT)
            drawn.append(t)
            yield t

    monkeypatch.setattr(train, "generate", signalled)
    result = train.train(replace(cfg, max_iters=6, resume=True, sample_tokens=1000))
    assert result["stop_signal"] == signal.SIGINT and len(drawn) == 4


@pytest.mark.parametrize("missing", ["empty", "absent"])
def test_eval_only_of_a_folder_without_a_run_says_there_is_no_checkpoint(
    tmp_path, data_root, missing
):
    if missing == "empty":
        (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match=f"^no checkpoint at {tmp_path / 'run' / 'ckpt.pt'}; "):
        train.train(tiny(tmp_path, data_root, eval_only=True))


def test_best_pt_is_a_hard_link_of_ckpt_pt_or_a_copy_where_links_are_refused(tmp_path, monkeypatch):
    from model.checkpoint import keep_best

    (tmp_path / "ckpt.pt").write_bytes(b"weights")
    keep_best(tmp_path)
    assert os.stat(tmp_path / "best.pt").st_ino == os.stat(tmp_path / "ckpt.pt").st_ino
    (tmp_path / "ckpt.pt").unlink()
    (tmp_path / "ckpt.pt").write_bytes(b"newer")

    def refused(*args):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refused)
    keep_best(tmp_path)
    assert (tmp_path / "best.pt").read_bytes() == b"newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "ckpt.pt"]


@pytest.mark.parametrize("kept", ["ckpt.pt", "best.pt"])
def test_init_from_a_run_folder_holding_either_checkpoint_takes_its_weights_and_dropout(
    tmp_path, data_root, kept
):
    from model.hf import load_weights

    train.train(tiny(tmp_path, data_root, max_iters=2))
    run_dir = tmp_path / "run"
    (run_dir / ({"ckpt.pt", "best.pt"} - {kept}).pop()).unlink()
    model, manifest = load_weights(str(run_dir), dropout=0.25)
    assert model.config.dropout == 0.25 and manifest["name"] == "shakespeare_char"
    saved = load_checkpoint(run_dir / kept)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
