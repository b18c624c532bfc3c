"""train.py end to end on the tiny preset (CPU, seconds): exact resume, stop signals, failures,
the run folder, and what a run leaves and prints."""

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from signal import SIGINT, SIGTERM, SIGUSR1

import pytest
import torch
from conftest import ROOT, in_process, rows, script, tiny, tiny_args
from filelock import FileLock
from test_config import refused, write  # a UserError's one line; a file, in folders made
from test_failures import contents  # a folder's files, but the lock a run held
from test_sample import sample_py  # sample.py's output
from torch.utils._pytree import tree_map_only

import train
from configs import parse_args, settings
from data.loader import Batches
from model.checkpoint import load_checkpoint, model_from
from training.optim import lr_factor

PIPE = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read(run, key=None):
    """metrics.jsonl's records, or {step: value} of those that hold key."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows if key is None else {r["step"]: r[key] for r in rows if key in r}


def step_of(run):
    return load_checkpoint(run / "ckpt.pt")["state"]["step"]


def fit(folder, data_root, **fields):
    """train.train on the tiny preset in folder/run."""
    return train.train(tiny(folder, data_root, **fields))


def same_run(a, b):
    """Two run folders hold the same training: checkpoints bit for bit (but for where they and
    their data are, and the clock) and the same metrics (but for the clock)."""

    def kept(run):
        c = load_checkpoint(run / "ckpt.pt")
        del c["config"]["out_dir"], c["config"]["data_root"], c["state"]["seconds"]
        rows = [r | dict(time=0, tokens_per_s=0) for r in read(run)]
        return tree_map_only(torch.Tensor, lambda t: (t.dtype, t.tolist()), c), rows

    assert kept(a) == kept(b)


def signal_at(sig, at, *more):
    """train.Batches, sending this process sig, then more, as step `at` (or one for which at(step)
    holds) asks for batches. tests/test_cuda.py uses it too."""

    class Signalled(Batches):
        def __call__(self, step):
            for s in (sig, *more) * (at(step) if callable(at) else step == at):
                signal.raise_signal(s)
            return super().__call__(step)

    return Signalled


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_stop_signals_save_the_step_and_exit_128_plus_n_and_the_resumes_end_bit_for_bit(
    tmp_path, data_root, monkeypatch, optimizer
):
    """Dropout 0.1, so that the resumed runs must draw the same dropout masks too."""
    run, handler = tmp_path / "run", signal.getsignal(SIGINT)

    def main(*more, folder=tmp_path, batches=Batches):
        monkeypatch.setattr(train, "Batches", batches)
        flags = f"--dropout 0.1 --optimizer {optimizer} --sample-tokens 16".split()
        return in_process(train.main, *tiny_args(folder, data_root, *flags, *more))

    assert "a sample" in main(folder=tmp_path / "full").stdout
    # a second Ctrl-C quits at once: step 3 (the 4th) neither ends nor is saved
    done = main(batches=signal_at(SIGINT, 3, SIGINT))
    assert done.returncode == 130 and done.stderr.endswith("\ninterrupted\n")
    assert "Traceback" not in done.stderr and signal.getsignal(SIGINT) is handler
    assert max(read(run, "loss")) == 3 and not (run / "ckpt.pt").exists()
    try:
        for n, (at, sig) in enumerate([(3, SIGINT), (7, SIGTERM), (12, SIGUSR1)]):
            old = signal.getsignal(sig)
            done = main(*["--resume"][:n], batches=signal_at(sig, at, *[SIGINT][:n]))
            assert done.returncode == 128 + sig and signal.getsignal(sig) is old
            assert f"stopped at step {at + 1} by {sig.name}" in done.stdout  # step `at` finished
            assert f"checkpoint {run / 'ckpt.pt'}" in done.stdout and "a sample" not in done.stdout
            assert step_of(run) == max(read(run, "loss")) == at + 1
            # `cmd &` starts a job with SIGINT ignored: a Ctrl-C for the shell's foreground job
            # must not stop it, where SIGTERM and SIGUSR1 still do
            signal.signal(SIGINT, signal.SIG_IGN)
    finally:
        signal.signal(SIGINT, handler)
    assert main("--resume").returncode == 0
    same_run(tmp_path / "full" / "run", run)
    # the lr each step trained with: warmup over 2 steps, then the cosine down to min_lr
    c = tiny(tmp_path, data_root)
    assert list(read(run, "lr").values()) == pytest.approx(
        [c.lr * lr_factor(s, c, (s - 2) / 18) for s in range(20)], rel=1e-12
    )


def test_a_fresh_run_takes_a_killed_runs_folder_and_the_idle_cores_and_logs_the_mean_loss(
    tmp_path, data_root, monkeypatch
):
    """A run that is alive holds the folder's lock; a killed one leaves its lock file, which no
    process holds then, and what it logged."""
    run = tmp_path / "run"
    write(run / ".lock", "")
    write(run / "config.json", '{"lr": 1}')
    write(run / "metrics.jsonl", '{"step": 9, "loss": 9}')
    with FileLock(run / ".lock"):  # as a run that is alive holds it
        # a fresh run's refusal: test_failures.py's test_a_run_folder_of_other_files_or_in_use
        assert "is in use by another run; " in refused(
            tiny(tmp_path, data_root, resume=True), train.train
        )
    monkeypatch.setattr("training.runtime.idle_cores", lambda: 2)
    # lr 0: the first weights stay
    cfg = tiny(
        tmp_path, data_root, max_iters=1, dtype="float32", tokens_per_step=512, lr=0.0, min_lr=0.0
    )
    train.train(cfg)  # its one step: the loss logged below
    assert torch.get_num_threads() == 2
    checkpoint = load_checkpoint(run / "ckpt.pt")
    saved = settings(replace(cfg, threads=2, vocab_size=checkpoint["model_config"]["vocab_size"]))
    assert json.loads((run / "config.json").read_text()) == checkpoint["config"] == saved
    # the logged loss is the mean of the 4 micro-batches' losses, which differ
    micro = Batches(data_root / "shakespeare_char" / "train.bin", 32, 4, 4, 0, 1, cfg.seed, "cpu")
    each = [model_from(checkpoint)(x, y)[1].item() for x, y in micro(0)]
    mean = sum(each) / 4
    assert min(abs(loss - mean) for loss in each) > 1e-4
    assert read(run, "loss") == {1: pytest.approx(mean, rel=1e-6)}


# the fault | ckpt.pt's step, the last step logged | the error
FAULTS = """loss | 15 15 | configs.UserError: the loss became nan at step 16; stopped, keeping {} \
(step 15)
disk | 15 20 | OSError: [Errno 28] No space left on device
weights | 20 20 | configs.UserError: the weights became nan or inf at step 20; stopped, keeping {} \
(step 20)
nan | 20 20 | configs.UserError: the val loss became nan at step 20; stopped, keeping {} (step 20)
inf | 20 20 | configs.UserError: the val loss became inf at step 20; stopped, keeping {} (step 20)
RuntimeError | 20 20 | RuntimeError: the eval died"""


@pytest.mark.parametrize("fault, steps, why", rows(FAULTS))
def test_a_bad_loss_eval_or_save_stops_keeping_the_last_good_checkpoint_whole_and_the_best(
    tmp_path, data_root, monkeypatch, fault, steps, why
):
    """Evals at steps 5, 10, 15 and 20 score 3.0, 2.0, 2.5, then the fault; or the weights become
    nan after step 15's or in step 20's, or saving step 20 fills the disk. A step is saved before
    its eval, and best.pt before the eval that made it the best."""
    values, run = iter([3.0, 2.0, 2.5, fault]), tmp_path / "run"

    def evaluate(model, *args):
        if (value := next(values)) == "RuntimeError":
            raise RuntimeError("the eval died")
        if value == 2.5 and fault == "loss":  # then step 16's loss is nan
            model.lm_head.weight.data[0] = math.nan
        if value == 2.5 and fault == "disk":  # then step 20's save fills the disk
            monkeypatch.setattr(torch, "save", disk_full)
        if value == "weights":  # the last eval's: the save after it refuses them
            model.lm_head.weight.data[0], value = math.nan, 1.0
        return {"val_loss": float(value), "train_loss": 1.0}

    def disk_full(obj, f):
        f.write_bytes(b"PK\x03\x04 half a zip")  # some bytes land, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train, "evaluate", evaluate)
    if fault == "disk":  # and links refused: best.pt a copy
        monkeypatch.setattr(os, "link", lambda *args: os.stat("none"))
    with pytest.raises(Exception) as e:
        fit(tmp_path, data_root, eval_interval=5)
    assert e.exconly().startswith(why.format(run / "ckpt.pt"))
    checkpoint = load_checkpoint(run / "ckpt.pt")
    assert f"{checkpoint['state']['step']} {max(read(run, 'loss'))}" == steps
    assert read(run, "val_loss") == {5: 3.0, 10: 2.0, 15: 2.5}  # step 0 is not evaluated
    assert checkpoint["state"]["best_val"] == 2.0
    assert all(t.isfinite().all() for t in checkpoint["model"].values())
    # best.pt: sample.py's checkpoint
    assert load_checkpoint(run)["state"]["step"] == 10  # the folder's is best.pt
    assert not any(name.endswith((".tmp", ".old")) for name in os.listdir(run))


@pytest.mark.parametrize("at_eval", [0, 1])  # the first eval (step 5), and step 10's
def test_a_signal_during_an_eval_ends_it_at_once_and_no_step_is_trained_after_it(
    tmp_path, data_root, monkeypatch, capsys, at_eval
):
    """SIGTERM comes with the second val batch of eval number at_eval: that batch is not used, no
    more are asked for, train's batches are not read, and the run saves what it had and stops."""
    handed, run = [], tmp_path / "run"

    def signalled(path, *args, batches=train.eval_batches):
        for batch in batches(path, *args):
            if len(handed) == 8 * at_eval + 1:  # after 4 val and 4 train batches an eval
                signal.raise_signal(SIGTERM)
            handed.append(path.name)
            yield batch

    monkeypatch.setattr(train, "eval_batches", signalled)
    result = fit(tmp_path, data_root, eval_interval=5, eval_iters=4)
    step = 5 + 5 * at_eval
    assert (result["step"], result["stop_signal"]) == (step, SIGTERM)
    assert ("loss.png" in capsys.readouterr().out) is bool(at_eval)  # named only when drawn
    assert handed == (["val.bin"] * 4 + ["train.bin"] * 4) * at_eval + ["val.bin"] * 2
    # saved before the eval
    assert read(run, "val_loss").keys() == {5} & {step - 5} and step_of(run) == step


