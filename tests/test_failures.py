"""Bad input at the scripts' boundary is one `error:` line, exit 2, and nothing written or lost.

Mistakes and damaged files are tables of commands run in this process (conftest.in_process); the
streams, torchrun and the memory limit need a process of their own.
"""

import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import ROOT, in_process, one_error_line, rows, script, tiny_args
from filelock import FileLock

import sample
import train
from configs import UserError, run
from data.prepare import main as prepare_main
from data.prepare import prepare
from model.checkpoint import load_checkpoint
from model.gpt import GPT

SHAKESPEARE = (ROOT / "data/corpora/tinyshakespeare/input.txt").read_text()
MIXED = SHAKESPEARE[:20000] + "é à ü ñ ☃\n" * 50  # a char vocabulary beyond ASCII


def contents(folder):
    """A folder's files but the lock a run held; {} where there is no folder."""
    return {p.name: p.read_bytes() for p in folder.glob("*") if p.name != ".lock"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A data root with `mixed` (char, with non-ASCII characters), `bpe` (GPT-2's tokens), `short`
    (a val split of 30 tokens), and other/mixed (other text under `mixed`'s name)."""
    root = tmp_path_factory.mktemp("prepared")
    for name, text, folder in (
        ("mixed", MIXED, ""),
        ("bpe", SHAKESPEARE[:20000], ""),  # GPT-2's tokens
        ("short", SHAKESPEARE[:3000], ""),  # a val split too short for one window
        ("mixed", SHAKESPEARE[:20000], "other"),  # other text, under the same name
    ):
        (file := root / f"{name}.txt").write_text(text)
        prepare(
            name,
            text=file,
            tokenizer="gpt2" if name == "bpe" else "char",
            root=root / folder,
            val_fraction=0.01,
        )
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, root) -> Path:
    """A tiny char run on `mixed`, trained for 2 steps (AdamW): its folder; beside it nan.pt, its
    checkpoint with a nan weight."""
    parent = tmp_path_factory.mktemp("trained")
    in_process(train.main, *tiny_args(parent, root, "--dataset", "mixed", "--max-iters", 2))
    checkpoint = load_checkpoint(parent / "run")
    checkpoint["model"]["transformer.wte.weight"][0, 0] = float("nan")
    torch.save(checkpoint, parent / "nan.pt")
    return parent / "run"


def fill(text, words):
    """A table's text with its capitals (TINY: the tiny run's flags; folders) filled in."""
    for word, value in words.items():
        text = text.replace(word, str(value))
    return text


def launch(line, words):
    """A table's command line, its capitals filled in, run in this process."""
    program, *argv = shlex.split(fill(line, words))
    main = {"train.py": train.main, "sample.py": sample.main, "-m": prepare_main}[program]
    return in_process(main, *argv[program == "-m" :])


OOM = "out of memory; use a smaller --batch-size or model: "
# A command | its one line; "..." stands for any text. TINY is the tiny run's flags, RUN is empty,
# TRAINED a 2-step run on ROOT's `mixed`, DATA holds shakespeare_char.
MISTAKES = f"""train.py TINY --max-iter 5 | error: unrecognized arguments: --max-iter 5
train.py TINY --compile false | error: unrecognized arguments: false
train.py TINY --lr nan | error: --lr nan: expected a finite number, at least 0
train.py --config smal | error: --config smal: ...small? give a preset \
(finetune_gpt2, gpt2, shakespeare_gpu, small, tiny)...
train.py TINY --dataset nope | error: no dataset 'nope' in DATA; prepare it (...give the \
--data-root...
train.py TINY --resume | error: no checkpoint at RUN/ckpt.pt; train one first...
train.py TINY --eval-only | error: no checkpoint at RUN/ckpt.pt; train one first...
train.py TINY --eval-only --out-dir ROOT/other | error: no checkpoint at ROOT/other/ckpt.pt; ...
train.py TINY --out-dir TRAINED/config.json/run | error: cannot write in TRAINED/config.json/run \
(Not a directory); pick another --out-dir
train.py TINY --vocab-size 10 | error: the model's vocabulary (10) is smaller than its...
train.py TINY --tokens-per-step 100 | ...not a multiple of ... x processes (128)
train.py TINY --data-root ROOT --dataset short | ...val.bin holds 30 tokens, not a block of 32 \
and one more...
train.py TINY --data-root ROOT --dataset bpe --init-from TRAINED | error: TRAINED was...
train.py TINY --data-root ROOT --dataset mixed --init-from TRAINED --block-size 64 | error: \
--block-size 64 is longer than the model's context (32); lower it
train.py TINY --data-root ROOT --dataset mixed --out-dir TRAINED --resume --optimizer muon | \
error: cannot resume TRAINED: its optimizer state does not fit...--init-from TRAINED
train.py TINY --data-root ROOT/other --dataset mixed --out-dir TRAINED --resume | error: cannot \
resume TRAINED: dataset mixed is not the data...--init-from TRAINED --out-dir NEW
train.py TINY --data-root ROOT --dataset mixed --out-dir TRAINED | ...holds a trained run;...
-m data.prepare shakespeare_char --out-root DATA/shakespeare_char/val.bin | error: cannot make \
DATA/shakespeare_char/val.bin: ...; give another --out-root
sample.py --out-dir RUN | error: no checkpoint at RUN/ckpt.pt; ...writes out/small)
sample.py --out-dir TRAINED --prompt 'R: Ωμ' | error: prompt 'R: Ωμ': 'Ωμ': not in this \
model's {len(set(MIXED))} characters
sample.py --out-dir TRAINED/../nan.pt | ...its weights hold nan or inf..."""
# ROOT/other/mixed is `mixed` prepared again, of other text. sample.py's bad values:
# test_sample.py's REFUSED.


@pytest.mark.parametrize("line, message", rows(MISTAKES))
def test_a_mistake_is_one_line_and_writes_nothing(
    tmp_path, data_root, trained, root, line, message
):
    words = {
        "TINY": "--config tiny --device cpu --sample-tokens 0 --data-root DATA --out-dir RUN",
        "TRAINED": trained,
        "RUN": tmp_path / "run",
        "DATA": data_root,
        "ROOT": root,
    }
    before = contents(trained)
    proc = launch(line, words)
    pattern = ".*".join(map(re.escape, fill(message, words).split("...")))  # "...": any text
    assert re.fullmatch(pattern, one_error_line(proc))
    assert contents(tmp_path / "run") == {} and not (data_root / "nope").exists()
    assert contents(trained) == before and (line.startswith("train") or proc.stdout == "")


def test_a_model_that_cannot_fit_is_refused_before_it_is_made(tmp_path, data_root):
    # Its masks alone are 4 x 10 GB: made first, they would fail as the allocator's error.
    flags = "--block-size 100000 --batch-size 16 --dtype bfloat16 --config small".split()
    proc = script(
        "train.py",
        *tiny_args(tmp_path, data_root, *flags),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2**32, 2**32)),  # 4 GiB
    )
    assert re.fullmatch(
        r"error: this run needs at least \d{5}\.\d GiB, and .*GiB of cpu memory is free; "
        "use a smaller --batch-size, --block-size or model",
        one_error_line(proc),
    )
    assert contents(tmp_path / "run") == {}


