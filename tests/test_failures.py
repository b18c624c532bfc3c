"""What goes wrong around a run, tried as a user or an operator would: each failure is one
`error:` line and exit 2, nothing saved is lost, and nothing trains or samples on the wrong data."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import sample
import train
from configs import load_config
from configs.errors import UserError
from data.prepare import main as prepare_main
from data.prepare import prepare
from model.checkpoint import load_checkpoint
from training.run import lock_run_dir

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = (ROOT / "data/corpora/tinyshakespeare/input.txt").read_text()


def args(out_dir, data_root, *extra):
    return ["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--max-iters", "2",
            "--out-dir", str(out_dir), "--data-root", str(data_root), *extra]


def fails(capsys, main, argv) -> str:
    """Run an entry point that must refuse: exit 2 and exactly one `error:` line, returned."""
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


def prepare_text(root, name, text):
    (root / f"{name}.txt").write_text(text)
    return prepare(text=root / f"{name}.txt", tokenizer="char", name=name, out_root=root, verbose=False)


def test_data_prepared_again_is_refused_at_resume_init_from_and_sampling(tmp_path, capsys):
    root, run = tmp_path / "prepared", tmp_path / "run"
    root.mkdir()
    prepare_text(root, "mini", SHAKESPEARE[:3000])
    assert train.main(args(run, root, "--dataset", "mini", "--block-size", "8")) == 0
    new = prepare_text(root, "mini", SHAKESPEARE[:20000])  # six more characters: every id shifts
    line = fails(capsys, train.main, args(run, root, "--dataset", "mini", "--block-size", "8", "--resume"))
    assert "dataset mini was prepared again since it was saved (vocab_size 52 -> 58, chars +'DGJPqx'" in line
    line = fails(capsys, train.main, args(tmp_path / "ft", root, "--dataset", "mini", "--init-from", str(run)))
    assert "run/best.pt was trained with another vocabulary than dataset mini's (vocab_size 52 -> 58" in line
    (run / "manifest.json").write_bytes((new / "manifest.json").read_bytes())  # another run wrote it
    line = fails(capsys, sample.main, ["--ckpt", str(run), "--max-new-tokens", "3"])
    assert "manifest.json is not the data best.pt was trained on (vocab_size 52 -> 58" in line


def test_a_second_run_on_a_run_dir_in_use_is_refused(tmp_path, data_root, capsys):
    assert train.main(args(tmp_path, data_root)) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with lock_run_dir(tmp_path):  # as if the first run were still training
        line = fails(capsys, train.main, args(tmp_path, data_root, "--resume", "--max-iters", "4"))
    assert f"{tmp_path} is in use by another run (pid {os.getpid()})" in line
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_char_corpus_without_a_newline_trains_and_samples(tmp_path, capsys):
    root = tmp_path / "prepared"
    root.mkdir()
    prepare_text(root, "flat", SHAKESPEARE[:5000].replace("\n", " "))
    cfg = load_config("tiny", args(tmp_path / "run", root, "--dataset", "flat", "--sample-tokens", "16")[2:])
    result = train.train(cfg)  # the end-of-run sample used to start from "\n" and fail here
    assert len(result["sample"]) == 16
    assert sample.main(["--ckpt", str(tmp_path / "run"), "--prompt", "", "--max-new-tokens", "4"]) == 0
    assert "note: empty prompt: starting from ' '" in capsys.readouterr().err


def test_disk_full_while_saving_is_one_line_and_keeps_the_last_checkpoint(tmp_path, data_root, monkeypatch, capsys):
    real_save = torch.save

    def save(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("step") == 4:
            f.write(b"PK\x03\x04 half a zip")  # some bytes land, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    line = fails(capsys, train.main, args(tmp_path, data_root, "--max-iters", "6", "--eval-interval", "2"))
    assert f"could not write {tmp_path / 'ckpt.pt'} (No space left on device); its previous version" in line
    assert load_checkpoint(tmp_path)["step"] == 2
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("where, needle", [("file", "is a file, not a directory"),
                                           ("file/run", "cannot be written (Not a directory")])
def test_an_unusable_out_dir_is_one_line_before_training(tmp_path, data_root, capsys, where, needle):
    (tmp_path / "file").write_text("not a directory")
    assert needle in fails(capsys, train.main, args(tmp_path / where, data_root))


def test_resume_refuses_incomplete_or_unfitting_checkpoints(tmp_path, data_root, capsys):
    assert train.main(args(tmp_path, data_root)) == 0
    line = fails(capsys, train.main, args(tmp_path, data_root, "--resume", "--optimizer", "muon"))
    assert "its optimizer state does not fit this run" in line
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["model_config"]["n_embd"] = 32
    torch.save(ckpt, tmp_path / "ckpt.pt")
    line = fails(capsys, train.main, args(tmp_path, data_root, "--resume"))
    assert f"error: checkpoint {tmp_path / 'ckpt.pt'}: weights do not match its model_config" in line
    del ckpt["optimizer"]
    torch.save(ckpt, tmp_path / "ckpt.pt")
    line = fails(capsys, train.main, args(tmp_path, data_root, "--resume"))
    assert "its checkpoint has no optimizer" in line


@pytest.fixture
def two_processes(tmp_path, data_root, tmp_path_factory):
    """tiny training as 2 processes (gloo), started as torchrun would and in step; yields them
    and a function returning a process's output. --ddp-timeout 8: long enough for rank 0's
    first eval on a busy machine, short enough for a test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "train.py", *args(tmp_path, data_root, "--max-iters", "100000", "--eval-interval",
                                             "100000", "--dtype", "float32", "--ddp-timeout", "8")]
    logs_dir = tmp_path_factory.mktemp("logs")  # not the run dir: a fresh run refuses files it does not write
    logs = [open(logs_dir / f"rank{r}.log", "w+") for r in (0, 1)]
    ranks = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        deadline = time.time() + 120
        while not (tmp_path / "metrics.jsonl").is_file() or len((tmp_path / "metrics.jsonl").read_text()
                                                                  .splitlines()) < 3:
            assert time.time() < deadline and ranks[0].poll() is None, logs[0].name
            time.sleep(0.2)
        yield ranks, lambda r: (logs[r].seek(0), logs[r].read())[1]
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_ddp_a_stopped_process_ends_the_job_with_one_line(two_processes):
    ranks, output = two_processes
    os.kill(ranks[1].pid, signal.SIGSTOP)  # training, in step with rank 0, then stopped
    assert ranks[0].wait(timeout=120) == 2
    out = output(0)
    assert "Traceback" not in out
    line = out.splitlines()[-1]
    assert line.startswith("error: process 0 of 2: ") and "Timed out waiting 8000ms" in line  # gloo's words, quoted
    assert "another process died (see its output), hung or was stopped, or took longer than --ddp-timeout" in line


