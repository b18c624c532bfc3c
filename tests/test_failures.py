"""Bad input at the scripts' boundary is one `error:` line, exit 2, and nothing written.

Each mistake is tried as a user would make it: no traceback, nothing in the run folder but its
lock; and the streams: a pipe that closes early, a terminal that cannot encode the text.

Most tests run train.py or sample.py as a user does (conftest.script); out of memory is faked in
this process, around configs.run as the scripts call it.
"""

import math
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
from conftest import ROOT, in_process, one_error_line, script, tiny, tiny_args
from filelock import FileLock

import sample
import train
from configs import parse_args, run
from data.prepare import main as prepare_main
from data.prepare import prepare
from model.checkpoint import load_checkpoint
from model.gpt import GPT

SHAKESPEARE = (ROOT / "data/corpora/tinyshakespeare/input.txt").read_text()
MIXED = SHAKESPEARE[:20000] + "é à ü ñ ☃\n" * 50  # a char vocabulary beyond ASCII


def written(folder: Path) -> list[str]:
    """What a refused run left in its folder, besides the lock it held: nothing, it should be."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.exists() else []


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A data root with `mixed` (char, with non-ASCII characters) and `bpe` (GPT-2's tokens)."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "mixed.txt").write_text(MIXED)
    prepare("mixed", text=root / "mixed.txt", tokenizer="char", root=str(root), quiet=True)
    (root / "bpe.txt").write_text(SHAKESPEARE[:20000])
    prepare("bpe", text=root / "bpe.txt", tokenizer="gpt2", root=str(root), quiet=True)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, root) -> Path:
    """A tiny char run on `mixed`, trained for 2 steps (AdamW): its folder, parent/run."""
    parent = tmp_path_factory.mktemp("trained")
    train.train(tiny(parent, root, dataset="mixed", max_iters=2, eval_interval=2))
    return parent / "run"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-iter", "5"], "error: unrecognized arguments: --max-iter 5"),
        (["--compile", "false"], "error: unrecognized arguments: false"),
        (["--lr", "nan"], "error: --lr nan: expected a finite number, at least 0"),
    ],
)
def test_a_bad_flag_is_one_line_and_writes_nothing(tmp_path, data_root, argv, message):
    line = one_error_line(in_process(train.main, *tiny_args(tmp_path, data_root, *argv)))
    assert line == message
    assert not (tmp_path / "run").exists()


def test_a_config_file_that_is_not_toml_is_one_line(tmp_path):
    (tmp_path / "mine.toml").write_text("max_iters = = 3\n")
    line = one_error_line(in_process(train.main, "--config", tmp_path / "mine.toml"))
    assert line.startswith(f"error: --config {tmp_path / 'mine.toml'}: Invalid value")


def test_an_unknown_preset_is_one_line_listing_the_presets():
    line = one_error_line(in_process(train.main, "--config", "smal"))
    assert line.startswith("error: --config smal: ")
    assert line.endswith(
        "give a preset (finetune_gpt2, gpt2, shakespeare_gpu, small, tiny) or a .toml file"
    )


def test_a_dataset_not_prepared_is_one_line_saying_how(tmp_path, data_root):
    line = one_error_line(
        in_process(train.main, *tiny_args(tmp_path, data_root, "--dataset", "nope"))
    )
    assert line.startswith(
        f"error: no dataset 'nope' in {data_root}; prepare it (python -m data.prepare"
    )
    assert not (data_root / "nope").exists() and written(tmp_path / "run") == []


def test_resume_without_a_checkpoint_is_one_line(tmp_path, data_root):
    line = one_error_line(in_process(train.main, *tiny_args(tmp_path, data_root, "--resume")))
    assert line.startswith(
        f"error: no checkpoint at {tmp_path / 'run' / 'ckpt.pt'}; train one first"
    )
    assert written(tmp_path / "run") == []


def test_resume_after_the_dataset_was_prepared_again_is_refused(tmp_path):
    root = tmp_path / "prepared"
    root.mkdir()
    (root / "mini.txt").write_text(SHAKESPEARE[:3000])
    prepare("mini", text=root / "mini.txt", tokenizer="char", root=str(root), quiet=True)
    train.train(tiny(tmp_path, root, dataset="mini", max_iters=2, eval_interval=2))
    (root / "mini.txt").write_text(SHAKESPEARE[3000:6000])  # other text: other ids
    prepare("mini", text=root / "mini.txt", tokenizer="char", root=str(root), quiet=True)
    before = contents(tmp_path / "run")
    line = one_error_line(
        in_process(train.main, *tiny_args(tmp_path, root, "--dataset", "mini", "--resume"))
    )
    run_dir = tmp_path / "run"
    assert line.startswith(
        f"error: cannot resume {run_dir}: dataset mini is not the data it trained"
    )
    assert line.endswith(f"a new run from its weights: --init-from {run_dir} --out-dir NEW")
    assert contents(run_dir) == before


def test_resume_with_another_optimizer_is_refused(trained, root):
    before = contents(trained)
    argv = tiny_args(trained.parent, root, "--dataset", "mixed", "--resume", "--optimizer", "muon")
    line = one_error_line(in_process(train.main, *argv))
    assert line.startswith(f"error: cannot resume {trained}: its optimizer state does not fit")
    assert line.endswith(f"resume with the --optimizer it had, or use --init-from {trained}")
    assert contents(trained) == before


def test_init_from_a_run_of_another_tokenizer_is_refused(tmp_path, trained, root):
    argv = tiny_args(tmp_path, root, "--dataset", "bpe", "--init-from", trained)
    line = one_error_line(in_process(train.main, *argv))
    assert line == (
        f"error: {trained} was trained with another tokenizer than dataset bpe's: "
        "its token ids would mean other text"
    )
    assert written(tmp_path / "run") == []


def test_a_block_size_longer_than_the_init_from_models_is_refused(tmp_path, trained, root):
    argv = tiny_args(
        tmp_path, root, "--dataset", "mixed", "--init-from", trained, "--block-size", 64
    )
    line = one_error_line(in_process(train.main, *argv))
    assert line == "error: --block-size 64 is longer than the model's context (32); lower it"
    assert written(tmp_path / "run") == []


def test_a_vocab_size_below_the_tokenizers_is_refused(tmp_path, data_root):
    line = one_error_line(
        in_process(train.main, *tiny_args(tmp_path, data_root, "--vocab-size", 10))
    )
    assert line == (
        "error: the model's vocabulary (10) is smaller than its tokenizer's (65); "
        "train one with --vocab-size 65 or more"
    )
    assert written(tmp_path / "run") == []


def test_tokens_per_step_not_a_multiple_is_refused(tmp_path, data_root):
    line = one_error_line(
        in_process(train.main, *tiny_args(tmp_path, data_root, "--tokens-per-step", 100))
    )
    assert line == (
        "error: --tokens-per-step 100 is not a multiple of batch_size x block_size x "
        "processes (128)"
    )
    assert written(tmp_path / "run") == []


def limit_memory():
    """In the child: 4 GiB of address space, far below what the model would take."""
    resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))


def test_a_model_that_cannot_fit_is_refused_before_it_is_made(tmp_path, data_root):
    argv = [
        "--config",
        "small",
        "--device",
        "cpu",
        "--data-root",
        data_root,
        "--block-size",
        100000,
        "--batch-size",
        16,
        "--dtype",
        "bfloat16",  # the figure below does not depend on the CPU
    ]
    proc = script("train.py", *argv, "--out-dir", tmp_path / "run", preexec_fn=limit_memory)
    line = one_error_line(proc)
    # its masks alone are 4 x 10 GB: made first, they would fail as the allocator's error
    assert re.match(r"error: this run needs at least \d{5}\.\d GiB, and ", line)
    assert line.endswith(
        "GiB of cpu memory is free; use a smaller --batch-size, --block-size or model"
    )
    assert written(tmp_path / "run") == []


def test_a_fresh_run_over_a_trained_one_is_refused(trained, root):
    before = contents(trained)
    line = one_error_line(
        in_process(train.main, *tiny_args(trained.parent, root, "--dataset", "mixed"))
    )
    assert line == (
        f"error: {trained} holds a trained run; continue it with --resume, or start another "
        "with --out-dir"
    )
    assert contents(trained) == before


def test_a_run_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path, data_root):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "data.csv").write_text("1,2")
    (folder / "metrics.jsonl").write_text("a run's name, the user's file")
    line = one_error_line(in_process(train.main, *tiny_args(tmp_path, data_root)))
    assert (
        line == f"error: {folder} holds files no run wrote (data.csv, notes.txt); "
        "pick another --out-dir"
    )
    assert written(folder) == ["data.csv", "metrics.jsonl", "notes.txt"]
    assert (folder / "metrics.jsonl").read_text() == "a run's name, the user's file"
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_second_run_on_a_run_folder_in_use_is_refused(tmp_path, data_root):
    (tmp_path / "run").mkdir()
    with FileLock(tmp_path / "run" / ".lock"):  # as the first run holds it
        line = one_error_line(in_process(train.main, *tiny_args(tmp_path, data_root)))
    assert line == (
        f"error: {tmp_path / 'run'} is in use by another run; wait for it, "
        "or pick another --out-dir"
    )
    assert written(tmp_path / "run") == []


@pytest.fixture
def entry(monkeypatch):
    """configs.run as a script calls it, in this process: it sets SIGPIPE's default, which pytest
    must get back; its exit status is returned."""
    monkeypatch.delenv("RANK", raising=False)
    sigpipe = signal.getsignal(signal.SIGPIPE)

    def call(main) -> int:
        try:
            with pytest.raises(SystemExit) as e:
                run(main)
        finally:
            signal.signal(signal.SIGPIPE, sigpipe)
        return e.value.code

    return call


def error_lines(capsys) -> list[str]:
    """stderr's `error` lines (tqdm's bar is there too), and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error")]