# A run folder's files | the start of its refusal. TRAINED: a trained run's files, without its
# ckpt.pt; none: an empty folder, locked as a first run holds it.
FOLDERS = """notes.txt data.csv | holds files no run wrote (data.csv, notes.txt)
metrics.jsonl loss.png | holds files no run wrote (loss.png, metrics
config.json | holds files no run wrote (config.json)
best.pt | holds files no run wrote (best.pt)
TRAINED | holds a trained run
 | is in use by another run; wait for it, or pick another --out-dir"""


@pytest.mark.parametrize("names, refused", rows(FOLDERS))
def test_a_run_folder_of_other_files_or_in_use_is_refused_and_left_as_it_was(
    tmp_path, data_root, trained, names, refused
):
    folder = tmp_path / "run"
    folder.mkdir()
    mine = dict.fromkeys(names.split(), b'{"mine": true}')  # a user's config.json, not a run's
    for name, data in (contents(trained) if names == "TRAINED" else mine).items():
        (folder / name).write_bytes(data)
    (folder / "ckpt.pt").unlink(missing_ok=True)
    before = contents(folder)
    with nullcontext() if names else FileLock(folder / ".lock"):  # as a first run holds it
        line = one_error_line(in_process(train.main, *tiny_args(tmp_path, data_root)))
    assert line.startswith(f"error: {folder} {refused}") and contents(folder) == before