def test_ddp_a_killed_process_ends_the_job_with_one_line_not_an_abort(two_processes):
    ranks, output = two_processes
    ranks[1].kill()  # its connections close: rank 0 usually knows at once, without waiting out --ddp-timeout
    assert ranks[0].wait(timeout=120) == 2
    out = output(0)
    assert "Traceback" not in out and "terminate called" not in out
    line = out.splitlines()[-1]
    assert line.startswith("error: process 0 of 2: ") and "another process died" in line
    # One short line: torch's first sentence of the lost connection, or, as once under load, gloo's timeout (docs/gpu.md).
    assert len(line) < 400, line


def test_ddp_a_stop_signal_to_one_process_stops_both_at_the_same_step(two_processes, tmp_path):
    ranks, output = two_processes
    os.kill(ranks[1].pid, signal.SIGTERM)  # as a scheduler might signal one node of the job
    # both save-and-exit as one: a rank that stopped alone would leave the other in a collective
    assert [p.wait(timeout=120) for p in ranks] == [143, 143], output(0)[-2000:]
    step = load_checkpoint(tmp_path)["step"]
    assert f"stopped at step {step} (SIGTERM)" in output(0) and step == max(
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert "Traceback" not in output(0) + output(1)


@pytest.mark.parametrize("blown", [float("inf"), 1e30])  # 1e30: finite, and yet every loss is nan
def test_a_stop_after_the_weights_blew_up_keeps_the_last_good_checkpoint(tmp_path, data_root, monkeypatch, capsys,
                                                                        blown):
    step, forward_backward = train.optimizer_step, train.forward_backward
    calls = []

    def preempted(*a):  # the signal lands in step 3, whose loss is still finite...
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward_backward(*a)

    def blow_up(model, *a):  # ...and whose update blows the weights up
        norm = step(model, *a)
        if len(calls) == 3:
            with torch.no_grad():
                next(model.parameters()).fill_(blown)
        return norm

    monkeypatch.setattr(train, "forward_backward", preempted)
    monkeypatch.setattr(train, "optimizer_step", blow_up)
    line = fails(capsys, train.main, args(tmp_path, data_root, "--max-iters", "6", "--eval-interval", "2"))
    assert "the weights diverged at step 3 (loss nan on a val batch); stopped without saving, the last good " \
           f"checkpoint is {tmp_path / 'ckpt.pt'} (step 2)" in line
    assert load_checkpoint(tmp_path)["step"] == 2


def test_a_checkpoint_with_nan_weights_is_one_line_wherever_it_is_loaded(tmp_path, data_root, capsys):
    run = tmp_path / "run"
    assert train.main(args(run, data_root)) == 0
    for name in ("ckpt.pt", "best.pt"):
        ckpt = torch.load(run / name, weights_only=True)
        ckpt["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
        torch.save(ckpt, run / name)
    for main, argv in [(sample.main, ["--ckpt", str(run), "--max-new-tokens", "3"]),
                       (train.main, args(run, data_root, "--eval-only")),
                       (train.main, args(run, data_root, "--resume", "--max-iters", "4")),
                       (train.main, args(tmp_path / "ft", data_root, "--init-from", str(run)))]:
        assert "holds nan/inf weights (transformer.h.0.mlp.c_fc.weight, 1 tensors in all)" in fails(capsys, main, argv)


def test_a_fresh_run_over_a_trained_one_is_refused(tmp_path, data_root, capsys):
    assert train.main(args(tmp_path, data_root)) == 0
    (tmp_path / ".notes.v1.tmp").write_text("the user's, not a save's")
    for kept in ("ckpt.pt", "best.pt"):  # best.pt alone: ckpt.pt deleted to save disk
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        line = fails(capsys, train.main, args(tmp_path, data_root, "--max-iters", "1"))
        assert f"{tmp_path} holds a trained run; continue it with --resume, or start over in another --out-dir" in line
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
        (tmp_path / "ckpt.pt").unlink(missing_ok=True)


def test_a_run_dir_as_config_gives_its_settings_not_its_place(tmp_path, data_root, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert train.main(args(a, data_root)) == 0
    assert train.main(args(a, data_root, "--resume", "--max-iters", "3")) == 0  # its config.json: resume true
    before = (a / "ckpt.pt").read_bytes()
    assert train.main(["--config", str(a), "--out-dir", str(b), "--max-iters", "1"]) == 0  # not resumed from b
    assert load_checkpoint(b)["step"] == 1 and load_config(str(a)).out_dir == "out/tiny"
    assert (a / "ckpt.pt").read_bytes() == before


@pytest.mark.parametrize("link", [".lock", "metrics.jsonl"])
def test_links_in_the_out_dir_are_refused_not_followed(tmp_path, data_root, capsys, link):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").write_text("someone's file")
    (tmp_path / "run" / link).symlink_to(tmp_path / "elsewhere")
    line = fails(capsys, train.main, args(tmp_path / "run", data_root))
    assert f"holds symbolic links ({link}); a run writes only inside its out dir" in line
    assert (tmp_path / "elsewhere").read_text() == "someone's file"


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGHUP])
def test_a_schedulers_warning_and_a_closed_terminal_stop_and_save(tmp_path, data_root, monkeypatch, capsys, sig):
    forward_backward, calls = train.forward_backward, []

    def signalled(*a):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), sig)  # SLURM's --signal=USR1@60, or the terminal closing, during step 3
        return forward_backward(*a)

    monkeypatch.setattr(train, "forward_backward", signalled)
    assert train.main(args(tmp_path, data_root, "--max-iters", "6")) == 128 + sig
    assert load_checkpoint(tmp_path)["step"] == 3
    assert f"stopped at step 3 ({sig.name})" in capsys.readouterr().out


