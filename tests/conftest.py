"""Shared test set-up."""

import pytest
import torch


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
