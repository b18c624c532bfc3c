"""What a command meets around its arguments: pipes, closed streams, an encoding that cannot show the
text, stray torchrun variables, wandb that cannot start or write, a folder that is not a run, and a
config sized for another device. Each is handled in one place: configs.errors.StandardStream (the
streams), training.runtime.torchrun_environment, RunLog.start_wandb, lock_run_dir, say_if_long."""

import contextlib
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import sample
import train
from configs import load_config
from data.prepare import main as prepare_main
from model.checkpoint import load_checkpoint
from model.gpt import GPT
from training.run import say_if_long

ROOT = Path(__file__).resolve().parent.parent
TRACEBACK = "Traceback (most recent call last)"


def tiny_args(out_dir, data_root, *extra):
    return ["--config", "tiny", "--device", "cpu", "--max-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
            "--sample-tokens", "0", "--out-dir", str(out_dir), "--data-root", str(data_root), *extra]


def script(*argv, stdout=subprocess.PIPE, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE,
                          timeout=180, **kwargs)


def shell(command: str, **kwargs) -> subprocess.CompletedProcess:
    """A bash command line in the project folder: its redirections (2>&-, <&-) are the test."""
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, timeout=180, **kwargs)


def one_error(capsys, main, argv) -> str:
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_root) -> Path:
    run = tmp_path_factory.mktemp("run")
    assert train.main(tiny_args(run, data_root)) == 0
    return run


# Pipes and closed streams


def test_a_reader_that_leaves_stops_a_training_run_which_saves_first(tmp_path, data_root):
    """`train.py | head -1`: the eval lines after the reader left raise SIGPIPE, which stops the run
    as a stop signal does (a step, a save), exit 141, no traceback. Was: BrokenPipeError, nothing saved."""
    cmd = [sys.executable, "train.py", *tiny_args(tmp_path, data_root, "--max-iters", "5000", "--eval-interval", "5")]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout.readline().startswith(b"cpu")  # the first line, as `| head -1` reads it
        proc.stdout.close()
        err = proc.stderr.read().decode()
    assert proc.returncode == 141, err
    assert TRACEBACK not in err and "SIGPIPE: finishing this step" in err
    assert 0 < load_checkpoint(tmp_path)["step"] < 5000


@pytest.mark.parametrize("command", [["-m", "data.prepare", "shakespeare_char", "--out-root", "{data_root}"],
                                     ["sample.py", "--out-dir", "{trained}", "--max-new-tokens", "3000"]])
