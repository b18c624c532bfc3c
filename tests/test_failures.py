"""Bad input at the scripts' boundary is one `error:` line, exit 2, and nothing written or lost.

Mistakes and damaged files are tables of commands run in this process (conftest.in_process); the
streams, torchrun and the memory limit need a process of their own.
"""

import io
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, in_process, one_error_line, script, tiny_args
from filelock import FileLock

import sample
import train
from configs import UserError, parse_args, run
from data.prepare import main as prepare_main
from data.prepare import prepare
from model.checkpoint import load_checkpoint
from model.gpt import GPT

SHAKESPEARE = (ROOT / "data/corpora/tinyshakespeare/input.txt").read_text()
MIXED = SHAKESPEARE[:20000] + "é à ü ñ ☃\n" * 50  # a char vocabulary beyond ASCII
MAINS = {"train.py": train.main, "sample.py": sample.main, "-m": prepare_main}


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != ".lock"}


def written(folder: Path) -> dict[str, bytes]:
    """What a refused run left in its folder, besides the lock it held: nothing, it should be."""
    return contents(folder) if folder.exists() else {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A data root with `mixed` (char, with non-ASCII characters) and `bpe` (GPT-2's tokens)."""
    root = tmp_path_factory.mktemp("prepared")
    for name, text, kind in ("mixed", MIXED, "char"), ("bpe", SHAKESPEARE[:20000], "gpt2"):
        (root / f"{name}.txt").write_text(text)
        prepare(name, text=root / f"{name}.txt", tokenizer=kind, root=str(root), quiet=True)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, root) -> Path:
    """A tiny char run on `mixed`, trained for 2 steps (AdamW): its folder."""
    parent = tmp_path_factory.mktemp("trained")
    in_process(train.main, *tiny_args(parent, root, "--dataset", "mixed", "--max-iters", 2))
    return parent / "run"


def fill(text: str, words: dict) -> str:
    """A table's text with its capitals (TINY: the tiny run's flags; folders) filled in."""
    for word, value in words.items():
        text = text.replace(word, str(value))
    return text


def command(line: str, words: dict) -> tuple:
    program, *argv = shlex.split(fill(line, words))
    return MAINS[program], argv[program == "-m" :]


OOM = "out of memory; use a smaller --batch-size or model: "
TINY = "--config tiny --device cpu --sample-tokens 0 --data-root DATA --out-dir RUN"
PRESETS = "(finetune_gpt2, gpt2, shakespeare_gpu, small, tiny)"
# A command, and its one line; "..." stands for any text. RUN is empty, TRAINED a 2-step run on
# ROOT's `mixed`, DATA holds shakespeare_char.
MISTAKES = [
    ("train.py TINY --max-iter 5", "error: unrecognized arguments: --max-iter 5"),
    ("train.py TINY --compile false", "error: unrecognized arguments: false"),
    ("train.py TINY --lr nan", "error: --lr nan: expected a finite number, at least 0"),
    ("train.py --config smal", f"error: --config smal: ...small? give a preset {PRESETS}..."),
    (
        "train.py TINY --dataset nope",
        "error: no dataset 'nope' in DATA; prepare it (...give the --data-root...",
    ),
    ("train.py TINY --resume", "error: no checkpoint at RUN/ckpt.pt; train one first..."),
    ("train.py TINY --vocab-size 10", "error: the model's vocabulary (10) is smaller than its..."),
    ("train.py TINY --tokens-per-step 100", "...not a multiple of ... x processes (128)"),
    ("train.py TINY --data-root ROOT --dataset bpe --init-from TRAINED", "error: TRAINED was..."),
    (
        "train.py TINY MIX --init-from TRAINED --block-size 64",
        "error: --block-size 64 is longer than the model's context (32); lower it",
    ),
    (
        "train.py TINY MIX --out-dir TRAINED --resume --optimizer muon",
        "error: cannot resume TRAINED: its optimizer state does not fit...--init-from TRAINED",
    ),
    (
        "train.py TINY MIX --out-dir TRAINED",
        "...holds a trained run;...",
    ),
    (
        "-m data.prepare shakespeare_char --out-root DATA/shakespeare_char/val.bin",
        "error: cannot make DATA/shakespeare_char/val.bin: ...; give another --out-root",
    ),
    ("sample.py --out-dir RUN", "error: no checkpoint at RUN/ckpt.pt; ...writes out/small)"),
    (
        "sample.py --out-dir TRAINED --prompt 'R: Ωμ'",
        f"error: prompt 'R: Ωμ': 'Ωμ': not in this model's {len(set(MIXED))} characters",
    ),
    ("sample.py --out-dir RUN --num-samples 0", "...--num-samples, --top-k: at least 1..."),
    ("sample.py --out-dir RUN --max-new-tokens -1", "...--max-new-tokens, --temperature..."),
    ("sample.py --out-dir RUN --top-p 1.5", "...--top-p: above 0, at most 1..."),
    ("sample.py --out-dir RUN --stop ''", "...--stop: some text..."),
]


@pytest.mark.parametrize("line, message", MISTAKES)
def test_a_mistake_is_one_line_and_writes_nothing(
    tmp_path, data_root, trained, root, line, message
):
    words = {"TINY": TINY, "MIX": "--data-root ROOT --dataset mixed", "TRAINED": trained}
    words |= {"RUN": tmp_path / "run", "DATA": data_root, "ROOT": root}
    before = contents(trained)
    main, argv = command(line, words)
    proc = in_process(main, *argv)
    pattern = ".*".join(map(re.escape, fill(message, words).split("...")))
    assert re.fullmatch(pattern, one_error_line(proc))
    assert written(tmp_path / "run") == {} and not (data_root / "nope").exists()
    assert contents(trained) == before and (main is train.main or proc.stdout == "")


def test_resume_after_the_dataset_was_prepared_again_is_refused(tmp_path):
    for text in SHAKESPEARE[:3000], SHAKESPEARE[3000:6000]:  # other text: other ids
        (tmp_path / "mini.txt").write_text(text)
        prepare("mini", text=tmp_path / "mini.txt", tokenizer="char", root=str(tmp_path))
        proc = in_process(train.main, *tiny_args(tmp_path, tmp_path, "--dataset", "mini"))
        before = contents(tmp_path / "run")
    argv = tiny_args(tmp_path, tmp_path, "--dataset", "mini", "--resume")
    line = one_error_line(in_process(train.main, *argv))
    assert line.startswith(f"error: cannot resume {tmp_path / 'run'}: dataset mini is not the data")
    assert line.endswith(f"--init-from {tmp_path / 'run'} --out-dir NEW")
    assert contents(tmp_path / "run") == before and "holds a trained run" in proc.stderr


def test_a_val_split_too_short_for_one_window_is_one_line_before_any_step(tmp_path):
    (tmp_path / "short.txt").write_text(SHAKESPEARE[:3000])
    prepare(
        "short",
        text=tmp_path / "short.txt",
        tokenizer="char",
        root=str(tmp_path),
        val_fraction=0.01,
    )
    proc = in_process(train.main, *tiny_args(tmp_path, tmp_path, "--dataset", "short"))
    assert "val.bin holds 30 tokens, not a block of 32 and one more" in one_error_line(proc)
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_a_model_that_cannot_fit_is_refused_before_it_is_made(tmp_path, data_root):
    # Its masks alone are 4 x 10 GB: made first, they would fail as the allocator's error.
    flags = "--block-size 100000 --batch-size 16 --dtype bfloat16 --config small".split()
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
    proc = script("train.py", *tiny_args(tmp_path, data_root, *flags), preexec_fn=limit)
    line = one_error_line(proc)
    assert re.match(r"error: this run needs at least \d{5}\.\d GiB, and ", line)
    assert line.endswith(
        "GiB of cpu memory is free; use a smaller --batch-size, --block-size or model"
    )
    assert written(tmp_path / "run") == {}


@pytest.mark.parametrize(
    "files, refused",
    [
        ({"notes.txt": "mine", "data.csv": "1,2"}, "files no run wrote (data.csv, notes.txt)"),
        ({"metrics.jsonl": "mine", "loss.png": "mine"}, "files no run wrote (loss.png, metrics"),
        ({"config.json": '{"mine": true}'}, "files no run wrote (config.json)"),  # a user's
        ({"best.pt": "weights"}, "files no run wrote (best.pt)"),
        (None, "a trained run"),  # its best.pt, without its ckpt.pt
    ],
)
def test_a_run_folder_of_other_files_or_in_use_is_refused_and_left_as_it_was(
    tmp_path, data_root, trained, files, refused
):
    folder = tmp_path / "run"
    if files is None:
        shutil.copytree(trained, folder)
        (folder / "ckpt.pt").unlink()
    else:
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
    before = contents(folder)
    line = one_error_line(in_process(train.main, *tiny_args(tmp_path, data_root)))
    assert line.startswith(f"error: {folder} holds {refused}") and contents(folder) == before
    (tmp_path / "locked").mkdir()
    with FileLock(tmp_path / "locked" / ".lock"):  # as a first run holds it
        argv = tiny_args(tmp_path, data_root, "--out-dir", tmp_path / "locked")
        line = one_error_line(in_process(train.main, *argv))
    assert written(tmp_path / "locked") == {} and line.endswith(
        "is in use by another run; wait for it, or pick another --out-dir"
    )


@pytest.mark.parametrize(
    "error, code, err",
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried 20 GiB\nSee"),
            2,
            OOM + "CUDA out of memory. Tried 20 GiB",
        ),
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: 1e10 bytes"),
            2,
            OOM + "DefaultCPUAllocator: can't allocate memory: 1e10 bytes",
        ),
        (
            RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
            None,
            None,
        ),  # a bug: its traceback
        (UserError("every process finds it\nand a second line"), 2, "every process finds it"),
        (KeyboardInterrupt(), 130, None),
    ],
)
def test_run_turns_a_mistake_or_out_of_memory_into_one_line_and_ctrl_c_into_130(
    tmp_path, data_root, monkeypatch, capsys, error, code, err
):
    def forward(*args, **kwargs):
        raise error

    monkeypatch.setattr(GPT, "forward", forward)
    sigpipe = signal.getsignal(signal.SIGPIPE)  # run() sets its default, which pytest must get back
    try:
        # in a run, and on another rank, whose line is not printed
        for rank, main in ("0", lambda: train.main(tiny_args(tmp_path, data_root))), ("1", forward):
            monkeypatch.setenv("RANK", rank)
            with pytest.raises(SystemExit if code else RuntimeError) as e:
                run(main)
            printed = capsys.readouterr().err
            assert code is None or e.value.code == code
            assert "Traceback" not in printed and "error:" not in printed * (err is None)
            lines = [line for line in printed.splitlines() if line.startswith("error")]
            assert lines == [f"error: {err}"] * (err is not None and rank == "0")
    finally:
        signal.signal(signal.SIGPIPE, sigpipe)
    assert "\ninterrupted\n" in printed or code != 130


