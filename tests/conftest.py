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


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """The bundled corpus, prepared char-level once per session in a temporary directory."""
    from data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    prepare("shakespeare_char", out_root=root, verbose=False)
    return root