def test_eval_only_on_data_of_another_tokenizer_is_refused(tmp_path, data_root, capsys):
    root = tmp_path / "prepared"
    root.mkdir()
    prepare_text(root, "tilde", SHAKESPEARE.replace("$", "~"))  # 65 characters too, one of them another
    assert train.main(args(tmp_path / "run", data_root)) == 0
    line = fails(capsys, train.main, args(tmp_path / "run", root, "--dataset", "tilde", "--eval-only"))
    assert "was trained with another vocabulary than dataset tilde's" in line
    assert line.endswith("use data of its tokenizer (--dataset shakespeare_char)")


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**64)])
def test_seeds_torch_would_cut_to_32_bits_are_refused(tmp_path, data_root, capsys, seed):
    assert "expects a seed from 0 to 2**32 - 1" in fails(capsys, train.main, args(tmp_path, data_root, "--seed", seed))
    assert "expects a seed from 0 to 2**32 - 1" in fails(capsys, sample.main, ["--seed", seed])


def test_the_dataset_of_a_run_cannot_be_prepared_again_during_it(tmp_path, monkeypatch):
    root = tmp_path / "prepared"
    root.mkdir()
    prepare_text(root, "mini", SHAKESPEARE[:3000])
    forward_backward, refused = train.forward_backward, []

    def rebuilt_meanwhile(*a):  # as `python -m data.prepare --text ... --name mini --force` from another shell
        if not refused:
            with pytest.raises(UserError) as e:
                prepare(text=root / "mini.txt", tokenizer="char", name="mini", out_root=root, force=True)
            refused.append(str(e.value))
        return forward_backward(*a)

    monkeypatch.setattr(train, "forward_backward", rebuilt_meanwhile)
    assert train.main(args(tmp_path / "run", root, "--dataset", "mini", "--block-size", "8")) == 0
    assert refused == ["dataset mini is in use by a run; wait for it to finish, or prepare it under another name"]
    prepare(text=root / "mini.txt", tokenizer="char", name="mini", out_root=root, force=True, verbose=False)  # after it


