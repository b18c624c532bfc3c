"""Every command that README.md, the scripts' usage texts and the presets show, run here shrunk.

Each runs as Python runs it (runpy), in this process (torchrun's in processes of its own), in a
copy of a folder holding what the examples name: training 2 steps of a 1-layer, 16-wide model on
the CPU, sampling 4 tokens; the hub ids (gpt2, gpt2-medium) come from a Hugging Face cache the
test makes, and a hub dataset is refused offline, as it must be.
"""

import gzip
import io
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, hf_tiny, pytest_xdist_auto_num_workers
from test_config import write  # a file, in folders made as needed

from configs import parse_args

TINY = "--max-iters 2 --eval-interval 1 --eval-iters 1 --eval-batch-size 2 --batch-size 2 \
--block-size 16 --n-layer 1 --n-head 2 --n-embd 16 --sample-tokens 4 --device cpu --no-compile \
--log-interval 1 --tokens-per-step 0 --warmup-iters 0 --threads 1"
SAMPLE = "--max-new-tokens 4 --device cpu"
EVAL = "--device cpu --block-size 16 --eval-batch-size 64 --threads 1"  # a whole val split
# documented => the flags added here => what it prints (=> its marks); the mutation score takes
# most of an hour: its --help
RUNS = f"""
python train.py --config small => {TINY} => checkpoint
python train.py --config small --resume => --max-iters 3 => resuming at step 2
python train.py --config small --max-time 60 => {TINY} => checkpoint
python train.py --config runs/mine.toml => {TINY} => checkpoint
python train.py --config out/small/config.json --out-dir out/again => {TINY} => checkpoint
python train.py --config finetune_gpt2 => {TINY} => checkpoint
python train.py --config finetune_gpt2 --init-from gpt2-medium => {TINY} => checkpoint
python train.py --config finetune_gpt2 --eval-only => {EVAL} --dataset book => perplexity
python train.py --config small --eval-only => {EVAL} => perplexity
python train.py --help => => usage:
python train.py --config small --help => => usage:
python train.py --config small --max-iters 200 --device cpu --lr 1e-3 --no-compile => {TINY} \
=> checkpoint
python train.py --config small --max-iters -5 => => error:
python train.py --config tiny => {TINY} => checkpoint
python train.py --config shakespeare_gpu => {TINY} => checkpoint
python train.py --config small --pos-emb learned --activation gelu --max-iters 600 --out-dir \
out/small_learned => {TINY} => checkpoint
torchrun --standalone --nproc_per_node=8 train.py --config gpt2 => --dataset shakespeare_char \
--vocab-size 0 {TINY} => checkpoint out/gpt2/ckpt.pt => slow
python sample.py --prompt "ROMEO:" => {SAMPLE} => ROMEO:
python sample.py --prompt "ROMEO:" --temperature 0 => {SAMPLE} => ROMEO:
python sample.py --prompt "ROMEO:" --num-samples 3 --seed 7 --top-k 20 --top-p 0.9 => {SAMPLE} \
=> sample 3/3
python sample.py --prompt "ROMEO:" --stop "\\n\\n" => {SAMPLE} => ROMEO:
python sample.py --prompt "ROMEO:" --prompt "JULIET:" => {SAMPLE} => prompt 2/2
python sample.py --prompt "ROMEO:" --compile => {SAMPLE} => ROMEO: => slow
python sample.py --out-dir out/shakespeare_gpu --prompt "KING:" => {SAMPLE} => KING:
echo "To be, or not" | python sample.py --prompt - => {SAMPLE} => To be, or not
python sample.py --init-from gpt2 --prompt "Hello, I'm a language model," => {SAMPLE} \
=> Hello, I'm a language model,
python sample.py --help => => usage:
python -m model --config small => => logits (1, 64, 65)
python -m model --config gpt2 --seq-len 8 => => 124,475,904 parameters
python -m model.hf export out/small_learned exported/small => => wrote exported/small
python -m data.prepare => --help => usage:
python -m data.prepare shakespeare_char => --force =>
python -m data.prepare shakespeare => --force =>
python -m data.prepare --text book.txt --tokenizer char => --force => book: char tokenizer
python -m data.prepare mycorpus --text corpus/ => --force => mycorpus: gpt2 tokenizer, 50,257 \
tokens in its vocabulary; 5,443 train and 605 val tokens
python -m data.prepare --files docs.jsonl.gz --text-column body => --force => docs: gpt2
python -m data.prepare tinystories --hf roneneldan/TinyStories --streaming => --force => error:
python tests/mutation.py => --help => usage:
"""
RUNS = [re.split(" *=> *", line) for line in RUNS.strip().splitlines()]
SCRIPTS = "README.md train.py sample.py model/__main__.py model/hf.py data/prepare.py".split()
# a line's command, or a `command`; not pytest's (CI runs them) nor the benchmarks'
FOUND = r"(?:^|`)[#$ ]*((?:echo .*\| )?(?:python(?! -m (?:pytest|benchmarks))|torchrun) [^`\n#]*)"
TEXTS = [*map(ROOT.joinpath, SCRIPTS), *ROOT.glob("configs/*.toml")]


