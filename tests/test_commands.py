"""Every command README.md and the scripts' usage docstrings show, run here shrunk to tiny sizes.

A documented command needs an entry in RUNS (a new one fails test_every_documented_command_runs_here),
so a moved or renamed file cannot break one unseen. Shrinking: training runs 2 steps of a 1-layer,
16-wide model on the CPU, uncompiled; sampling decodes 4 tokens; the hub ids (gpt2, gpt2-medium)
come from a Hugging Face cache the test makes; datasets from the hub are refused offline, as they
must be; torchrun runs 2 CPU processes. benchmarks/ has its own (tests/test_benchmarks.py).
"""

import ast
import contextlib
import gzip
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sample
import train
from configs import available_configs, parse_config
from configs.cli import ArgumentParser
from configs.errors import UserError
from conftest import hf_tiny, pytest_xdist_auto_num_workers
from data.prepare import main as prepare_main
from data.prepare import prepare
from model.__main__ import main as model_main
from model.hf import main as hf_main

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["train.py", "sample.py", "model/__main__.py", "model/hf.py", "data/prepare.py",
           *(f"configs/{name}.py" for name in available_configs())]
START = re.compile(r"^(?:\$ )?(?:echo .*\| )?(?:python|torchrun) ")


def commands(text: str) -> list[str]:
    """Shell commands in text: lines that start one (a trailing backslash continues it), comments cut."""
    out, pending = [], ""
    for line in text.splitlines():
        line = (pending + " " + line.strip()).strip()
        pending = ""
        if not START.match(line):
            continue
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        out.append(" ".join(re.sub(r"\s+#.*$", "", line).removeprefix("$ ").split()))
    return out


def documented() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    found = commands("\n".join(re.findall(r"```[a-z]*\n(.*?)```", readme, re.S)))
    found += [c for c in re.findall(r"`((?:python|torchrun) [^`]+)`", readme) if START.match(c)]
    for script in SCRIPTS:
        found += commands(ast.get_docstring(ast.parse((ROOT / script).read_text())) or "")
    return set(found)


TINY = ["--max-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--eval-batch-size", "2", "--batch-size",
        "2", "--block-size", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--sample-tokens", "4",
        "--device", "cpu", "--compile", "false", "--log-interval", "1", "--tokens-per-step", "0"]
EVAL = ["--device", "cpu", "--block-size", "16", "--eval-batch-size", "64"]
OFF_HUB = ["--dataset", "shakespeare_char", "--vocab-size", "0", "--tokens-per-step", "64"]  # for gpt2's corpus
SAMPLE = ["--max-new-tokens", "4", "--device", "cpu"]
ERROR, HELP = "error", "help"  # expectations besides a trained run's, a sample's or plain success