def test_a_finished_run_says_where_its_files_are_takes_eval_only_and_init_from_and_resumes(
    tmp_path, data_root, monkeypatch, capsys
):
    """A finished run (Muon, learned positions, one eval at the end on whole splits, a sample).
    Runs that cannot start say why in a line, and leave its folder as it was; then resumes of it
    that take changes."""
    flags = (
        "--optimizer muon --dtype float32 --threads 1 --pos-emb learned --eval-iters 0"
        " --eval-batch-size 512 --eval-interval 20 --sample-tokens 32"
    ).split()
    done = in_process(train.main, *tiny_args(tmp_path, data_root, *flags))
    assert done.returncode == 0, done.stderr
    run, out = tmp_path / "run", done.stdout
    before, metrics = contents(run), run / "metrics.jsonl"
    assert {
        f"checkpoint {run / 'ckpt.pt'} (the latest, for --resume)",
        f"best       {run / 'best.pt'} (the lowest val loss: sample.py's)",
        f"metrics    {metrics} and {run / 'loss.png'}",
    } <= set(out.splitlines())
    assert (run / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert (run / "best.pt").samefile(run / "ckpt.pt")  # a hard link
    _, text = out.split(f"a sample (python sample.py --out-dir {run} for more):\n")
    # sample.py's best.pt is a link of ckpt.pt (step 20, as the first resume below finds): the
    # final weights, which sample.py goes on with
    assert len(text) == 33
    more = sample_py(f"--out-dir {run} --seed 1337 --max-new-tokens 64")
    assert more.startswith(text[:-1]) and len(more) > 33 and text[-1] == "\n"
    # --eval-only with the run's config.json as --config (wherever the command is typed) scores
    # that run's best.pt on all of val, whatever --eval-iters says
    scored = train.train(
        parse_args(f"--config {run}/config.json --eval-only --eval-iters 1".split())
    )
    assert scored == {"stop_signal": 0} | {k: read(run, k)[20] for k in ("val_loss", "train_loss")}
    out, val = capsys.readouterr().out, scored["val_loss"]
    assert f"val_loss {val:.4f}  perplexity {math.exp(val):.2f}" in out
    # --init-from a run folder that holds only ckpt.pt (only best.pt, and the weights it loads:
    # test_sample.py's test_greedy_decoding_streams_each_prompt_and_its_likeliest_tokens), of
    # block 32, with --block-size 16: one block_size, the checkpoint's
    folder = shutil.copytree(run, tmp_path / "best.pt" / "run")
    (folder / "best.pt").unlink()
    fit(
        tmp_path / "init",
        data_root,
        max_iters=2,
        init_from=str(folder),
        block_size=16,
        dropout=0.25,
    )
    checkpoint = load_checkpoint(tmp_path / "init" / "run")
    assert checkpoint["model_config"]["block_size"] == checkpoint["config"]["block_size"] == 16
    assert checkpoint["model_config"]["dropout"] == 0.25
    assert checkpoint["model"]["transformer.wpe.weight"].shape == (16, 16)
    # what --eval-only names: that run's best.pt; without best.pt, ckpt.pt
    with monkeypatch.context() as m:
        m.setattr(train, "evaluate", lambda *args: {"val_loss": 1.0})
        fit(tmp_path / "best.pt", data_root, eval_only=True)
    heads = [line for line in (out + capsys.readouterr().out).splitlines() if " on " in line]
    assert heads == [
        f"{run}/best.pt on shakespeare_char, windows of 32:",
        f"{tmp_path}/best.pt/run/ckpt.pt on shakespeare_char, windows of 32:",
    ]
    assert re.fullmatch(
        r"--max-time 0.5 leaves no time for a step: -?[\d.]+ s of it are left after start-up; "
        "give more",
        refused(tiny(tmp_path / "short", data_root, max_time=0.5), train.train),
    )
    assert not (tmp_path / "short" / "run" / "ckpt.pt").exists()
    # a fresh run in a trained run's folder, one in a file, --eval-only of no checkpoint:
    # test_failures.py's MISTAKES

    def read_only(path, flags, *args, real=os.open):  # the run's folder refuses writes
        if flags & (os.O_WRONLY | os.O_RDWR) and str(path).startswith(str(run)):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, flags, *args)

    with monkeypatch.context() as m:
        m.setattr(os, "open", read_only)
        why = f"cannot write in {run} (Permission denied); make it writable to resume it"
        assert refused(tiny(tmp_path, data_root, resume=True, max_iters=30), train.train) == why
    assert contents(run) == before  # nothing trained, nothing written

    # resumes, with 2 idle cores: each keeps the 1 thread the run had
    monkeypatch.setattr("training.runtime.idle_cores", lambda: 2)

    def resume(flags):
        return train.train(parse_args(tiny_args(tmp_path, data_root, "--resume", *flags.split())))

    # a finished run, asked for fewer steps than it has, adds no step and no eval
    assert resume("--max-iters 2") == {"step": 20, "stop_signal": 0} and contents(run) == before
    assert "stopped at step 20 by max_iters" in capsys.readouterr().out
    # a run that went on past its checkpoint and was killed before its next save, mid-line
    kept = metrics.read_text()
    metrics.write_text(kept + '{"step": 21, "loss": 9}\n{"step": 23, "val_loss": 9}\n{"step": 24')
    # min_lr = lr: the cosine's floor is its peak, so every new step's lr is 5e-3
    resume("--max-iters 24 --eval-interval 2 --eval-iters 2 --lr 5e-3 --min-lr 5e-3")
    assert metrics.read_text().startswith(kept) and torch.get_num_threads() == 1
    assert [(r["step"], "val_loss" in r) for r in read(run)] == [
        (s, e) for s in range(1, 25) for e in (False, True)[: 1 + (s in (20, 22, 24))]
    ]
    lrs = list(read(run, "lr").values())
    assert max(lrs[:20]) <= 1e-3 and lrs[20:] == [5e-3] * 4
    checkpoint = load_checkpoint(run / "ckpt.pt")
    assert [g["lr"] for g in checkpoint["optimizer"][0]["param_groups"]] == [5e-3, 5e-3]
    config = checkpoint["config"]
    assert (
        json.loads((run / "config.json").read_text())
        == config
        == config | dict(lr=5e-3, max_iters=24, threads=1, resume=False)
    )

    # float16 trains with a loss scaler that a float32 run's checkpoint holds nothing of; a
    # signal ends the last sample too, at its 4th token
    def generate(*a, generate=train.generate):
        for i, t in enumerate(generate(*a)):
            if i == 3:
                signal.raise_signal(SIGINT)
            yield t

    monkeypatch.setattr(train, "generate", generate)
    result = resume("--max-iters 26 --dtype float16 --sample-tokens 1000")
    assert (result["step"], result["stop_signal"]) == (26, SIGINT) and result["val_loss"] < 9
    assert len(capsys.readouterr().out.split("more):\n")[1]) == 4  # 3 tokens and a line's end
    assert load_checkpoint(run / "ckpt.pt")["scaler"]["scale"] > 0


