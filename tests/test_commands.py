"""Every command that README.md, the scripts' usage texts and the presets show, run here shrunk.

A documented command needs an entry in RUNS (test_every_documented_command_has_a_run fails
otherwise), so that no renamed flag or file breaks one unseen. Shrunk: training runs 2 steps of a
1-layer, 16-wide model on the CPU; sampling decodes 4 tokens; the hub ids (gpt2, gpt2-medium) come
from a Hugging Face cache the test makes; a hub dataset is refused offline, as it must be; torchrun
runs 2 CPU processes. Each runs in a folder of its own, with what the examples name in it.
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

import pytest
from conftest import ROOT, hf_tiny, pytest_xdist_auto_num_workers

import sample
import train
from configs import PRESETS, UserError, parse_args
from data.prepare import main as prepare_main
from data.prepare import prepare
from model.__main__ import main as model_main
from model.hf import main as hf_main

SCRIPTS = ["train.py", "sample.py", "model/__main__.py", "model/hf.py", "data/prepare.py"]
START = re.compile(r"^(?:\$ )?(?:echo .*\| )?(?:python|torchrun) ")
TINY = [
    "--max-iters",
    "2",
    "--eval-interval",
    "1",
    "--eval-iters",
    "1",
    "--eval-batch-size",
    "2",
    "--batch-size",
    "2",
    "--block-size",
    "16",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--sample-tokens",
    "4",
    "--device",
    "cpu",
    "--no-compile",
    "--log-interval",
    "1",
    "--tokens-per-step",
    "0",
    "--warmup-iters",
    "0",
]
OFF_HUB = ["--dataset", "shakespeare_char", "--vocab-size", "0"]  # gpt2's corpus is not prepared
ERROR, HELP = "error", "help"  # what a command shows, besides text it prints

# documented command -> (the command run here, or None for itself; what it must show)
RUNS = {
    "python train.py --config small": (None, "checkpoint"),
    "python train.py --config small --resume": (
        "python train.py --config small --resume --max-iters 3",
        "resuming at step 2",
    ),
    "python train.py --config small --max-time 60": (None, "checkpoint"),
    "python train.py --config runs/mine.toml": (None, "checkpoint"),
    "python train.py --config out/small/config.json --out-dir out/again": (None, "checkpoint"),
    "python train.py --config finetune_gpt2": (None, "checkpoint"),
    "python train.py --config finetune_gpt2 --init-from gpt2-medium": (None, "checkpoint"),
    "python train.py --config finetune_gpt2 --eval-only": (  # a whole val split: a small one
        "python train.py --config finetune_gpt2 --eval-only --dataset book",
        "perplexity",
    ),
    "python train.py --config small --eval-only": (None, "perplexity"),
    "python train.py --help": (None, HELP),
    "python train.py --config small --help": (None, HELP),
    "python train.py --config small --max-iters 200 --device cpu --lr 1e-3 --no-compile": (
        None,
        "checkpoint",
    ),
    "python train.py --config small --max-iters -5": (None, ERROR),
    "python train.py --config tiny": (None, "checkpoint"),
    "python train.py --config shakespeare_gpu": (None, "checkpoint"),
    "python train.py --config small --pos-emb learned --activation gelu --max-iters 600 --out-dir "
    "out/small_learned": (None, "checkpoint"),
    "torchrun --standalone --nproc_per_node=8 train.py --config gpt2": (
        "torchrun --standalone --nproc_per_node=2 train.py --config gpt2 " + shlex.join(OFF_HUB),
        "checkpoint",
    ),
    'python sample.py --prompt "ROMEO:"': (None, "ROMEO:"),
    'python sample.py --prompt "ROMEO:" --temperature 0': (None, "ROMEO:"),
    'python sample.py --prompt "ROMEO:" --num-samples 3 --seed 7 --top-k 20 --top-p 0.9': (
        None,
        "sample 3/3",
    ),
    'python sample.py --prompt "ROMEO:" --stop "\\n\\n"': (None, "ROMEO:"),
    'python sample.py --prompt "ROMEO:" --prompt "JULIET:"': (None, "prompt 2/2"),
    'python sample.py --prompt "ROMEO:" --compile': (None, "ROMEO:"),
    'python sample.py --out-dir out/shakespeare_gpu --prompt "KING:"': (None, "KING:"),
    'echo "To be, or not" | python sample.py --prompt -': (None, "To be, or not"),
    'python sample.py --init-from gpt2 --prompt "Hello, I\'m a language model,"': (
        None,
        "Hello, I'm a language model,",
    ),
    "python -m model --config small": (None, "logits (1, 64, 65)"),
    "python -m model --config gpt2 --seq-len 8": (None, "124,475,904 parameters"),
    "python -m model.hf export out/small_learned exported/small": (None, "wrote exported/small"),
    "python -m data.prepare": ("python -m data.prepare --help", HELP),
    "python sample.py --help": (None, HELP),
    "python -m data.prepare shakespeare_char": (None, ""),
    "python -m data.prepare shakespeare": (None, ""),
    "python -m data.prepare --text book.txt --tokenizer char": (None, "book: char tokenizer"),
    "python -m data.prepare mycorpus --text corpus/": (None, "mycorpus: gpt2 tokenizer"),
    "python -m data.prepare --files docs.jsonl.gz --text-column body": (None, "docs: gpt2"),
    "python -m data.prepare tinystories --hf roneneldan/TinyStories --streaming": (None, ERROR),
}


def commands(text: str) -> list[str]:
    """The shell commands in text: lines that start one, comments cut."""
    found = []
    for line in text.splitlines():
        line = line.strip().removeprefix("#").strip()
        if START.match(line):
            found.append(" ".join(re.sub(r"\s+#.*$", "", line).removeprefix("$ ").split()))
    return found


def documented() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    found = commands("\n".join(re.findall(r"```[a-z]*\n(.*?)```", readme, re.S)))
    found += [c for c in re.findall(r"`((?:python|torchrun) [^`]+)`", readme) if START.match(c)]
    for script in SCRIPTS:
        found += commands(ast.get_docstring(ast.parse((ROOT / script).read_text())) or "")
    for preset in PRESETS:
        found += commands((ROOT / "configs" / f"{preset}.toml").read_text())
    return set(found)


def test_every_documented_command_has_a_run():
    shown = documented()
    ci = (ROOT / ".ci/run").read_text()  # CI runs README's install and test commands themselves
    shown -= {
        c for c in shown if c.startswith(("python -m pytest", "python -m benchmarks")) or c in ci
    }
    shown -= {"python tests/mutation.py"}  # hours: its --help is run below
    assert sorted(shown - RUNS.keys()) == [], "documented commands without a run in RUNS"
    assert sorted(RUNS.keys() - shown) == [], "RUNS entries that no document shows any more"


def test_the_mutation_script_starts():
    assert subprocess.run([sys.executable, "tests/mutation.py", "--help"], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("cores, processes", [(1, 0), (3, 0), (4, 2), (16, 8), (17, 8)])
def test_readmes_test_command_runs_a_process_per_two_cores_from_4(cores, processes, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert pytest_xdist_auto_num_workers(None) == processes  # 0: one test at a time
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert pytest_xdist_auto_num_workers(None) is None  # pytest-xdist's own hook takes it


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding what the commands expect: trained runs (out/small, out/shakespeare_gpu,
    out/small_learned), the datasets, and the files the examples name."""
    work = tmp_path_factory.mktemp("work")
    corpus = (ROOT / "data/corpora/tinyshakespeare/input.txt").read_text()[:20000]
    (work / "book.txt").write_text(corpus)
    prepare("book", text=str(work / "book.txt"), root=str(work / "data/prepared"), quiet=True)
    (work / "corpus").mkdir()
    for i in range(3):
        (work / "corpus" / f"{i}.txt").write_text(corpus[i * 5000 : (i + 1) * 5000])
    (work / "runs").mkdir()
    (work / "runs" / "mine.toml").write_text('base = "small"\nmax_iters = 2\n')
    with gzip.open(work / "docs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": corpus[i : i + 500]}) + "\n" for i in range(0, 20000, 500))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        for config, more in (
            ("small", []),
            ("shakespeare_gpu", []),
            (
                "small",
                ["--pos-emb", "learned", "--activation", "gelu", "--out-dir", "out/small_learned"],
            ),
        ):
            train.train(parse_args(["--config", config, *TINY, *more]))
    return work