# documented command -> (its command line here, what it must show). None: the command itself.
RUNS = {
    "python train.py --config small": (None, "checkpoint"),
    "python train.py --config small --resume": (None, "resuming at step 2"),
    "python train.py --config small --max-time 60": (None, "checkpoint"),
    "python train.py --config small --max-time 45": (None, "checkpoint"),
    "python train.py --config small --max-iters 200 --device cpu --lr 1e-3 --no-compile": (None, "checkpoint"),
    "python train.py --config small --eval-only": (None, "perplexity"),
    "python train.py --config small --help": (None, HELP),
    "python train.py --config small --max-iter 3000": (None, ERROR),
    "python train.py --config small --device gpu": (None, ERROR),
    "python train.py --config tiny": (None, "checkpoint"),
    "python train.py --config shakespeare_gpu": (None, "checkpoint"),
    "python train.py --config runs/mine.toml": (None, "checkpoint"),
    "python train.py --config out/small --out-dir out/again": (None, "checkpoint"),
    "python train.py --config small --pos-emb learned --activation gelu --max-iters 600 --out-dir out/small_learned":
        (None, "checkpoint"),
    "python train.py --config finetune_gpt2": (None, "architecture taken from"),
    "python train.py --config finetune_gpt2 --init-from gpt2-medium": (None, "architecture taken from"),
    "python train.py --config finetune_gpt2 --eval-only":  # a whole val split: a small one of GPT-2 BPE
        ("python train.py --config finetune_gpt2 --eval-only --dataset book_gpt2", "perplexity"),
    "python train.py --config gpt2 --batch-size auto": (shlex.join(["python", "train.py", "--config", "gpt2", *TINY,
                                                                    *OFF_HUB, "--batch-size", "auto"]), "batch-size auto:"),
    "torchrun --standalone --nproc_per_node=8 train.py --config gpt2":
        ("torchrun --standalone --nproc_per_node=2 train.py --config gpt2 " + shlex.join(OFF_HUB), "checkpoint"),
    "torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=FIRST_NODE_IP --master_port=29500 train.py "
    "--config gpt2": ("torchrun --nnodes=1 --node_rank=0 --nproc_per_node=2 --master_addr=127.0.0.1 "
                      "--master_port=29531 train.py --config gpt2 " + shlex.join(OFF_HUB), "checkpoint"),
    'python sample.py --prompt "ROMEO:"': (None, "ROMEO:"),
    'python sample.py --prompt "ROMEO:" --temperature 0': (None, "ROMEO:"),
    'python sample.py --prompt "ROMEO:" --num-samples 3 --seed 7 --top-k 20 --top-p 0.9': (None, "sample 3/3"),
    'python sample.py --prompt "ROMEO:" --stop "\\n\\n"': (None, "ROMEO:"),
    'python sample.py --prompt "ROMEO:" --prompt "JULIET:"': (None, "prompt 2/2"),
    'python sample.py --prompt "ROMEO:" --compile': (None, "ROMEO:"),
    'python sample.py --config shakespeare_gpu --prompt "KING:"': (None, "KING:"),
    "python sample.py --config tiny --device cpu --dtype float32": (None, ""),
    "python sample.py --prompt-file prompts.txt": (None, "prompt 2/2"),
    'echo "To be, or not" | python sample.py --prompt -': (None, "To be, or not"),
    'python sample.py --init-from gpt2 --prompt "Hello"': (None, "Hello"),
    'python sample.py --init-from gpt2 --prompt "Hello, I\'m a language model,"': (None, "Hello, I'm a language model,"),
    "python -m model": (None, "logits"),
    "python -m model --config small": (None, "logits"),
    "python -m model --config gpt2 --seq-len 8": (None, "124,"),
    "python -m model.hf export": ("python -m model.hf export --help", HELP),
    "python -m model.hf export out/tiny exported/tiny": (None, "wrote exported/tiny"),
    "python -m model.hf export out/small_learned exported/small": (None, "wrote exported/small"),
    "python -m data.prepare": ("python -m data.prepare --help", HELP),
    "python -m data.prepare shakespeare_char": (None, "shakespeare_char"),
    "python -m data.prepare shakespeare": (None, "shakespeare"),
    "python -m data.prepare --text book.txt --tokenizer char": (None, "book_char"),
    "python -m data.prepare --text corpus_dir/ --name mycorpus": (None, "mycorpus"),
    "python -m data.prepare --files a.parquet b.parquet --text-column content --num-proc 2": (None, "train"),
    "python -m data.prepare --files docs.jsonl.gz --val-fraction 0.05": (None, "train"),
    "python -m data.prepare --hf path/to/dataset_dir --split validation": (None, "train"),
    "python -m data.prepare --hf roneneldan/TinyStories --revision main --streaming": (None, ERROR),
    "python -m data.prepare --hf HuggingFaceFW/fineweb-edu --subset sample-10BT --streaming --name fineweb_edu "
    "--val-fraction 0.001": (None, ERROR),
    "python tests/mutation.py": ("python tests/mutation.py --help", HELP),
}


def test_every_documented_command_runs_here():
    shown = documented()
    ci = (ROOT / ".ci/run").read_text()  # CI runs README's install and test commands themselves
    shown -= {c for c in shown if c.startswith("python -m pytest") and c in ci}
    assert sorted(shown - RUNS.keys()) == [], "documented commands without a run in RUNS"
    assert sorted(RUNS.keys() - shown) == [], "RUNS entries no document shows any more"