def test_wandb_offline_writes_under_the_run_folder_and_one_that_cannot_start_is_one_line(
    tmp_path, data_root, monkeypatch
):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {
        "WANDB_SILENT": "true",
        "WANDB_MODE": "offline",
    }
    done = script("train.py", *tiny_args(tmp_path, data_root, "--wandb", "--max-iters", 4), env=env)
    assert done.returncode == 0, done.stderr
    state = load_checkpoint(tmp_path / "run" / "ckpt.pt")["state"]
    assert state["step"] == 4 and (wandb_id := state["wandb_id"])
    [log] = (tmp_path / "run" / "wandb").glob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb")
    # wandb's record log: keys are stored as plain strings
    keys = b"val_loss", b"train_loss", b"tokens_per_s", b"n_layer"
    assert all(k in log.read_bytes() for k in keys)
    # in this process: a UserError is one line (test_failures.py's
    # test_run_turns_a_mistake_or_out_of_memory_into_one_line_and_ctrl_c_into_130)
    monkeypatch.setenv("WANDB_MODE", "bogus")
    assert refused(tiny(tmp_path / "bogus", data_root, wandb=True), train.train).startswith(
        "--wandb: wandb did not start ("
    )
    assert os.listdir(tmp_path / "bogus" / "run") == [".lock"]  # no step trained


