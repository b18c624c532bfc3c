"""Shared test set-up: a prepared dataset, tiny runs, scripts run as users run them, a fake hub."""

import contextlib
import io
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """The signal tests press Ctrl-C as a user at a terminal does. A suite started in the background
    (`&` ignores SIGINT, nohup SIGHUP) would pass that on to the scripts, which rightly keep it, so
    the tests get the defaults back."""
    for sig, default in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGHUP, signal.SIG_DFL),
    ):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, default)


def pytest_xdist_auto_num_workers(config) -> int | None:
    """pytest.ini's `-n auto`: a process per two usable cores, since many tests start scripts or DDP
    processes of their own; under 4 cores, one test at a time. PYTEST_XDIST_AUTO_NUM_WORKERS, or
    `-n N`, wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    workers = len(os.sched_getaffinity(0)) // 2
    return workers if workers >= 2 else 0


@pytest.fixture(autouse=True, scope="session")
def other_cpu_row():
    """CI's second pass runs the suite as the other kind of CPU would: CPU_BF16=0 or 1 stands in for
    what /proc/cpuinfo says, for the runs the tests start in this process."""
    value = os.environ.get("CPU_BF16")
    with pytest.MonkeyPatch.context() as mp:
        if value is not None:
            mp.setattr("configs.cpu_has_bf16", lambda: value == "1")
        yield


@pytest.fixture(autouse=True, scope="session")
def temp_files_stay_in_pytests_folder(tmp_path_factory):
    """torchrun keeps a log folder in the temp folder: the scripts the tests start put theirs under
    pytest's own temp folder, which pytest prunes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
        yield


@pytest.fixture(autouse=True)
def cuda_only_where_marked(request, monkeypatch):
    """Tests assert what a CPU does: on a GPU machine, CUDA is hidden from all but those marked
    cuda (`pytest -m cuda`), in this process and in the scripts they start."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Tiny models gain nothing from more threads, and on a busy 2-core machine OpenMP's spinning
    threads make them many times slower; a run in this process takes one too, without the 0.2 s
    that counting the idle cores takes. A run takes as many threads as that finds idle cores, or as
    --threads says: not what the user's shell exports (OMP_NUM_THREADS)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr("training.runtime.idle_cores", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """train.py's clock made the test's: it moves only by the tokens each forward pass reads (twice
    with gradients), so that a --max-time run takes the same steps on a busy machine as on an idle
    one. clock[0] is the time."""
    import train
    from model.gpt import GPT

    now, forward = [0.0], GPT.forward

    def timed(self, idx, *args, **kwargs):
        now[0] += idx.numel() * 1e-4 * (1 + torch.is_grad_enabled())
        return forward(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", timed)
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: now[0]))
    return now


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """shakespeare_char, prepared once for the session."""
    from data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    prepare("shakespeare_char", root=str(root), quiet=True)
    return root


def rows(text: str, sep: str = " | ") -> list[list[str]]:
    """A table written as text, a row a line (blank lines skipped): each row's columns, split at
    sep. Tests parametrize on it."""
    return [line.split(sep) for line in text.splitlines() if line]


def tiny(tmp_path, data_root, **fields):
    """The tiny preset as a test trains it: on the CPU, in tmp_path/run, without the last sample."""
    from configs import load_config

    cfg = replace(
        load_config("tiny"),
        device="cpu",
        data_root=str(data_root),
        sample_tokens=0,
        out_dir=str(tmp_path / "run"),
    )
    return replace(cfg, **fields)


def tiny_args(tmp_path, data_root, *extra) -> list[str]:
    """train.py's flags for the same tiny run."""
    run = tmp_path / "run"
    flags = f"--config tiny --device cpu --data-root {data_root} --sample-tokens 0 --out-dir {run}"
    return [*flags.split(), *map(str, extra)]


def script(*argv, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    """`python ARGV...` in the repository, as a user runs it, its output captured as text."""
    kwargs.setdefault("capture_output", True)
    return subprocess.run(
        [sys.executable, *map(str, argv)], cwd=ROOT, text=True, timeout=timeout, **kwargs
    )


def in_process(main, *argv) -> subprocess.CompletedProcess:
    """main(argv) run as its script runs it (configs.run), but in this process: a second faster
    than starting Python and torch again. Its exit status and output, as a script's."""
    from configs import run

    out, err = io.TextIOWrapper(io.BytesIO()), io.TextIOWrapper(io.BytesIO())
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with pytest.raises(SystemExit) as exit:
            run(lambda: main([str(a) for a in argv]))
    text = [(stream.flush(), stream.buffer.getvalue().decode())[1] for stream in (out, err)]
    return subprocess.CompletedProcess(argv, exit.value.code or 0, *text)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The `error:` line of a script that failed as a user's mistake: exit 2, no traceback, and one
    line that starts with `error: `."""
    tail = proc.stderr[-2000:]  # what a failure shows
    assert proc.returncode == 2, (proc.returncode, tail)
    assert "Traceback" not in proc.stderr, tail
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, tail
    return errors[0]


@pytest.fixture
def network_calls(monkeypatch) -> list:
    """Every host looked up and every address connected to, each refused and recorded: a test
    asserts that the list is empty (nothing asked the network)."""
    import socket

    calls: list = []

    def lookup(host, port, *args, **kwargs):
        calls.append((host, port))
        raise socket.gaierror(socket.EAI_NONAME, "the network is off in this test")

    def connect(sock, address):
        calls.append(address)
        raise OSError("the network is off in this test")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return calls


def hf_tiny(tie: bool = True, vocab: int = 37, **kw):
    """A transformers GPT-2 small enough for a test, every weight random."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=24,
        n_embd=16,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=tie,
        **kw,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF zeroes biases and sets norms to one: random ones test every weight
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A temporary Hugging Face cache, and a function that puts a model in it as huggingface_hub
    lays out its downloads: models--ORG--NAME/refs/main holds the commit, snapshots/COMMIT/ the
    files."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    cache = tmp_path / "hf_home" / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read at import

    def add(repo_id: str, model) -> Path:
        commit = "0123456789abcdef0123456789abcdef01234567"
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        model.save_pretrained(repo / "snapshots" / commit)
        return repo / "snapshots" / commit

    return add