def run(command: str, shrink: bool, capsys, monkeypatch) -> tuple[int, str]:
    """The command, shrunk, in this process where it can be (torchrun's in processes of its own):
    (its exit status, its output)."""
    stdin, _, command = command.rpartition("| ")
    argv = shlex.split(command)
    if stdin:
        monkeypatch.setattr(sys, "stdin", io.StringIO(shlex.split(stdin)[1] + "\n"))
    if argv[0] == "torchrun":
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        args = [str(ROOT / a) if a == "train.py" else a for a in argv[1:]]
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *args, *TINY],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        return done.returncode, done.stdout + done.stderr
    script, args = (argv[2], argv[3:]) if argv[1] == "-m" else (argv[1], argv[2:])
    try:
        if script == "train.py":
            eval_only = ["--device", "cpu", "--block-size", "16", "--eval-batch-size", "64"]
            shrunk = eval_only if "--eval-only" in args else TINY if shrink else []
            if not {"--resume", "--eval-only", "--help"} & set(args):  # a new run: it will not
                with contextlib.suppress(UserError):  # overwrite a trained one
                    shutil.rmtree(parse_args(args).run_dir, ignore_errors=True)
            result = train.train(parse_args(args + shrunk))
            code = 128 + result["stop_signal"] if result["stop_signal"] else 0
        elif script == "sample.py":
            code = sample.main([*args, "--max-new-tokens", "4", "--device", "cpu"]) or 0
        else:
            main = {"model": model_main, "model.hf": hf_main, "data.prepare": prepare_main}[script]
            if script == "data.prepare" and "--help" not in args:  # over the fixture's datasets
                args = [*args, "--force"]
            code = main(args) or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except SystemExit as e:  # --help
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("documented_command", sorted(RUNS))
def test_documented_command(
    documented_command, workdir, tmp_path, hub_cache, network_calls, capsys, monkeypatch
):
    command, shows = RUNS[documented_command]
    work = tmp_path / "work"
    shutil.copytree(workdir, work, symlinks=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for hub_id in ("gpt2", "gpt2-medium"):
        hub_cache(hub_id, hf_tiny(vocab=50257))
    capsys.readouterr()  # transformers' own output while saving them
    code, out = run(command or documented_command, shows not in (ERROR, HELP), capsys, monkeypatch)
    if shows == ERROR:
        assert code == 2 and [line[:7] for line in out.splitlines()] == ["error: "], out
    else:
        assert code == 0, out
        assert (shows if shows != HELP else "usage:") in out, out