def test_a_dataset_folder_no_one_can_write_still_trains(tmp_path, data_root, capsys):
    root = tmp_path / "prepared"
    root.mkdir()
    prepare_text(root, "mini", SHAKESPEARE[:3000])
    (root / ".mini.lock").mkdir()  # the lock file cannot be opened, as on a read-only mount (root ignores modes)
    assert train.main(args(tmp_path / "run", root, "--dataset", "mini", "--block-size", "8")) == 0
    assert "cannot write" in fails(capsys, prepare_main, ["--text", str(root / "mini.txt"), "--name", "mini",
                                                          "--tokenizer", "char", "--out-root", str(root), "--force"])


def test_a_vocab_size_below_the_tokenizers_names_the_flag_that_fixes_it(tmp_path, data_root, capsys):
    line = fails(capsys, train.main, args(tmp_path, data_root, "--vocab-size", "64"))
    assert "--vocab-size 64 is smaller than the vocabulary of dataset shakespeare_char (65); use --vocab-size 0 " \
           "(the tokenizer's) or >= 65" in line


def test_eval_only_of_another_run_states_the_attention_that_runs(tmp_path, data_root, capsys):
    assert train.main(args(tmp_path / "a", data_root)) == 0  # sdpa
    capsys.readouterr()
    assert train.main(args(tmp_path / "b", data_root, "--eval-only", "--init-from", str(tmp_path / "a"),
                           "--attention", "explicit")) == 0
    out = capsys.readouterr().out
    assert "explicit" not in out.splitlines()[0] and "attention=sdpa" in out  # the model's, not the flag's