def test_max_time_ends_in_time_with_its_final_eval_saved_and_a_resume_goes_on_with_its_clock(
    tmp_path, data_root, monkeypatch, capsys, clock
):
    """The schedule of a --max-time run runs on the clock (the test's): stopped 2 s into 5, the
    resumed run's first lr is about the last one's (it began again at the peak before), and it
    takes the time the checkpoint had left, ending with the final eval saved."""
    run = tmp_path / "run"
    monkeypatch.setattr(train, "Batches", signal_at(SIGUSR1, lambda step: clock[0] > 2))
    cfg = tiny(tmp_path, data_root, max_iters=10**6, eval_interval=10**6, max_time=5.0)
    stopped = train.train(cfg)
    spent = load_checkpoint(run / "ckpt.pt")["state"]["seconds"]
    assert stopped["stop_signal"] == SIGUSR1 and 2 < spent < 2.1
    monkeypatch.setattr(train, "Batches", Batches)
    resumed_at = clock[0]

    def slow(*args, generate=train.generate):  # a sample of 0.01 s a token
        for t in generate(*args):
            clock[0] += 0.01
            yield t

    monkeypatch.setattr(train, "generate", slow)
    result = train.train(replace(cfg, resume=True, sample_tokens=1000))
    # the time left, not 5 s more; the sample ends at it, within its last token
    assert clock[0] - resumed_at <= cfg.max_time - spent + 0.01
    step, state = result["step"], load_checkpoint(run / "ckpt.pt")["state"]
    assert stopped["step"] < step == state["step"] == state["evaluated"] < cfg.max_iters
    assert result["stop_signal"] == 0 and read(run, "val_loss") == {step: result["val_loss"]}
    out = capsys.readouterr().out
    assert f"stopped at step {step} by max_time" in out and len(out.split("more):\n")[1]) < 1000
    lrs = read(run, "lr")
    last, first = lrs[stopped["step"]], lrs[stopped["step"] + 1]
    assert last < 0.8 * cfg.lr and first == pytest.approx(last, rel=0.15)