@pytest.mark.parametrize(
    "error, code, err",
    [  # err: the line's start, before the error's first line; None: no line
        (torch.OutOfMemoryError("CUDA out of memory. Tried 20 GiB\nSee"), 2, OOM),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: 1e10 bytes"), 2, OOM),
        (
            RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
            None,
            None,
        ),  # a bug: its traceback
        (UserError("every process finds it\nand a second line"), 2, ""),
        (KeyboardInterrupt(), 130, None),
    ],
)
def test_run_turns_a_mistake_or_out_of_memory_into_one_line_and_ctrl_c_into_130(
    tmp_path, data_root, monkeypatch, capsys, error, code, err
):
    def forward(*_):
        raise error

    monkeypatch.setattr(GPT, "forward", forward)
    # in a run, and on another rank, whose line is not printed
    for rank, main in ("0", lambda: train.main(tiny_args(tmp_path, data_root))), ("1", forward):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit if code else RuntimeError) as e:
            run(main)
        printed = capsys.readouterr().err
        assert code is None or e.value.code == code
        assert "Traceback" not in printed
        line = f"error: {err}{error}".split("\n")[0]  # and the error's first line
        # the line, and nothing after it
        assert re.findall(r"^error[\s\S]*", printed, re.M) == [f"{line}\n"] * (
            err is not None and rank == "0"
        )
    assert "\ninterrupted\n" in printed or code != 130


# a shell command => the start of its stdout, or of its one error line: SIGPIPE, quietly (141); a
# terminal that cannot encode é☃; stdout closed; stdin closed; WORLD_SIZE set without torchrun
STREAMS = """python sample.py --out-dir RUN --prompt 'ROMEO\\n' --max-new-tokens 5000 --seed 1 \
--device cpu | head -c 5; echo " status ${PIPESTATUS[0]}" => ROMEO status 141
PYTHONIOENCODING=ascii python sample.py --out-dir RUN --prompt é☃ --max-new-tokens 40 --seed 1 \
--device cpu => \\xe9\\u2603
python sample.py --out-dir RUN --max-new-tokens 5 --seed 1 --device cpu >&- =>
python sample.py --out-dir RUN --prompt - --seed 1 --device cpu <&- => error: --prompt - reads \
stdin, which is closed
WORLD_SIZE=2 python train.py --config tiny --device cpu --out-dir RUN/new => error: WORLD_SIZE=2 \
is set"""