def test_the_sample_hint_quotes_an_out_dir_with_spaces(tmp_path, data_root, capsys):
    assert train.main(args(tmp_path / "my run", data_root, "--sample-tokens", "4")) == 0
    assert f"python sample.py --out-dir '{tmp_path / 'my run'}' for more" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--dataset", "unprepared"], ["--init-from", "no/such/run"]])
def test_a_run_that_fails_before_training_leaves_no_run_dir(tmp_path, data_root, capsys, extra):
    (tmp_path / "prepared").mkdir()
    fails(capsys, train.main, args(tmp_path / "out" / "run", tmp_path / "prepared" if extra[1] == "unprepared"
                                   else data_root, *extra))
    assert not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()  # the user's: stays, though empty
    fails(capsys, train.main, args(tmp_path / "kept", tmp_path / "prepared", "--dataset", "unprepared"))
    assert [p.name for p in (tmp_path / "kept").iterdir()] == []


def test_resume_continues_with_the_runs_settings_unless_typed_again(tmp_path, data_root, capsys):
    root = tmp_path / "prepared"
    root.mkdir()
    prepare_text(root, "mini", SHAKESPEARE[:3000])
    run = tmp_path / "run"
    assert train.main(args(run, root, "--dataset", "mini", "--block-size", "8")) == 0
    assert train.main(args(run, root, "--resume", "--max-iters", "3", "--lr", "5e-4")) == 0  # dataset not typed
    assert train.main(args(run, root, "--resume", "--max-iters", "4")) == 0  # lr not typed: stays 5e-4
    saved = load_checkpoint(run)["train_config"]
    assert (saved["dataset"], saved["block_size"], saved["lr"], saved["max_iters"]) == ("mini", 8, 5e-4, 4)
    assert train.main(args(run, root, "--resume", "--max-iters", "5", "--lr", "1e-3")) == 0  # typed: wins
    assert load_checkpoint(run)["train_config"]["lr"] == 1e-3


def test_resuming_a_finished_run_adds_no_eval(tmp_path, data_root, capsys):
    assert train.main(args(tmp_path, data_root)) == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    assert train.main(args(tmp_path, data_root, "--resume")) == 0
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert "final: train loss" in capsys.readouterr().out


def test_ddp_an_error_preparing_the_data_is_one_line_from_rank_0(tmp_path):
    (tmp_path / "prepared").mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *args(tmp_path / "run", tmp_path / "prepared", "--dataset", "unprepared")]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    out = done.stdout + done.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert done.returncode != 0 and len(errors) == 1 and "dataset 'unprepared' is neither a preset" in errors[0], out
    assert "Connection closed" not in out and not (tmp_path / "run").exists()


def test_deterministic_on_an_op_without_a_deterministic_kernel_is_one_line(tmp_path, data_root, monkeypatch, capsys):
    def cuda_only(*a):  # what torch raises on a GPU for such an op under use_deterministic_algorithms(True)
        raise RuntimeError("adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but you "
                           "set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism ...")

    monkeypatch.setattr(train, "forward_backward", cuda_only)
    line = fails(capsys, train.main, args(tmp_path, data_root, "--deterministic"))
    assert "--deterministic: an op this run needs has no deterministic kernel on cpu; drop --deterministic" in line
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        train.main(args(tmp_path / "plain", data_root))  # not under --deterministic: torch's own error, traceback kept