def fail_forward(monkeypatch, error: Exception):
    def forward(*args, **kwargs):
        raise error

    monkeypatch.setattr(GPT, "forward", forward)


def test_out_of_memory_is_one_line(tmp_path, data_root, monkeypatch, capsys, entry):
    oom = "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)\nSee the docs"
    fail_forward(monkeypatch, torch.OutOfMemoryError(oom))
    assert entry(lambda: train.train(tiny(tmp_path, data_root))) == 2
    assert error_lines(capsys) == [
        "error: out of memory; use a smaller --batch-size or model: CUDA out of memory. "
        "Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)"
    ]


def test_the_cpu_allocators_failure_is_out_of_memory_too(
    tmp_path, data_root, monkeypatch, capsys, entry
):
    cpu = (
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 10000000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    fail_forward(monkeypatch, RuntimeError(cpu))
    assert entry(lambda: train.train(tiny(tmp_path, data_root))) == 2
    assert error_lines(capsys) == [
        f"error: out of memory; use a smaller --batch-size or model: {cpu}"
    ]


def test_another_runtime_error_keeps_its_traceback(tmp_path, data_root, monkeypatch, capsys):
    fail_forward(monkeypatch, RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    sigpipe = signal.getsignal(signal.SIGPIPE)
    try:
        with pytest.raises(RuntimeError, match="mat1 and mat2"):
            run(lambda: train.train(tiny(tmp_path, data_root)))
    finally:
        signal.signal(signal.SIGPIPE, sigpipe)
    assert "error:" not in capsys.readouterr().err


def test_a_user_error_on_another_rank_is_not_printed(monkeypatch, capsys, entry):
    from configs import UserError

    def main():
        raise UserError("every process finds it\nand a second line")

    assert entry(main) == 2
    assert capsys.readouterr().err == "error: every process finds it\n"
    monkeypatch.setenv("RANK", "1")
    assert entry(main) == 2
    assert capsys.readouterr().err == ""


def test_ctrl_c_exits_130(capsys, entry):
    def main():
        raise KeyboardInterrupt

    assert entry(main) == 130
    assert capsys.readouterr().err == "\ninterrupted\n"


def test_sample_into_head_ends_quietly(trained):
    command = shlex.join(
        [sys.executable, "sample.py", "--out-dir", str(trained), "--prompt", r"ROMEO\n"]
        + ["--max-new-tokens", "5000", "--seed", "1", "--device", "cpu"]
    )
    done = subprocess.run(
        ["bash", "-c", f"{command} | head -1; echo status ${{PIPESTATUS[0]}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # head left after its line; the next write ended sample.py by SIGPIPE (128 + 13), quietly
    assert done.stdout == "ROMEO\nstatus 141\n", done.stderr
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr


def test_text_the_terminal_cannot_encode_is_escaped(trained):
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    argv = ["--out-dir", trained, "--prompt", "é☃", "--max-new-tokens", 40, "--seed", 1]
    done = script("sample.py", *argv, "--device", "cpu", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("\\xe9\\u2603") and done.stdout.isascii()


def test_a_mistake_every_process_finds_is_printed_once_under_torchrun(tmp_path, data_root):
    argv = tiny_args(tmp_path, data_root, "--tokens-per-step", 100)
    done = script(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        *argv,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: --tokens-per-step 100 is not a multiple of batch_size x block_size x "
        "processes (256)"
    ], done.stderr[-3000:]
    assert done.stdout.startswith("cpu, 1 thread, 2 processes, ")
    assert written(tmp_path / "run") == []


def test_sample_without_a_checkpoint_names_the_train_command(tmp_path):
    line = one_error_line(in_process(sample.main, "--out-dir", tmp_path / "none"))
    assert line == (
        f"error: no checkpoint at {tmp_path / 'none' / 'ckpt.pt'}; train one first "
        "(python train.py --config small writes out/small)"
    )


def test_a_prompt_with_characters_the_model_lacks_is_one_line_naming_them(trained):
    proc = in_process(sample.main, "--out-dir", trained, "--prompt", "ROMEO: Ωμ", "--device", "cpu")
    line = one_error_line(proc)
    vocab = len(set(MIXED))
    assert line == f"error: prompt 'ROMEO: Ωμ': 'Ωμ': not in this model's {vocab} characters"
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-samples", "0"], "--num-samples, --top-k: at least 1"),
        (["--max-new-tokens", "-1"], "--max-new-tokens, --temperature"),
        (["--top-p", "1.5"], "--top-p: above 0, at most 1"),
        (["--stop", ""], "--stop: some text"),
    ],
)
def test_sample_refuses_bad_options_before_loading(tmp_path, argv, message):
    # the folder has no checkpoint: the options are refused first
    line = one_error_line(in_process(sample.main, "--out-dir", tmp_path, *argv))
    assert line.startswith("error: ") and message in line


AS_ON_WINDOWS = """
import runpy, signal, sys
sys.modules["fcntl"] = None  # import fcntl fails, as on Windows
del signal.SIGPIPE, signal.SIGUSR1
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_both_scripts_start_without_posix_only_modules_and_signals(tmp_path, data_root):
    trained = script(
        "-c", AS_ON_WINDOWS, "train.py", *tiny_args(tmp_path, data_root, "--max-iters", 2)
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    sampled = script(
        "-c", AS_ON_WINDOWS, "sample.py", "--out-dir", tmp_path / "run", "--max-new-tokens", 5
    )
    assert sampled.returncode == 0 and sampled.stdout, sampled.stderr[-2000:]


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_copied_or_moved_run_folder_resumes_where_it_is_and_writes_nowhere_else(
    tmp_path, trained, root, how
):
    original = tmp_path / "original"
    shutil.copytree(trained, original)
    before = contents(original)
    (shutil.copytree if how == "copied" else shutil.move)(original, tmp_path / "elsewhere")
    resumed = train.train(
        parse_args(["--config", str(tmp_path / "elsewhere"), "--resume", "--max-iters", "4"])
    )
    assert resumed["step"] == 4 and load_checkpoint(tmp_path / "elsewhere")["state"]["step"] == 4
    if how == "copied":
        assert contents(original) == before  # the original is untouched
    else:
        assert not original.exists()  # nor made again
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["elsewhere"] + ["original"] * (how == "copied")
    )


def test_a_val_split_too_short_for_one_window_is_one_line_before_any_step(tmp_path):
    (tmp_path / "short.txt").write_text(SHAKESPEARE[:3000])
    prepare(
        "short",
        text=tmp_path / "short.txt",
        tokenizer="char",
        root=str(tmp_path),
        val_fraction=0.01,
        quiet=True,
    )
    line = one_error_line(
        in_process(train.main, *tiny_args(tmp_path, tmp_path, "--dataset", "short"))
    )
    assert (
        line.startswith("error: ")
        and "val.bin holds 30 tokens, not a block of 32 and one more" in line
    )
    assert not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.parametrize(
    "shell, error",
    [
        ("python sample.py --out-dir RUN --max-new-tokens 5 >&-", None),  # stdout closed
        (
            "python sample.py --out-dir RUN --prompt - <&-",
            "--prompt - reads stdin, which is closed",
        ),
        (
            "WORLD_SIZE=2 python train.py --config tiny --device cpu --out-dir RUN2",
            "WORLD_SIZE=2 is set",
        ),
        ("python sample.py --out-dir NAN --max-new-tokens 5", "its weights hold nan or inf"),
    ],
)
def test_closed_streams_a_stray_world_size_and_nan_weights_are_one_line_or_none(
    shell, error, tmp_path, trained
):
    checkpoint = load_checkpoint(trained)
    checkpoint["model"]["transformer.wte.weight"][0, 0] = math.nan
    torch.save(checkpoint, tmp_path / "nan.pt")
    shell = shell.replace("python", shlex.quote(sys.executable)).replace(
        "RUN2", str(tmp_path / "r")
    )
    shell = shell.replace("RUN", str(trained)).replace("NAN", str(tmp_path / "nan.pt"))
    proc = subprocess.run(
        ["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if error is None:
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    else:
        assert error in one_error_line(proc)


def test_a_users_own_config_json_in_the_out_dir_is_not_taken_for_a_runs(tmp_path, data_root):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"mine": true}')
    line = one_error_line(in_process(train.main, *tiny_args(tmp_path, data_root)))
    assert line.endswith("holds files no run wrote (config.json); pick another --out-dir")
    assert (tmp_path / "run" / "config.json").read_text() == '{"mine": true}'


@pytest.mark.parametrize(
    "text, message",
    [
        ("{broken", "config.json is damaged (Expecting property name"),
        ('{"max_iters": "80"}', "config.json: --max-iters '80': expected an int"),
    ],
)
def test_a_damaged_config_json_on_resume_names_the_file_not_a_flag(
    tmp_path, trained, text, message
):
    shutil.copytree(trained, tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text(text)
    line = one_error_line(in_process(train.main, "--out-dir", tmp_path / "run", "--resume"))
    assert line.startswith(f"error: {tmp_path / 'run'}/{message}") and "--config" not in line


DAMAGE = ["empty", "cut short", "another shape", "wrong magic"]


def damaged(data: bytes, how: str, kind: str) -> bytes:
    """A file's bytes, damaged: emptied, cut short, replaced by valid JSON (or a checkpoint) of
    another shape, or given another file's first bytes (its magic)."""
    if how == "empty":
        return b""
    if how == "cut short":
        return data[: len(data) // 2]
    if how == "another shape" and kind.endswith(".pt"):
        path = Path(os.environ["TMPDIR"]) / "other.pt"
        torch.save({"model": [1, 2]}, path)
        return path.read_bytes()
    if how == "another shape":
        return b'[{"step": "one"}, 2]\n'
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
        assert Path(path).name in one_error_line(proc)