@pytest.mark.parametrize("row", STREAMS.splitlines())
def test_streams_a_terminal_and_a_stray_world_size(row, trained):
    shell, out = map(str.strip, row.split("=>"))
    shell = fill(shell, {"python": shlex.quote(sys.executable), "RUN": trained})
    proc = subprocess.run(
        ["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if out.startswith("error: "):
        assert one_error_line(proc).startswith(out)
    else:
        assert proc.returncode == 0 and proc.stdout.startswith(out) and proc.stdout.isascii()
        assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr
    assert not (trained / "new").exists()


@pytest.mark.slow
def test_a_mistake_every_process_finds_is_printed_once_under_torchrun(
    tmp_path, data_root, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    proc = script(
        *"-m torch.distributed.run --standalone --nproc_per_node=2 train.py".split(),
        *tiny_args(tmp_path, data_root, "--tokens-per-step", 100),
    )
    errors = re.findall("^error: .*", proc.stderr, re.M)
    assert len(errors) == 1 and errors[0].endswith("block_size x processes (256)")
    assert (
        proc.stdout.startswith("cpu, 1 thread, 2 processes, ") and contents(tmp_path / "run") == {}
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


def test_both_scripts_start_without_posix_only_modules_and_a_config_files_run_resumes_with_it(
    tmp_path, data_root
):
    (tmp_path / "mine.toml").write_text(
        f'base = "tiny"\ndata_root = "{data_root}"\nthreads = 1\nsample_tokens = 4\n'
    )
    run = f"train.py --config {tmp_path / 'mine.toml'} --out-dir {tmp_path / 'run'} --max-iters"
    proc = script(
        "-c",
        AS_ON_WINDOWS,
        f"{run} 2",
        f"{run} 3 --resume --sample-tokens 0",
        f"sample.py --out-dir {tmp_path / 'run'} --max-new-tokens 5",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "settings changed since the checkpoint: max_iters 2 -> 3, sample_tokens" in proc.stdout
    assert not proc.stdout.endswith("loss.png\n")  # the sample came after train.py's last line


@pytest.mark.parametrize("how", [shutil.copytree, shutil.move])
def test_a_copied_or_moved_run_folder_resumes_where_it_is_and_writes_nowhere_else(
    tmp_path, trained, how
):
    original = shutil.copytree(trained, tmp_path / "original")
    elsewhere = how(original, tmp_path / "elsewhere")
    resumed = in_process(train.main, *f"--config {elsewhere} --resume --max-iters 4".split())
    assert resumed.returncode == 0 and load_checkpoint(elsewhere)["state"]["step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["elsewhere"] + ["original"] * (how is shutil.copytree)
    assert how is shutil.move or contents(original) == contents(trained)


DAMAGE = "empty,cut short,another shape,wrong magic".split(",")


# Each file the project writes and reads back, and each input file | its path | the damage that
# leaves it valid | what reads it. RUN is a 2-step run, DATA its dataset's folder, FILE the input
# file damaged. Text of any length or shape is text; metrics.jsonl is a log: a resume drops its
# damaged lines, as those a kill cut short.
READ_BY = """ckpt.pt | RUN/ckpt.pt | none | train.py --out-dir RUN --resume --data-root DATA/..
best.pt | RUN/best.pt | none | sample.py --out-dir RUN --max-new-tokens 2
config.json | RUN/config.json | none | train.py --out-dir RUN --resume
manifest.json | DATA/manifest.json | none | train.py --out-dir RUN --resume --data-root DATA/..
train.bin | DATA/train.bin | none | train.py --out-dir RUN --resume --data-root DATA/..
val.bin | DATA/val.bin | none | train.py --out-dir RUN --resume --data-root DATA/..
metrics.jsonl | RUN/metrics.jsonl | empty, cut short, another shape, wrong magic | train.py \
--out-dir RUN --resume --max-iters 3
a --config file | FILE.toml | none | train.py --config FILE.toml
a --text file | FILE.txt | cut short, another shape | -m data.prepare --text FILE.txt \
--out-root DATA/..
a --files file | FILE.jsonl | none | -m data.prepare --files FILE.jsonl --out-root DATA/..
a --hellaswag file | FILE.jsonl | none | train.py --config RUN --eval-only --hellaswag FILE.jsonl"""
READ_BY = {kind: read for kind, *read in rows(READ_BY)}
INPUTS = {  # the input files' bytes, before the damage
    "a --config file": b'base = "tiny"\nlr_schedule = "cosine"\n',
    "a --text file": MIXED.encode(),
    "a --files file": b"".join(b'{"text": "%d a line"}\n' % i for i in range(50)),
    "a --hellaswag file": b'{"ctx": "a b", "endings": ["a", "b", "c", "d"], "label": 1}\n',
}
# an empty TOML file is valid too: all the defaults, a run of minutes
CASES = [
    (kind, how) for kind in READ_BY for how in DAMAGE if (kind, how) != ("a --config file", "empty")
]


@pytest.mark.parametrize("kind, how", CASES)
def test_a_damaged_file_is_one_line_naming_it(tmp_path, trained, root, kind, how):
    """Every file the project writes and reads back, and every input file: one line naming it."""
    where = {
        "RUN": shutil.copytree(trained, tmp_path / "run"),
        "DATA": shutil.copytree(root / "mixed", tmp_path / "data/mixed"),
        "FILE": tmp_path / "FILE",
    }
    file, valid, line = READ_BY[kind]
    path = Path(fill(file, where))
    data = INPUTS.get(kind) or path.read_bytes()
    if how == "another shape" and kind.endswith(".pt"):  # a layer more than its weights hold
        checkpoint = torch.load(path, weights_only=True)
        checkpoint["model_config"]["n_layer"] += 1
        torch.save(checkpoint, path)
    else:  # emptied, cut short, valid JSON of another shape, or another file's magic (gzip's)
        shape = {"config.json": b'{"max_iters": "80"}', "a --files file": b'{"text": ["a list"]}\n'}
        damaged = [
            b"",
            data[: len(data) // 2],
            shape.get(kind, b'[{"step": "one"}, 2]\n'),
            b"\x1f\x8b\x08\x00" + data[4:],
        ]
        path.write_bytes(damaged[DAMAGE.index(how)])
    proc = launch(line, where)
    if how in valid:
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        line = one_error_line(proc)
        assert path.name in line and ("--config" in kind or "--config" not in line)