@pytest.mark.parametrize("option", ["--n-embd", "--n-head", "--threads", "--tokens-per-step"])
def test_integers_torch_cannot_hold_are_one_line(tmp_path, data_root, capsys, option):
    assert f"{option}: expects an integer below 2**31, got '1e30'" in fails(capsys, train.main, args(
        tmp_path, data_root, option, "1e30"))


def test_more_bad_input_found_by_trying_it(tmp_path, data_root, capsys):
    from model.__main__ import main as model_main

    assert "--batch-size: expects an integer >= 1, got '0'" in fails(capsys, model_main, ["--batch-size", "0"])
    assert "--threads: expects an integer below 2**31" in fails(capsys, sample.main, ["--threads", str(2**70)])
    (tmp_path / "afile").write_text("")  # not a .toml: read as no fields, it trained small's defaults
    assert "expected a .toml file, a run's config.json" in fails(capsys, train.main, ["--config", str(tmp_path / "afile")])
    line = fails(capsys, train.main, args(tmp_path / "none", data_root, "--resume"))
    assert f"--resume: no checkpoint at {tmp_path / 'none' / 'ckpt.pt'}; drop --resume to start this run" in line
    assert train.main(args(tmp_path / "run", data_root, "--block-size", "16")) == 0
    line = fails(capsys, train.main, args(tmp_path / "ev", data_root, "--eval-only", "--init-from", str(tmp_path / "run")))
    assert "block_size 32 exceeds the context of" in line and "pass --block-size 16 or less" in line
    assert fails(capsys, train.main, args(tmp_path, data_root, "--lr", "0")).endswith(
        "--min-lr (0.0001) must not exceed --lr (0.0); lower --min-lr")


def test_bad_input_of_the_second_pass_is_one_line_and_changes_nothing(tmp_path, data_root, capsys, monkeypatch):
    from model.__main__ import main as model_main

    ds = data_root / "shakespeare_char"
    before = {p.name: p.read_bytes() for p in ds.iterdir()}
    assert "holds a prepared dataset; pick another --out-dir" in fails(capsys, train.main, args(ds, data_root))
    assert {p.name: p.read_bytes() for p in ds.iterdir()} == before  # no lock, no run files among the tokens
    # A billion threads ended in OpenMP's out-of-memory abort. The check counts the CPUs this process may use.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2, whatever this machine has
    assert "--threads 3: this process may use 2 cores; use at most 2" in fails(
        capsys, train.main, args(tmp_path / "t", data_root, "--threads", "3"))
    assert not (tmp_path / "t").exists()
    (tmp_path / "list.toml").write_text('base = "tiny"\nout_dir = ["x"]\n')  # it trained into a folder "['x']"
    assert fails(capsys, train.main, ["--config", str(tmp_path / "list.toml")]).endswith("out_dir expects text, got ['x']")
    assert "--seq-len 33 is longer than the config's block_size 32" in fails(
        capsys, model_main, ["--config", "tiny", "--seq-len", "33"])
    (tmp_path / "huge.toml").write_text('base = "tiny"\nvocab_size = 2000000000\nblock_size = 100000\n')
    assert model_main(["--config", str(tmp_path / "huge.toml"), "--blocks", "0"]) == 0  # on meta: no 128 GB
    assert "would hold more than 2**63 bytes" in fails(
        capsys, model_main, ["--config", str(tmp_path / "huge.toml"), "--batch-size", "1000000"])