def test_output_into_a_pipe_nobody_reads_ends_quietly_with_141(command, data_root, trained):
    """The pipe's reader is gone before the command writes (as after `| true`): each ends with the status
    a shell gives a command stopped by SIGPIPE, and says nothing. Was: a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    done = script(*(a.format(data_root=data_root, trained=trained) for a in command), stdout=write)
    os.close(write)
    assert done.returncode == 141, done.stderr.decode()
    assert TRACEBACK not in done.stderr.decode()


def test_a_closed_stderr_or_stdout_does_not_stop_a_run(tmp_path, data_root, trained):
    """2>&- left tqdm writing to None (exit 1, no checkpoint); >&- and <&- broke sample.py."""
    args = " ".join(tiny_args(tmp_path, data_root, "--sample-tokens", "8"))
    done = shell(f"{sys.executable} train.py {args} 2>&-")
    assert done.returncode == 0 and load_checkpoint(tmp_path)["step"] == 2
    assert b"checkpoint" in done.stdout
    sampling = f"{sys.executable} sample.py --out-dir {trained} --max-new-tokens 4"
    assert shell(f"{sampling} --prompt ROMEO >&-").returncode == 0
    done = shell(f"{sampling} --prompt - <&-")  # a closed stdin reads as empty: the empty prompt
    assert done.returncode == 0 and b"empty prompt" in done.stderr


def test_text_the_terminal_cannot_encode_is_escaped_not_a_traceback(tmp_path):
    """A non-ASCII corpus under PYTHONIOENCODING=ascii: the end-of-run sample and sample.py used to end a
    good run with UnicodeEncodeError (exit 1)."""
    (tmp_path / "poems.txt").write_text("é à ü ñ ☃ " * 400, encoding="utf-8")
    assert prepare_main(["--text", str(tmp_path / "poems.txt"), "--tokenizer", "char", "--out-root",
                         str(tmp_path / "data"), "--quiet"]) == 0
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = script("train.py", *tiny_args(tmp_path / "run", tmp_path / "data", "--dataset", "poems_char",
                                         "--sample-tokens", "40"), env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert b"\\u2603" in done.stdout or b"\\x" in done.stdout  # the sample, escaped
    done = script("sample.py", "--out-dir", tmp_path / "run", "--prompt", "é", "--max-new-tokens", "20", env=env)
    assert done.returncode == 0 and done.stdout.startswith(b"\\xe9"), done.stderr.decode()


# Stray torchrun variables, and an error under DDP


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2"}, {"RANK": "1"},
                                 {"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
                                  "MASTER_PORT": "29500"}])
def test_torchrun_variables_without_torchrun_are_one_line(env, tmp_path, data_root, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = one_error(capsys, train.main, tiny_args(tmp_path, data_root))
    assert all(f"{name}={value}" in line for name, value in env.items()) and "not a whole torchrun set" in line
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    for name in env:  # the advice: unset them
        monkeypatch.delenv(name)
    assert train.main(tiny_args(tmp_path, data_root)) == 0


def test_a_mistake_every_process_finds_is_printed_once(tmp_path, data_root):
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent),
           "TMPDIR": os.environ["TMPDIR"]}  # conftest's: torchrun leaves a folder there
    done = script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                  *tiny_args(tmp_path, data_root, "--tokens-per-step", "1000"), env=env)
    errors = [line for line in done.stderr.decode().splitlines() if line.startswith("error: ")]
    assert done.stdout.count(b"up to date") == 1  # the dataset's line too: rank 0's
    assert errors == ["error: --tokens-per-step 1000 is not a multiple of batch_size x block_size x processes = 256; "
                      "pick a multiple (or 0 for one micro-batch per step)"]


# wandb


@pytest.mark.parametrize("mode, needle", [("online", "No API key"), ("ofline", "mode='ofline'")])
def test_wandb_that_cannot_start_is_one_line_before_any_file(mode, needle, tmp_path, data_root):
    """Was: a UsageError or pydantic ValidationError traceback, and a half-made run folder. A process
    each: wandb keeps its settings for the life of a process."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"} | {"HOME": str(tmp_path / "home")}  # no key
    done = script("train.py", *tiny_args(tmp_path / "run", data_root, "--wandb"), env=env | {"WANDB_MODE": mode})
    err = done.stderr.decode()
    assert done.returncode == 2 and TRACEBACK not in err, err
    line = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line[0].startswith("error: --wandb: wandb did not start (") and needle in line[0]
    assert "WANDB_MODE=offline" in line[0] and not (tmp_path / "run").exists()
    if mode == "online":  # the advice
        done = script("train.py", *tiny_args(tmp_path / "run", data_root, "--wandb"), env=env | {"WANDB_MODE": "offline"})
        assert done.returncode == 0, done.stderr.decode()


def test_wandb_that_fails_mid_run_is_a_note_and_the_run_goes_on(tmp_path, data_root, capsys, monkeypatch):
    """Its staging files unwritable (a read-only HOME) raised PermissionError at the first eval."""
    class Failing:
        id, starting_step, settings, summary = "abc", 0, types.SimpleNamespace(mode="online"), {}

        def log(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", "/home/me/.cache/wandb/artifacts/staging")

        finish = log

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Failing(), Table=dict,
                                                                    login=lambda **kw: True))
    assert train.main(tiny_args(tmp_path, data_root, "--wandb", "--max-iters", "4")) == 0
    err = capsys.readouterr().err
    assert err.count("note: wandb failed ([Errno 13] Permission denied") == 1 and "goes on without it" in err
    assert load_checkpoint(tmp_path)["step"] == 4


# Messages that say what is so


def test_a_config_through_a_pipe_says_what_to_do_and_that_works(tmp_path, data_root):
    toml = 'base = "tiny"\nmax_iters = 2\n'
    done = shell(f"{sys.executable} train.py --config <(printf '{toml}') --out-dir {tmp_path}/run")
    assert done.returncode == 2
    assert done.stderr.decode().startswith("error: --config /dev/fd/") and b"save the settings to a .toml" in done.stderr
    (tmp_path / "mine.toml").write_text(toml)  # the advice
    assert train.main(["--config", str(tmp_path / "mine.toml"), *tiny_args(tmp_path / "run", data_root)[2:]]) == 0