@pytest.mark.parametrize("cores, processes", [(1, 0), (3, 0), (4, 2), (16, 8), (17, 8)])
def test_readmes_test_command_runs_a_process_per_two_cores_from_4(cores, processes, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert pytest_xdist_auto_num_workers(None) == processes  # 0: one test at a time, in this process
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert pytest_xdist_auto_num_workers(None) is None  # pytest-xdist's own hook takes the user's number


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_root):
    """A directory holding what the documented commands expect: trained runs out/small, out/tiny,
    out/shakespeare_gpu and out/small_learned, and the files the examples name."""
    work = tmp_path_factory.mktemp("work")
    prepare("shakespeare", out_root=data_root, verbose=False)
    corpus = (ROOT / "data/corpora/tinyshakespeare/input.txt").read_text()[:20000]
    (work / "book.txt").write_text(corpus)
    prepare("book_gpt2", text=work / "book.txt", tokenizer="gpt2", out_root=data_root, verbose=False)
    (work / "corpus_dir").mkdir()
    for i in range(3):
        (work / "corpus_dir" / f"{i}.txt").write_text(corpus[i * 5000:(i + 1) * 5000])
    (work / "prompts.txt").write_text("ROMEO:\nJULIET:\n")
    (work / "runs").mkdir()
    (work / "runs" / "mine.toml").write_text('base = "small"\nmax_iters = 2\n')
    docs = [{"content": corpus[i:i + 500]} for i in range(0, 20000, 500)]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    for name, part in (("a", docs[:20]), ("b", docs[20:])):
        pq.write_table(pa.Table.from_pylist(part), work / f"{name}.parquet")
    with gzip.open(work / "docs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d["content"]}) + "\n" for d in docs)
    import datasets

    split = datasets.Dataset.from_list([{"text": d["content"]} for d in docs])
    datasets.DatasetDict({"train": split, "validation": split}).save_to_disk(work / "path/to/dataset_dir")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        for config, more in (("small", []), ("tiny", []), ("shakespeare_gpu", []),
                             ("small", ["--pos-emb", "learned", "--activation", "gelu", "--out-dir", "out/small_learned"])):
            assert train.main(["--config", config, *TINY, "--data-root", str(data_root), *more]) == 0
    return work


def run(command: str, shrink: bool, data_root: Path, capsys, monkeypatch) -> tuple[int, str]:
    """The command, shrunk, in this process where it can be (a subprocess for torchrun); (exit code, output)."""
    stdin, _, command = command.rpartition("| ")
    argv = shlex.split(command)
    if stdin:
        monkeypatch.setattr(sys, "stdin", io.StringIO(shlex.split(stdin)[1] + "\n"))
    if argv[0] == "torchrun":
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent),
               "TMPDIR": os.environ["TMPDIR"]}  # conftest's: torchrun leaves a folder there
        script = [str(ROOT / a) if a == "train.py" else a for a in argv[1:]]  # run from the work directory
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *script, *TINY, "--data-root",
                               str(data_root)], capture_output=True, text=True, env=env, timeout=300)
        return done.returncode, done.stdout + done.stderr
    script, args = (argv[2], argv[3:]) if argv[1] == "-m" else (argv[1], argv[2:])
    if script == "train.py":
        if not {"--resume", "--eval-only", "--help"} & set(args):  # a new run: train.py will not
            with contextlib.suppress(UserError):  # overwrite one; a command shown failing fails below
                shutil.rmtree(parse_config(ArgumentParser(), args)[0].run_dir, ignore_errors=True)
        shrunk = EVAL if "--eval-only" in args else TINY if shrink and "--batch-size" not in args else []
        code = train.main([*args, *shrunk, "--data-root", str(data_root)])
    elif script == "sample.py":
        shrunk = [] if "--max-new-tokens" in args else ["--max-new-tokens", "4"]
        code = sample.main([*args, *shrunk, "--device", "cpu"])
    else:
        main = {"model": model_main, "model.hf": hf_main, "data.prepare": prepare_main}.get(script)
        if main is None:  # tests/mutation.py
            done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=ROOT)
            return done.returncode, done.stdout + done.stderr
        code = main(args + (["--out-root", str(data_root)] if script == "data.prepare" and shrink else []))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("documented_command", sorted(RUNS))
def test_documented_command(documented_command, workdir, data_root, tmp_path, hub_cache, network_calls, capsys,
                            monkeypatch):
    command, shows = RUNS[documented_command]
    work = tmp_path / "work"
    shutil.copytree(workdir, work)
    monkeypatch.chdir(work)
    for hub_id in ("gpt2", "gpt2-medium"):
        hub_cache(hub_id, hf_tiny(vocab=50257))
    capsys.readouterr()  # transformers' own progress bars while saving them
    shrink = shows not in (ERROR, HELP)
    code, out = run(command or documented_command, shrink, data_root, capsys, monkeypatch)
    if shows == ERROR:
        assert code == 2 and out.count("\n") == 1 and out.startswith("error: "), out
    else:
        assert code == 0, out
        assert (shows if shows != HELP else "usage:") in out, out