def test_bad_input_of_the_third_pass_is_one_line(tmp_path, data_root, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --name '..' wrote the run into the working directory, '' into out/ itself
    for name in ("..", "", "a/b"):
        assert "a run's name is one folder name under out/" in fails(capsys, train.main, [
            "--config", "tiny", "--name", name, "--data-root", str(data_root), "--max-iters", "2"])
    assert not list(tmp_path.iterdir())
    for flag in (["--init-from", "gpt2"], ["--eval-only"]):  # each was silently dropped
        assert f"--resume continues this run's training, which {flag[0]} does not" in fails(
            capsys, train.main, args(tmp_path / "r", data_root, "--resume", *flag))
    assert "--warmup-iters 100 is longer than the run (--max-iters 2)" in fails(
        capsys, train.main, args(tmp_path / "w", data_root, "--warmup-iters", "100"))  # it trained at lr ~0
    assert train.main(args(tmp_path / "run", data_root, "--eval-interval", "1")) == 0
    assert f"{tmp_path / 'run'} has no train.bin: a run's or an exported model's folder" in fails(
        capsys, train.main, args(tmp_path / "x", tmp_path, "--dataset", "run"))  # it said to run data.prepare
    (tmp_path / "b.toml").write_text(f'base = "{tmp_path / "run"}"\n')
    assert f"base takes a preset (finetune_gpt2, gpt2, shakespeare_gpu, small, tiny), not a path; to start from a " \
           f"run's settings use --config {tmp_path / 'run'}" in fails(capsys, train.main, ["--config", str(tmp_path / "b.toml")])
    for field, line in [("muon_lr = 0.5", "--muon-lr does nothing without --optimizer muon"),
                        ("warmup_iters = 50", "--warmup-iters 50 is longer than the run")]:  # as flags: refused
        (tmp_path / "t.toml").write_text(f'base = "tiny"\n{field}\n')
        assert fails(capsys, train.main, ["--config", str(tmp_path / "t.toml")]).startswith(
            f"error: {tmp_path / 't.toml'}: {line}")
    cfg = load_config(str(tmp_path / "run"), ["--resume", "--max-iters", "4"])  # it resumed out/tiny instead
    assert cfg.run_dir == tmp_path / "run" and cfg.resume


def test_a_run_stopped_in_its_first_eval_names_no_best_pt(tmp_path, data_root, monkeypatch, capsys):
    evaluate = train.evaluate

    def preempted(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*a)

    monkeypatch.setattr(train, "evaluate", preempted)
    assert train.main(args(tmp_path, data_root)) == 143
    assert not (tmp_path / "best.pt").exists() and "best.pt" not in capsys.readouterr().out


def test_messages_that_named_the_wrong_cause(tmp_path, data_root, monkeypatch, capsys):
    from data.files import atomic_write

    (tmp_path / "folder").mkdir()
    line = fails(capsys, prepare_main, ["--files", str(tmp_path / "folder"), "--out-root", str(tmp_path)])
    assert f"{tmp_path / 'folder'} is a folder; give --text a folder, --files its files" in line
    assert "pass --n-head as one of [1, 2, 4, 8, 16] or another --n-embd" in fails(
        capsys, train.main, args(tmp_path, data_root, "--n-head", "3"))

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("builtins.open", read_only)
    with pytest.raises(UserError) as e:
        atomic_write(tmp_path / "x.json", lambda f: None)
    assert str(e.value).endswith("(Read-only file system); its previous version, if any, is kept; pick another "
                                 "output folder")


def test_empty_values_and_hub_only_options_are_refused_not_ignored(tmp_path, data_root, capsys):
    for option in ("--config", "--init-from", "--prompt-file"):
        assert "names nothing" in fails(capsys, sample.main, [option, "", "--max-new-tokens", "1"])
    assert "--data-root and --dataset must not be empty" in fails(capsys, train.main, args(tmp_path, ""))
    (tmp_path / "a.txt").write_text(SHAKESPEARE[:3000])
    line = fails(capsys, prepare_main, ["--text", str(tmp_path / "a.txt"), "--subset", "x", "--split", "test",
                                        "--out-root", str(tmp_path)])
    assert line == "error: --subset, --split: for --hf datasets only; drop them"
    for source in (["--text", str(tmp_path / "a.txt")], ["--files", str(tmp_path / "a.txt")]):  # each was ignored
        line = fails(capsys, prepare_main, [*source, "--text-column", "body", "--out-root", str(tmp_path)])
        assert line.startswith("error: --text-column: ") and line.endswith("; drop it")
    assert not list(tmp_path.glob("a*/"))


TINY = ("--max-iters", "3", "--eval-interval", "2", "--eval-iters", "1")


def test_a_failed_resume_keeps_the_runs_settings(tmp_path, data_root, capsys):
    assert train.main(args(tmp_path, data_root, *TINY)) == 0
    before = (tmp_path / "config.json").read_bytes()
    line = fails(capsys, train.main, args(tmp_path, data_root, *TINY, "--resume", "--max-iters", "6", "--lr", "1e30"))
    assert "loss became nan" in line and "stopped without saving" in line
    assert (tmp_path / "config.json").read_bytes() == before  # a plain --resume would read lr 1e30 back
    assert train.main(args(tmp_path, data_root, *TINY, "--resume", "--max-iters", "4")) == 0
    assert json.loads((tmp_path / "config.json").read_text())["max_iters"] == 4  # saved with its checkpoint


def test_a_fresh_run_refuses_a_folder_of_something_else(tmp_path, data_root, capsys):
    export = tmp_path / "export"  # what `python -m model.hf export` writes
    export.mkdir()
    for name in ("model.safetensors", "config.json", "manifest.json", "tokenizer.json", "tokenizer_config.json"):
        (export / name).write_text(f"the export's {name}")
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    line = fails(capsys, train.main, args(export, data_root, *TINY))
    assert line == (f"error: --out-dir {export} holds files no run of this project wrote (model.safetensors, "
                    "tokenizer.json, tokenizer_config.json, ...); pick another --out-dir")
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before  # no .lock either
    mine = tmp_path / "mine"  # the user's own files, named as a run's are: only a run's .lock makes them a run's
    mine.mkdir()
    for name in ("config.json", "metrics.jsonl", "loss.png"):
        (mine / name).write_text(f"my {name}")
    line = fails(capsys, train.main, args(mine, data_root, *TINY))
    assert line == (f"error: --out-dir {mine} holds files no run of this project wrote (config.json, loss.png, "
                    "metrics.jsonl); pick another --out-dir")
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "loss.png", "metrics.jsonl"]
    assert (mine / "config.json").read_text() == "my config.json"
    ours = tmp_path / "ours"  # an earlier run of ours that failed before saving: trains over it
    ours.mkdir()
    for name in ("config.json", "manifest.json", "metrics.jsonl", "loss.png", ".lock", ".ckpt.pt.123.tmp", ".DS_Store",
                 "train.log"):
        (ours / name).write_text("")
    (ours / "wandb").mkdir()
    assert train.main(args(ours, data_root, *TINY)) == 0