@pytest.mark.parametrize(
    "shell, out, error",
    [
        (
            "python sample.py --out-dir RUN --prompt 'ROMEO\\n' --max-new-tokens 5000 --seed 1 "
            "--device cpu | head -1; echo status ${PIPESTATUS[0]}",
            "ROMEO\nstatus 141\n",
            None,
        ),  # SIGPIPE, quietly
        (
            "PYTHONIOENCODING=ascii python sample.py --out-dir RUN --prompt é☃ --max-new-tokens 40",
            "\\xe9\\u2603",
            None,
        ),
        ("python sample.py --out-dir RUN --max-new-tokens 5 >&-", "", None),  # stdout closed
        (
            "python sample.py --out-dir RUN --prompt - <&-",
            "",
            "--prompt - reads stdin, which is closed",
        ),
        (
            "WORLD_SIZE=2 python train.py --config tiny --device cpu --out-dir RUN/new",
            "",
            "WORLD_SIZE=2 is set",
        ),
        ("python sample.py --out-dir NAN --max-new-tokens 5", "", "its weights hold nan or inf"),
    ],
)
def test_streams_a_terminal_a_stray_world_size_and_nan_weights(
    shell, out, error, tmp_path, trained
):
    checkpoint = load_checkpoint(trained)
    checkpoint["model"]["transformer.wte.weight"][0, 0] = float("nan")
    torch.save(checkpoint, tmp_path / "nan.pt")
    words = {"python": shlex.quote(sys.executable), "RUN": trained, "NAN": tmp_path / "nan.pt"}
    shell = fill(shell + " --seed 1 --device cpu" * ("sample" in shell and "|" not in shell), words)
    proc = subprocess.run(
        ["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if error:
        assert error in one_error_line(proc)
    else:
        assert proc.returncode == 0 and proc.stdout.startswith(out) and proc.stdout.isascii()
        assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr
    assert not (trained / "new").exists()


@pytest.mark.slow
def test_a_mistake_every_process_finds_is_printed_once_under_torchrun(tmp_path, data_root):
    argv = tiny_args(tmp_path, data_root, "--tokens-per-step", 100)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = script(*torchrun, "train.py", *argv, env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].endswith("block_size x processes (256)")
    assert (
        proc.stdout.startswith("cpu, 1 thread, 2 processes, ") and written(tmp_path / "run") == {}
    )


AS_ON_WINDOWS = """
import runpy, signal, sys
sys.modules["fcntl"] = None  # import fcntl fails, as on Windows
del signal.SIGPIPE, signal.SIGUSR1
for line in sys.argv[1:]:  # each a command: script and flags
    sys.argv = line.split()
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        assert not e.code, e.code
"""


def test_both_scripts_start_without_posix_only_modules_and_signals(tmp_path, data_root):
    trained = " ".join(["train.py", *tiny_args(tmp_path, data_root, "--max-iters", 2)])
    sampled = f"sample.py --out-dir {tmp_path / 'run'} --max-new-tokens 5"
    proc = script("-c", AS_ON_WINDOWS, trained, sampled)
    assert proc.returncode == 0 and (tmp_path / "run" / "ckpt.pt").is_file(), proc.stderr[-2000:]
    assert not proc.stdout.endswith("loss.png\n")  # the sample came after train.py's last line


@pytest.mark.parametrize("how", [shutil.copytree, shutil.move])
def test_a_copied_or_moved_run_folder_resumes_where_it_is_and_writes_nowhere_else(
    tmp_path, trained, how
):
    original = tmp_path / "original"
    shutil.copytree(trained, original)
    before = contents(original)
    how(original, tmp_path / "elsewhere")
    resumed = train.train(
        parse_args(["--config", str(tmp_path / "elsewhere"), "--resume", "--max-iters", "4"])
    )
    assert resumed["step"] == 4 and load_checkpoint(tmp_path / "elsewhere")["state"]["step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["elsewhere"] + ["original"] * (how is shutil.copytree)
    assert how is shutil.move or contents(original) == before


DAMAGE = ["empty", "cut short", "another shape", "wrong magic"]


def damaged(data: bytes, how: str, kind: str) -> bytes:
    """A file's bytes, damaged: emptied, cut short, replaced by valid JSON (or a checkpoint) of
    another shape, or given another file's first bytes (its magic)."""
    if how == "empty":
        return b""
    if how == "cut short":
        return data[: len(data) // 2]
    if how == "another shape" and kind.endswith(".pt"):  # a layer more than its weights hold
        path = Path(os.environ["TMPDIR"]) / "other.pt"
        checkpoint = torch.load(io.BytesIO(data), weights_only=True)
        checkpoint["model_config"]["n_layer"] += 1
        torch.save(checkpoint, path)
        return path.read_bytes()
    if how == "another shape":
        if kind == "config.json":  # a value of another type
            return b'{"max_iters": "80"}'
        return b'{"text": ["a list"]}\n' if "files" in kind else b'[{"step": "one"}, 2]\n'
    return b"\x1f\x8b\x08\x00" + data[4:]  # gzip's magic


# Each file the project writes and reads back, and each input file, by the command that reads it.
# RUN is a 2-step run, DATA its dataset's folder, FILE the input file damaged.
READ_BY = {
    "ckpt.pt": ("RUN/ckpt.pt", "train.py --out-dir RUN --resume --data-root DATA/.."),
    "best.pt": ("RUN/best.pt", "sample.py --out-dir RUN --max-new-tokens 2"),
    "config.json": ("RUN/config.json", "train.py --out-dir RUN --resume"),
    "manifest.json": ("DATA/manifest.json", "train.py --out-dir RUN --resume --data-root DATA/.."),
    "train.bin": ("DATA/train.bin", "train.py --out-dir RUN --resume --data-root DATA/.."),
    "val.bin": ("DATA/val.bin", "train.py --out-dir RUN --resume --data-root DATA/.."),
    "metrics.jsonl": ("RUN/metrics.jsonl", "train.py --out-dir RUN --resume --max-iters 3"),
    "a --config file": ("FILE.toml", "train.py --config FILE.toml"),
    "a --text file": ("FILE.txt", "-m data.prepare --text FILE.txt --out-root DATA/.."),
    "a --files file": ("FILE.jsonl", "-m data.prepare --files FILE.jsonl --out-root DATA/.."),
    "a --hellaswag file": (
        "FILE.jsonl",
        "train.py --config RUN --eval-only --hellaswag FILE.jsonl",
    ),
}
# Damage that leaves a file valid: a TOML file may be empty, and text of any length or shape is
# text. metrics.jsonl is a log: a resume drops its damaged lines, as those a kill cut short.
VALID = {("a --text file", "another shape"), ("a --text file", "cut short")}
VALID |= {("metrics.jsonl", how) for how in DAMAGE}
CASES = [
    (kind, how) for kind in READ_BY for how in DAMAGE if (kind, how) != ("a --config file", "empty")
]


@pytest.mark.parametrize("kind, how", CASES)
def test_a_damaged_file_is_one_line_naming_it(tmp_path, trained, root, kind, how):
    """Every file the project writes and reads back, and every input file: one line naming it."""
    shutil.copytree(trained, tmp_path / "run")
    shutil.copytree(root / "mixed", tmp_path / "data" / "mixed")
    inputs = {
        "FILE.toml": b'base = "tiny"\nlr_schedule = "cosine"\n',
        "FILE.txt": MIXED.encode(),
        "FILE.jsonl": b"".join(b'{"text": "%d a line"}\n' % i for i in range(50)),
    }
    if kind == "a --hellaswag file":
        item = '{"ctx": "a b", "endings": ["a", "b", "c", "d"], "label": 1}\n'
        inputs["FILE.jsonl"] = item.encode()
    for name, data in inputs.items():
        (tmp_path / name).write_bytes(data)
    where = {
        "RUN": tmp_path / "run",
        "DATA": tmp_path / "data" / "mixed",
        "FILE": tmp_path / "FILE",
    }
    path, command = READ_BY[kind]
    for word, folder in where.items():
        path, command = path.replace(word, str(folder)), command.replace(word, str(folder))
    Path(path).write_bytes(damaged(Path(path).read_bytes(), how, kind))
    program, *argv = command.split()
    main = {"train.py": train.main, "sample.py": sample.main, "-m": prepare_main}[program]
    proc = in_process(main, *argv[program == "-m" :])
    if (kind, how) in VALID:
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        line = one_error_line(proc)
        assert Path(path).name in line and ("--config" in kind or "--config" not in line)


def test_a_run_of_a_config_file_resumes_with_it_and_says_what_changed(tmp_path, data_root):
    (tmp_path / "mine.toml").write_text(f'base = "tiny"\ndata_root = "{data_root}"\n')
    argv = ["--config", tmp_path / "mine.toml", "--out-dir", tmp_path / "run", "--max-iters"]
    assert in_process(train.main, *argv, 2).returncode == 0
    proc = in_process(train.main, *argv, 3, "--resume", "--sample-tokens", 0)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "settings changed since the checkpoint: max_iters 2 -> 3, sample_tokens" in proc.stdout


def test_a_folder_of_texts_reads_each_file_once_and_only_files(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "x.txt").mkdir(parents=True)  # a folder, named as a text
    (corpus / "a.txt").write_text(SHAKESPEARE[:2000])
    (corpus / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    (corpus / "up").symlink_to(corpus)  # a loop
    folder = prepare(text=str(corpus), tokenizer="char", root=str(tmp_path / "out"), quiet=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["train_tokens"] + manifest["val_tokens"] == 2002  # the text and "\n\n"