@pytest.mark.slow
def test_ctrl_c_to_a_run_beside_a_busy_process_saves_exits_130_and_the_resume_changes_nothing(
    tmp_path, data_root
):
    """The same command gives the same weights. A busy process, niced (it takes what the run
    leaves idle), starts as the run trains: a count of idle cores would find one fewer than the
    run's two threads, which the resumed run keeps."""
    flags = (  # evals long enough for Ctrl-C to come before the end
        "--threads 2 --dropout 0.1 --dtype float32 --max-iters 6 --eval-interval 3 --eval-iters 20"
    ).split()
    assert train.main(tiny_args(tmp_path / "undisturbed", data_root, *flags)) == 0
    run, argv = tmp_path / "run", ["train.py", *tiny_args(tmp_path, data_root, *flags)]
    metrics = run / "metrics.jsonl"
    proc, busy = subprocess.Popen([sys.executable, *argv], **PIPE), []
    try:
        while not metrics.is_file() or "\n" not in metrics.read_text():  # the handlers are in
            assert proc.poll() is None
            time.sleep(0.02)
        busy.append(
            subprocess.Popen(
                [sys.executable, "-c", "while 1: pass"], preexec_fn=lambda: os.nice(19)
            )
        )
        proc.send_signal(SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and max(read(run, "loss")) == step_of(run) < 6
        assert f"stopped at step {step_of(run)} by SIGINT" in out and "Traceback" not in err
        resumed = script(*argv, "--resume")
    finally:
        for p in [proc, *busy]:
            p.kill()
    assert resumed.returncode == 0 and resumed.stdout.startswith("cpu, 2 threads")
    same_run(tmp_path / "undisturbed" / "run", run)


DDP = """\
import os, signal, sys, torch, train
from data.loader import Batches

if "RANK" not in os.environ:  # one process on each of two nodes, as torchrun starts them
    os.environ.update(RANK=sys.argv.pop(1), LOCAL_RANK="0")
rank, at = os.environ["RANK"], os.environ.get("SIGNAL_AT")


class Recorded(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print(f"buffers broadcast: {self.will_sync_module_buffers()}", flush=True)


def evaluate(model, *args, evaluate=train.evaluate):
    # in process 1, its weights leave the others' for the eval, by too little to change its loss
    bias = model.transformer.ln_f.bias
    kept = bias.detach().clone()
    if rank == "1":
        bias.data[0] += 1e-6
        if at == "eval":
            os.kill(os.getpid(), signal.SIGTERM)
    try:
        return evaluate(model, *args)
    finally:
        bias.data.copy_(kept)


class Signalled(Batches):
    def __call__(self, step):
        if rank == "1" and str(step) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().__call__(step)


torch.nn.parallel.DistributedDataParallel = Recorded
train.evaluate, train.Batches = evaluate, Signalled
code = train.main()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
os.write(1, f"threads left: {names}\\n".encode())  # one write: the processes share stdout
sys.exit(code)
"""


def processes(*commands, **env):
    """Python running each command at once in the repository, env added, with a free port for
    their group: their outputs, errors and exit statuses."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    env |= dict(PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PET_MASTER_PORT=port)
    env = os.environ | {k: str(v) for k, v in env.items()}
    procs = [subprocess.Popen([sys.executable, *map(str, c)], env=env, **PIPE) for c in commands]
    try:  # well before --ddp-timeout
        return tuple(zip(*[(*p.communicate(timeout=120), p.returncode) for p in procs]))
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
def test_ddp_is_one_process_and_sigterm_to_one_stops_both_and_the_run_resumes_bit_for_bit(
    tmp_path, data_root
):
    """8 rows of 32 tokens a step: 2 processes x 2 micro-batches of 2 rows (gloo; only the last
    micro-batch all-reduces), or 1 process x 4 micro-batches: the same rows, the same update, with
    Muon and AdamW. Under torchrun, on one node whose first process prepares the data as the other
    waits; then the same run on two "nodes" that each prepare their data, each status seen: SIGTERM
    to the second process stops both at once, at the first eval (step 3) and, resumed, between
    evals (step 4)."""
    ddp, cut = tmp_path / "ddp.py", tmp_path / "cut" / "run"
    ddp.write_text(DDP)
    same = (
        "--dtype float32 --threads 1 --batch-size 2 --optimizer muon --tokens-per-step 256"
        " --max-iters 6 --eval-interval 3 --ddp-timeout 300"
    ).split()
    args = tiny_args(tmp_path / "ddp", data_root, *same, "--data-root", tmp_path / "data")
    torchrun = "-m torch.distributed.run --nproc-per-node 2".split()
    [(out,), (err,), codes] = processes([*torchrun, ddp, *args])
    assert codes == (0,) and "2 x 2 processes x 2 rows" in out, err
    assert out.count("buffers broadcast: False") == 2
    assert err.count("warning: process 1's weights differ from process 0's") == 2  # each eval
    # gloo's threads left running into interpreter exit can abort a finished job (SIGABRT)
    left = re.findall(r"threads left: (\[.*?\])", out)
    assert len(left) == 2 and not any("gloo" in names for names in left)
    checkpoints = []
    for at, code, step in ("eval", 143, 3), ("4", 143, 5), ("-", 0, 6):
        more = [*same, *["--resume"][: at != "eval"], "--data-root"]
        nodes = [
            [ddp, r, *tiny_args(cut.parent, data_root, *more, tmp_path / f"d{r}")] for r in (0, 1)
        ]
        assert processes(*nodes, WORLD_SIZE=2, LOCAL_WORLD_SIZE=1, SIGNAL_AT=at)[2] == (code, code)
        checkpoints.append(load_checkpoint(cut / "ckpt.pt"))
        assert step_of(cut) == step
    same_run(tmp_path / "ddp" / "run", cut)
    assert train.train(parse_args(tiny_args(tmp_path / "one", data_root, *same)))["step"] == 6
    a, b = checkpoints[-1], load_checkpoint(tmp_path / "one" / "run" / "ckpt.pt")
    assert a["state"] == pytest.approx(b["state"] | {"seconds": a["state"]["seconds"]}, abs=1e-6)
    torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=1e-6)
    with pytest.raises(AssertionError):  # the tolerance is not vacuous: steps 3 to 6 moved more
        torch.testing.assert_close(checkpoints[0]["model"], b["model"], rtol=0, atol=1e-3)
    for key, n in ("loss", 6), ("val_loss", 2):
        one = read(tmp_path / "one" / "run", key)
        assert len(one) == n and read(cut, key) == pytest.approx(one, abs=1e-6)