def test_a_split_shorter_than_a_block_is_refused_before_the_run_dir_gets_a_file(tmp_path, capsys):
    root = tmp_path / "prepared"
    root.mkdir()
    prepare_text(root, "mini", SHAKESPEARE[:5000])  # 500 val tokens
    line = fails(capsys, train.main, args(tmp_path / "run", root, *TINY, "--dataset", "mini", "--block-size", "1000"))
    assert sorted(p.name for p in (tmp_path / "run").glob("*")) == []  # it left config.json, loss.png, metrics.jsonl
    assert line == "error: val split of mini is shorter than one block (1001 tokens); lower --block-size"
    assert not (tmp_path / "run").exists()


def test_resume_after_the_dataset_was_rebuilt_from_other_text_is_refused(tmp_path, capsys):
    root, run = tmp_path / "prepared", tmp_path / "run"
    root.mkdir()
    prepare_text(root, "mini", SHAKESPEARE[:3000])
    assert train.main(args(run, root, "--dataset", "mini", "--block-size", "8")) == 0
    prepare_text(root, "mini", SHAKESPEARE[:3000][::-1])  # the same characters and length, other text
    line = fails(capsys, train.main, args(run, root, "--dataset", "mini", "--block-size", "8", "--resume",
                                          "--max-iters", "4"))
    assert f"cannot resume {run}: dataset mini was rebuilt from other text since this run started; use --init-from" in line
