"""Every command of benchmarks/' usage text, run here shrunk: the benchmarks stay runnable."""

import json
import re
from dataclasses import replace

import pytest
import torch._dynamo  # noqa: F401  AdamW imports it, a second or more: not in max-time's clock
from conftest import in_process, one_error_line

from benchmarks.__main__ import __doc__ as usage
from benchmarks.__main__ import main
from configs import load_config

DOCUMENTED = set(re.findall(r"^(python .*?) *(?:#|$)", usage, re.M))
TINY = "--n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --device cpu \
--no-compile --eval-iters 1 --eval-batch-size 2 --sample-tokens 0 --threads 1 --data-root {}"
# documented command => the flags added here (gpu: here, the one line that says it needs a GPU)
SHRUNK = dict(
    line.split(" =>")
    for line in f"""\
python -m benchmarks size =>
python -m benchmarks train --config small --iters 200 => --iters 10 {TINY}
python -m benchmarks train --config small --iters 200 --busy 1 => --iters 10 {TINY}
python -m benchmarks sample --config small => --tokens 10 --modes eager
python -m benchmarks sample --config gpt2 --modes eager,transformers --temperature 0 --tokens 100 \
=> --tokens 1
python -m benchmarks time-to-loss --config small => --max-iters 2 {TINY}
python -m benchmarks max-time --config small --max-time 20 => --max-time 3 {TINY}
python -m benchmarks gpu =>""".splitlines()
)


@pytest.mark.parametrize("command", sorted(SHRUNK.keys() | DOCUMENTED))
def test_benchmark(command, data_root, monkeypatch):
    assert command in DOCUMENTED  # and in SHRUNK, below
    name, *args = command.split()[3:]
    help = in_process(main, name, "--help")
    assert not help.returncode and help.stdout.startswith("usage: python -m benchmarks"), help
    monkeypatch.setattr("benchmarks.size.closures", dict)  # test_layout measures them
    shrunk = lambda name: replace(load_config(name), n_layer=1, n_embd=48)
    monkeypatch.setattr("benchmarks.decode.load_config", shrunk)  # sample's model: 1 x 48
    proc = in_process(main, name, *args, *SHRUNK[command].format(data_root).split())
    if name == "gpu":
        assert "needs a CUDA GPU" in one_error_line(proc)
        return
    records = [json.loads(r) for r in re.findall("^{.*", proc.stdout, re.M)]
    assert not proc.returncode and (name == "size" or records), proc.stderr
    for r in records:  # what ran it; no nan
        assert (
            r["bench"] == name
            and {"device", "dtype", "threads"} <= r.keys()
            and all(v == v for v in r.values())
        ), r
