"""Shared test set-up."""

import os
import signal
from pathlib import Path

import pytest
import torch

from training.runtime import usable_cpus


def pytest_configure(config):
    """The signal tests press Ctrl-C or hang up as a user at a terminal would. A suite started in the background
    (`&` ignores SIGINT, nohup SIGHUP) would pass those on to the scripts, which rightly keep them ignored, so the
    tests get the defaults back."""
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGHUP, signal.SIG_DFL)):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, default)


def pytest_xdist_auto_num_workers(config) -> int | None:
    """pytest.ini's `-n auto`: a process per two usable cores, as many tests start scripts or DDP ranks of their
    own; under 4 cores one test at a time, as CI's 2 cores have always run it, so no test there meets another's
    load. On a 16-core GPU machine, where starting Python with torch took 4.7 s, 8 processes took the suite from
    6 minutes to 2 (docs/gpu.md). PYTEST_XDIST_AUTO_NUM_WORKERS, or `-n N` on the command line, still wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    workers = len(usable_cpus()) // 2
    return workers if workers >= 2 else 0


@pytest.fixture(autouse=True, scope="session")
def temp_files_stay_in_pytests_folder(tmp_path_factory):
    """torchrun keeps a log folder in the temp dir, and a stopped process leaves its temp files: the scripts the
    tests start put theirs under pytest's own temp folder, which pytest prunes, rather than into /tmp."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
        yield


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    spinning threads make them many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def network_calls(monkeypatch) -> list:
    """Every host name looked up and every address connected to, each refused and recorded: a
    test asserts the list is empty (nothing asked the network) or holds what was expected."""
    import socket

    calls: list = []

    def lookup(host, port, *args, **kwargs):
        calls.append((host, port))
        raise socket.gaierror(socket.EAI_NONAME, "network disabled by the test")

    def connect(sock, address):
        calls.append(address)
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return calls


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """shakespeare_char prepared once for the session (train.py's tests read it)."""
    from data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    prepare("shakespeare_char", out_root=root, verbose=False)
    return root


def hf_tiny(tie: bool = True, vocab: int = 37, **kw):
    """A transformers GPT-2 small enough for a test, every weight random."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=24, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie,
        bos_token_id=None, eos_token_id=None,  # not GPT-2's 50256: these vocabularies are smaller
        **kw,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF zero-inits biases and ones norms; randomise all so every weight is tested
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A temporary HF_HOME whose hub cache gets models laid out as huggingface_hub downloads them:
    models--ORG--NAME/refs/main holds the commit, snapshots/COMMIT/ the files."""
    import huggingface_hub

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
