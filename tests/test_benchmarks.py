"""Every command of benchmarks/' usage text, run here shrunk: the benchmarks stay runnable."""

import json
import re

import pytest
from conftest import ROOT

from benchmarks.__main__ import __doc__ as usage
from benchmarks.__main__ import main
from configs import UserError

TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--block-size",
    "16",
    "--batch-size",
    "2",
    "--device",
    "cpu",
    "--no-compile",
    "--eval-iters",
    "1",
    "--eval-batch-size",
    "2",
]
SHRUNK = {  # documented command -> the flags added here
    "python -m benchmarks size": [],
    "python -m benchmarks train --config small --iters 200": ["--iters", "10", *TINY],
    "python -m benchmarks train --config small --iters 200 --busy 1": ["--iters", "10", *TINY],
    "python -m benchmarks sample --config small": ["--tokens", "10", "--modes", "eager"],
    "python -m benchmarks sample --config gpt2 --modes eager,transformers --temperature 0 "
    "--tokens 100": ["--tokens", "1"],
    "python -m benchmarks time-to-loss --config small": ["--max-iters", "2", *TINY],
    "python -m benchmarks max-time --config small --max-time 20": ["--max-time", "5", *TINY],
    "python -m benchmarks gpu": [],  # here: the one line that says it needs a GPU
}


def test_every_documented_benchmark_has_a_run():
    shown = {
        " ".join(re.sub(r"\s+#.*$", "", line).split())
        for line in usage.splitlines()
        if line.strip().startswith("python -m benchmarks")
    }
    assert shown == SHRUNK.keys()


@pytest.mark.parametrize("command", sorted(SHRUNK))
def test_benchmark(command, tmp_path, data_root, monkeypatch, capsys):
    monkeypatch.setattr("benchmarks.size.closures", dict)  # test_layout measures them
    monkeypatch.chdir(tmp_path)  # what they write (data/prepared, out/) stays here
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prepared").symlink_to(data_root)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    if command.endswith("gpu"):
        with pytest.raises(UserError, match="needs a CUDA GPU"):
            main(command.split()[3:])
        return
    main(command.split()[3:] + SHRUNK[command])
    records = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    if command.endswith("size"):
        return  # it prints a table: test_layout checks its figures
    assert records and all(r["bench"] == command.split()[3] for r in records)
    assert all({"device", "dtype", "threads"} <= r.keys() for r in records)  # what ran it
    assert all(v is None or v == v for r in records for v in r.values() if isinstance(v, float))


@pytest.mark.parametrize("command", ["size", "train", "sample", "time-to-loss", "max-time", "gpu"])
def test_every_benchmarks_help_prints(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m benchmarks")