def test_every_documented_command_has_a_run():
    found = {c.strip() for p in TEXTS for c in re.findall(FOUND, p.read_text(), re.M)}
    assert found == {r[0] for r in RUNS}


def test_readmes_test_command_runs_a_process_per_two_cores_from_4(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    for cores, processes in {1: 0, 3: 0, 4: 2, 16: 8, 17: 8}.items():
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: range(n))
        assert pytest_xdist_auto_num_workers(None) == processes  # 0: one test at a time
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert pytest_xdist_auto_num_workers(None) is None  # pytest-xdist's own hook takes it


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding a trained run (out/small, copied to out/shakespeare_gpu and
    out/small_learned), the datasets, and the files the examples name."""
    work = tmp_path_factory.mktemp("work")
    corpus = (ROOT / "data/corpora/tinyshakespeare/input.txt").read_text()[:20000]
    write(work / "book.txt", corpus)
    write(work / "corpus/a.txt", corpus)
    write(work / "runs/mine.toml", "base = 'small'")
    (work / "docs.jsonl.gz").write_bytes(gzip.compress(json.dumps({"body": corpus}).encode()))
    # beside corpus/a.txt, read once and alone: a folder named as a text, a broken link, a loop
    (work / "corpus/x.txt").mkdir()
    (work / "corpus/gone.txt").symlink_to("nowhere.txt")
    (work / "corpus/up").symlink_to(".")
    (work / "train.py").symlink_to(ROOT / "train.py")  # for torchrun
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        run("python -m data.prepare --text book.txt", mp)
        # GPT-2's architecture, to export; the other uses of a run take any
        run(f"python train.py --config small --pos-emb learned --activation gelu {TINY}", mp)
    for name in ("shakespeare_gpu", "small_learned"):
        shutil.copytree(work / "out/small", work / "out" / name)
    return work


def run(command, monkeypatch):
    """command's exit status; `python [-m] SCRIPT ARGS` run as Python runs it, in this process."""
    if command.startswith("torchrun"):
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        return subprocess.run(torchrun + shlex.split(command)[1:], timeout=300).returncode
    argv = shlex.split(command.removeprefix("python -m").removeprefix("python"))
    module = argv[0].removesuffix(".py").replace("/", ".")
    package, _, name = module.rpartition(".")
    if package and module in sys.modules:  # its package's name for it comes back after
        monkeypatch.setattr(sys.modules[package], name, sys.modules[module])
    monkeypatch.delitem(sys.modules, module, raising=False)  # imported afresh, as a process does
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit:
        runpy.run_module(module, run_name="__main__")
    return exit.value.code


@pytest.mark.parametrize(
    "documented, flags, shows",
    [pytest.param(*r[:3], marks=[getattr(pytest.mark, m) for m in r[3:]], id=r[0]) for r in RUNS],
)
def test_documented_command(
    documented, flags, shows, workdir, tmp_path, hub_cache, network_calls, monkeypatch, capfd
):
    monkeypatch.chdir(shutil.copytree(workdir, tmp_path / "work", symlinks=True))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a hub dataset is refused, not retried
    for hub_id in ("gpt2", "gpt2-medium") * ("gpt2" in documented):
        hub_cache(hub_id, hf_tiny(vocab=50257))
    echo, _, command = f"{documented} {flags}".rpartition("| ")
    if echo:  # echo TEXT |
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"{shlex.split(echo)[1]}\n"))
    if shows == "checkpoint":  # a new run: it will not overwrite a trained one
        shutil.rmtree(parse_args(shlex.split(command)[2:]).run_dir, ignore_errors=True)
    code = run(command.replace("=8", "=2"), monkeypatch)  # torchrun: 2 CPU processes, not 8
    out = "".join(capfd.readouterr())
    if shows == "error:":
        assert code == 2 and re.fullmatch("error: .*\n", out), out  # one line
    else:
        assert not code and shows in out, out
    assert network_calls == []