def test_a_missing_run_names_a_training_command_that_makes_it(tmp_path, data_root, capsys, monkeypatch):
    """out/mine is no preset: the hint was `python train.py --config mine`, itself an error."""
    monkeypatch.chdir(tmp_path)
    line = one_error(capsys, sample.main, ["--out-dir", "out/mine"])
    assert line.endswith("train one first: `python train.py --config small --out-dir out/mine`")
    shrink = ["--n-layer", "1", "--n-head", "1", "--n-embd", "16", "--max-iters", "2", "--eval-iters", "1",
              "--sample-tokens", "0", "--device", "cpu", "--data-root", str(data_root)]
    assert train.main(["--config", "small", "--out-dir", "out/mine", *shrink]) == 0  # the advice, shrunk
    assert sample.main(["--out-dir", "out/mine", "--max-new-tokens", "4", "--device", "cpu"]) == 0


def test_a_run_dirs_config_needs_a_new_out_dir_as_readme_says(trained, tmp_path, data_root, capsys):
    """README: `--config out/small` starts from that run's settings; give it a new --out-dir."""
    line = one_error(capsys, train.main, ["--config", str(trained), "--out-dir", str(trained)])
    assert "holds a trained run" in line and "--out-dir" in line
    assert train.main(["--config", str(trained), "--out-dir", str(tmp_path / "again"), "--data-root",
                       str(data_root)]) == 0
    readme = (ROOT / "README.md").read_text()
    assert "--config out/small --out-dir" in readme


# A config sized for another device


def test_a_run_that_would_take_hours_here_says_so_and_is_unchanged(capsys):
    cfg = load_config("tiny", ["--device", "cpu", "--max-iters", "100000000", "--dropout", "0.1"])
    model = GPT(cfg.model_config(vocab_size=65))
    run = types.SimpleNamespace(cfg=cfg, step=0, model=model, grad_accum=1,
                                manifest={"val_tokens": 10_000}, rt=types.SimpleNamespace(device="cpu",
                                                                                          autocast=contextlib.nullcontext))
    rng = torch.get_rng_state()
    say_if_long(run)
    note = capsys.readouterr().err
    assert note.startswith("note: this run would take about ") and "on a CPU use --config small" in note
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    run.cfg = load_config("tiny", ["--device", "cpu"])
    say_if_long(run)
    assert capsys.readouterr().err == ""


# A fresh pass of cases (docs/reliability.md's table): the ones that were wrong


def test_a_signal_the_run_was_started_ignoring_stays_ignored(monkeypatch):
    """nohup ignores SIGHUP, a shell's background job SIGINT: a run must not take them back.
    Python itself ignores SIGPIPE, so that one is handled anyway."""
    from training.budget import StopSignal

    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_IGN)  # every signal ignored, as inherited
    seen = {}
    monkeypatch.setattr(signal, "signal", lambda s, handler: seen.setdefault(s, handler))
    with StopSignal(escalate=True):
        pass
    assert set(seen) == {signal.SIGPIPE}


def test_environment_folders_that_are_files_are_one_line(tmp_path, data_root, capsys, monkeypatch):
    (tmp_path / "afile").write_text("")
    for name in ("TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "WANDB_DIR"):  # each was a traceback deep in its library
        monkeypatch.setenv(name, str(tmp_path / "afile"))
        line = one_error(capsys, train.main, tiny_args(tmp_path / "run", data_root))
        assert line == f"error: {name}={tmp_path / 'afile'}: a file where a folder is expected; point it at a folder or unset it"
        monkeypatch.delenv(name)
    assert not (tmp_path / "run").exists()


def test_a_deleted_working_folder_is_one_line(tmp_path):
    """torch's import failed there with `Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so`."""
    done = shell(f"mkdir {tmp_path}/gone && cd {tmp_path}/gone && rmdir {tmp_path}/gone && {sys.executable} "
                 f"{ROOT}/train.py --config tiny")
    assert (done.returncode, done.stderr) == (2, b"error: the current folder was deleted; cd to one that exists and "
                                                 b"run it again\n")


def test_a_path_that_is_not_utf8_prints_as_its_own_bytes(tmp_path, data_root):
    """A folder name of bytes that are not text used to print as Python's stand-ins (`\\udcff`), a path
    that does not exist; the run's last lines name it byte for byte."""
    out = os.fsencode(tmp_path) + b"/bad\xffname"
    done = subprocess.run([sys.executable, b"train.py", *map(os.fsencode, tiny_args("x", data_root)[:-4]), b"--out-dir",
                           out, b"--data-root", os.fsencode(data_root)], cwd=ROOT, capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"checkpoint " + out + b"/ckpt.pt" in done.stdout


def test_a_training_module_elsewhere_on_the_path_does_not_replace_the_package(tmp_path):
    (tmp_path / "training.py").write_text("raise SystemExit('a stranger training.py was imported')\n")
    done = script("train.py", "--config", "tiny", "--help", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr.decode()


def test_loss_png_that_cannot_be_drawn_is_a_note_not_the_end_of_the_run(tmp_path, data_root, capsys, monkeypatch):
    """MPLBACKEND=nonsense, or a folder name its fonts cannot show, ended a run at step 0 with a traceback."""
    from training.runlog import RunLog

    def bad_backend(self):
        raise ValueError("Key backend: 'nonsense' is not a valid value for backend")

    monkeypatch.setattr(RunLog, "_plot", bad_backend)
    assert train.main(tiny_args(tmp_path, data_root)) == 0
    out, err = capsys.readouterr()
    assert "note: loss.png not drawn: matplotlib failed (Key backend: 'nonsense'" in err and "MPLBACKEND" in err
    assert load_checkpoint(tmp_path)["step"] == 2 and "loss curve" not in out  # no loss.png to point to


def test_paths_too_long_or_with_an_unexpanded_tilde_are_one_line(tmp_path, data_root, capsys):
    line = one_error(capsys, train.main, tiny_args(tmp_path / ("d" * 256), data_root))
    assert "File name too long" in line and line.endswith("pick another --out-dir")
    line = one_error(capsys, train.main, tiny_args("~/x", data_root))  # quoted: no shell expanded it
    assert line.startswith("error: --out-dir ~/x: the shell left ~ as it is (quoted?)")
    line = one_error(capsys, prepare_main, ["--text", str(ROOT / "README.md"), "--tokenizer", "char", "--name",
                                            "n" * 250, "--out-root", str(tmp_path / "data")])
    assert line.endswith("is too long for this file system; give a shorter --name")


def test_sample_says_what_it_cannot_do_with_the_text_it_is_given(trained, capsys):
    line = one_error(capsys, sample.main, ["--out-dir", str(trained), "--stop", "é☃", "--max-new-tokens", "4"])
    assert line.startswith("error: --stop 'é☃' can never match: text has 2 character(s) not in this char vocabulary")
    assert sample.unescape("Hi \udcff there") == "Hi \ufffd there"  # a byte that is not UTF-8, as the model sees it


def test_the_sample_hint_for_a_run_dir_that_reads_as_a_flag_works(tmp_path, data_root, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train.main([*tiny_args("unused", data_root, "--sample-tokens", "4"), "--out-dir=-x"]) == 0
    assert "(python sample.py --out-dir ./-x for more)" in capsys.readouterr().out  # was `--out-dir -x`: a flag
    assert sample.main(["--out-dir", "./-x", "--max-new-tokens", "4", "--device", "cpu"]) == 0


def test_wandb_takes_its_project_and_folder_from_the_environment_unless_typed(tmp_path, data_root, monkeypatch):
    kwargs = {}

    class Run:
        id, starting_step, settings = "abc", 0, types.SimpleNamespace(mode="online")
        log = finish = staticmethod(lambda *a, **k: None)
        summary: dict = {}

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: kwargs.update(kw) or Run(),
                                                                    Table=dict, login=lambda **kw: True))
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "w"))
    assert train.main(tiny_args(tmp_path / "a", data_root, "--wandb")) == 0
    assert kwargs["project"] == "mine" and kwargs["dir"] is None  # wandb reads WANDB_DIR itself
    monkeypatch.delenv("WANDB_DIR")
    assert train.main(tiny_args(tmp_path / "b", data_root, "--wandb", "--wandb-project", "typed")) == 0
    assert kwargs["project"] == "typed" and kwargs["dir"] == str(tmp_path / "b")
