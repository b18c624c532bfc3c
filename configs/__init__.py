"""TrainConfig, whose fields are train.py's flags; presets and config files; UserError.

Each preset is configs/<name>.toml; a file of your own holds some of the fields, and
`base = "small"` starts it from a preset:
    cfg = load_config("small")
    cfg = load_config("runs/mine.toml")
    cfg = load_config("out/small/config.json")    # a run's settings, its out_dir included
    cfg = parse_args(["--config", "small", "--max-iters", "200", "--no-compile"])
"""

import argparse
import contextlib
import difflib
import json
import math
import os
import shutil
import signal
import sys
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Literal, get_args, get_origin, get_type_hints

import torch

from model.gpt import GPTConfig


class UserError(Exception):
    """A mistake the user can fix: its message names it and the fix; scripts print it in a line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes are UserErrors: one line, without the usage. Its
    description (a script's docstring) keeps its lines as written, and a flag is never abbreviated
    (--conf X is not --config X)."""

    def __init__(self, **kwargs):
        super().__init__(
            **kwargs, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
        )

    def error(self, message):
        raise UserError(message)


def run(main) -> None:
    """Run a script's main(). A UserError, or running out of memory, is one `error:` line and exit 2
    (under torchrun, printed by rank 0 only); Ctrl-C exits 130; `| head` ends it quietly; and text
    the terminal cannot encode is escaped."""
    if hasattr(signal, "SIGPIPE"):  # not on Windows
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for stream in sys.stdout, sys.stderr:
        if stream is not None:  # closed by the shell (>&-): print() then writes nowhere
            stream.reconfigure(errors="backslashreplace")
    try:
        sys.exit(main())
    except (UserError, RuntimeError) as e:
        # OutOfMemoryError is a RuntimeError too; the CPU allocator's failure is a plain one, which
        # only its text tells apart. Any other RuntimeError is a bug: its traceback says where.
        oom = isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)
        if not (oom or isinstance(e, UserError)):
            raise
        if os.environ.get("RANK", "0") == "0":
            why = "out of memory; use a smaller --batch-size or model: " if oom else ""
            print(f"error: {why}{str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


@contextlib.contextmanager
def replacing(path: Path):
    """A temporary path beside `path` to write a file or a folder in, which then takes path's place
    whole: a crash, a full disk or Ctrl-C midway leaves what was there as it was."""
    tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
    gone = lambda p: (
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    )
    gone(tmp)  # a killed write's
    try:
        yield tmp
        if tmp.is_file():  # its bytes on the disk before its name
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        if path.is_dir():  # os.replace cannot put a folder over one that holds files
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        gone(tmp)
        gone(old)


def cpu_has_bf16() -> bool:
    """Whether the CPU has bfloat16 matmuls in hardware (AVX512-BF16, AMX); emulated, slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:  # not Linux: float32 is the safe choice
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def device_and_dtype(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """--device and --dtype with "auto" decided: a GPU where torch has one, else the CPU; bfloat16
    where the hardware has it, float16 on older GPUs (with a loss scaler to train), else float32."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.mps.is_available(), "cpu": True}
    device = next(d for d, ok in available.items() if ok) if device == "auto" else device
    if not available[device]:
        raise UserError(f"--device {device}, but torch cannot use one here; use --device auto")
    gpu = device == "cuda"
    if gpu:  # bfloat16 in hardware from Ampere (8.0) on; asked of this process's GPU, not cuda:0
        bf16 = torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", 0))) >= (8, 0)
    else:
        bf16 = device == "cpu" and cpu_has_bf16()
    auto = torch.bfloat16 if bf16 else torch.float16 if gpu else torch.float32
    return device, auto if dtype == "auto" else getattr(torch, dtype)


@dataclass(frozen=True)
class TrainConfig(GPTConfig):
    """A run's settings: the network's (GPTConfig, model/gpt.py) and the training's; each a flag."""

    vocab_size: Annotated[int, "0: the tokenizer's; more pads the embedding"] = 0
    name: Annotated[str, "the run's name: it writes to out/<name>"] = "custom"
    dataset: Annotated[str, "a preset or a dataset prepared in data_root"] = "shakespeare_char"
    data_root: Annotated[str, "where prepared datasets are"] = "data/prepared"
    batch_size: Annotated[int, "sequences in a micro-batch, per process"] = 12
    tokens_per_step: Annotated[int, "by gradient accumulation; 0: a micro-batch a process"] = 0
    optimizer: Annotated[Literal["adamw", "muon"], "muon: Muon for the blocks' matrices"] = "adamw"
    lr: Annotated[float, "AdamW's peak learning rate"] = 1e-3
    muon_lr: Annotated[float, "Muon's peak learning rate (--optimizer muon)"] = 0.02
    min_lr: Annotated[float, "AdamW's rate at the end (cosine and wsd)"] = 1e-4
    warmup_iters: Annotated[int, "steps of linear warmup"] = 100
    lr_schedule: Annotated[Literal["cosine", "wsd", "constant"], "after warmup"] = "cosine"
    decay_frac: Annotated[float, "the share of the run that decays (wsd)"] = 0.2
    weight_decay: Annotated[float, "decoupled weight decay of the matrices"] = 0.1
    beta1: Annotated[float, "AdamW's beta1"] = 0.9
    beta2: Annotated[float, "AdamW's beta2"] = 0.99
    grad_clip: Annotated[float, "the gradients' largest global norm; 0: no clipping"] = 1.0
    max_iters: Annotated[int, "optimizer steps"] = 2000
    max_time: Annotated[float, "seconds for the run, its final eval and save included"] = 0.0
    eval_interval: Annotated[int, "steps between evaluations and checkpoints"] = 250
    eval_iters: Annotated[int, "batches an eval reads of each split; 0: all of val"] = 20
    eval_batch_size: Annotated[int, "sequences in an eval batch; 0: batch_size"] = 0
    log_interval: Annotated[int, "steps between lines of metrics.jsonl"] = 10
    sample_tokens: Annotated[int, "the length of the sample printed at the end"] = 200
    device: Annotated[Literal["auto", "cpu", "cuda", "mps"], "auto: cuda, mps, cpu"] = "auto"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], "autocast's"] = "auto"
    compile: Annotated[bool, "torch.compile the model: a slow start, faster GPU steps"] = False
    deterministic: Annotated[bool, "deterministic GPU kernels: repeats bit for bit"] = False
    threads: Annotated[int, "CPU threads; 0: a thread per idle core"] = 0
    seed: Annotated[int, "of the weights, the batches and dropout"] = 1337
    ddp_timeout: Annotated[float, "seconds a process waits for the others"] = 600.0
    out_dir: Annotated[str, "the run's folder; empty: out/<name>"] = ""
    resume: Annotated[bool, "continue the run in out_dir, with its settings"] = False
    init_from: Annotated[str, "a run folder, or a GPT-2 folder or hub id; not read by --resume"] = (
        ""
    )
    eval_only: Annotated[bool, "no training: the loss of init_from, else of out_dir"] = False
    hellaswag: Annotated[str, "a HellaSwag .jsonl file, scored at each eval"] = ""
    hellaswag_interval: Annotated[int, "steps between HellaSwag scores; 0: each eval"] = 0
    wandb: Annotated[bool, "log to Weights & Biases (offline without a key)"] = False

    def __post_init__(self):
        """Every bound, checked here whether the value came from a flag, a file or code."""
        for name, kind in get_type_hints(TrainConfig).items():
            value = getattr(self, name)
            choices = get_args(kind) if get_origin(kind) is Literal else ()
            if choices and value not in choices:
                raise UserError(f"{flag(name)} {value!r}: choose one of {', '.join(choices)}")
            if not choices and not (type(value) is kind or kind is float and type(value) is int):
                article = "an" if kind is int else "a"
                raise UserError(f"{flag(name)} {value!r}: expected {article} {kind.__name__}")
            if kind in (int, float) and not 0 <= value < math.inf:
                raise UserError(f"{flag(name)} {value!r}: expected a finite number, at least 0")
        if min(self.n_layer, self.n_head, self.n_embd, self.block_size, self.batch_size) < 1:
            raise UserError("--n-layer, --n-head, --n-embd, --block-size, --batch-size: at least 1")
        if min(self.max_iters, self.eval_interval, self.log_interval) < 1:
            raise UserError("--max-iters, --eval-interval and --log-interval: at least 1")
        if self.n_embd % self.n_head or self.pos_emb == "rope" and self.n_embd // self.n_head % 2:
            raise UserError(f"--n-embd {self.n_embd} must be n_head x an even head size (rope's)")
        if max(self.dropout, self.beta1, self.beta2) >= 1 or not 0 < self.decay_frac <= 1:
            raise UserError("--dropout, --beta1, --beta2: below 1; --decay-frac: in (0, 1]")
        if self.min_lr > self.lr:
            raise UserError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.seed >= 2**63:
            raise UserError("--seed must be below 2**63")
        if self.hellaswag_interval % self.eval_interval:
            raise UserError("--hellaswag-interval must be a multiple of --eval-interval")

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The network's settings, with vocab_size where the run leaves it to the tokenizer (0)."""
        shape = {f.name: getattr(self, f.name) for f in fields(GPTConfig)}
        return GPTConfig(**shape | {"vocab_size": self.vocab_size or vocab_size})

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir or f"out/{self.name}")


RUN_KEEPS = ("block_size", "dropout")  # network settings a run sets whatever weights it starts from


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


PRESETS = sorted(p.stem for p in Path(__file__).parent.glob("*.toml"))


def load_config(name: str) -> TrainConfig:
    """A preset's settings, a .toml file's, or a .json file's such as a run's config.json (or its
    folder's). In a file, `base = "small"` starts from a preset."""
    if not name:  # an unset $VARIABLE in a script
        raise UserError(f"--config is empty; give a preset ({', '.join(PRESETS)}) or a .toml file")
    path = Path(__file__).with_name(f"{name}.toml") if name in PRESETS else Path(name)
    path = path / "config.json" if path.is_dir() else path
    saved_run = path.name == "config.json"  # the settings a run saved
    try:
        text = path.read_text()
        values = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        if not isinstance(values, dict):  # a JSON list or number
            raise ValueError("its settings are not a table")
    except (OSError, ValueError) as e:  # no such file, or neither TOML nor JSON
        if saved_run and path.is_file():  # which no flag named
            raise UserError(f"{path} is damaged ({e}); put the run's config.json back") from None
        near = difflib.get_close_matches(path.stem, PRESETS, 1)
        hint = f"did you mean --config {near[0]}? " if near else ""
        raise UserError(
            f"--config {name}: {e}; {hint}give a preset ({', '.join(PRESETS)}) or a .toml file"
        ) from None
    if path.suffix == ".toml":
        values.setdefault("name", path.stem)
    if saved_run:  # its folder is where it is now, moved or copied
        values["out_dir"] = str(path.parent)
    try:
        base = str(values.pop("base", ""))  # a preset, or a file beside this one
        if base and base not in PRESETS:
            if not (path.parent / base).is_file():
                raise UserError(
                    f"{path}: base {base!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                    "file beside it"
                )
            base = str(path.parent / base)
        base = load_config(base) if base else TrainConfig()
    except RecursionError:
        raise UserError(f"{path}: its base is itself, or a base of its base") from None
    names = [f.name for f in fields(TrainConfig)]
    for key in values.keys() - names:
        hint = "".join(f"; did you mean {h!r}?" for h in difflib.get_close_matches(key, names, 1))
        raise UserError(f"{path}: unknown setting {key!r}{hint}")
    try:
        return replace(base, **values)
    except UserError as e:  # a run's settings name their file; a flag's, the flag
        raise UserError(f"{path}: {e}" if saved_run else str(e)) from None


def parse_args(argv=None, doc: str = "") -> TrainConfig:
    """train.py's command line: --config picks where the settings start (the defaults --help shows),
    and each field of TrainConfig is a flag. --resume takes the rest from the run's config.json."""
    first = ArgumentParser(add_help=False)
    first.add_argument("--config")
    given = first.parse_known_args(argv)[0].config
    base = load_config("small" if given is None else given)
    parser = ArgumentParser(
        prog="train.py",
        description=doc,
        argument_default=argparse.SUPPRESS,
    )  # untyped flags stay out: base keeps them
    parser.add_argument(
        "--config", help=f"a preset ({', '.join(PRESETS)}), a .toml or a .json file"
    )
    for f in fields(TrainConfig):
        kind, *text = get_args(f.type) if get_origin(f.type) is Annotated else (f.type, "")
        weights = "; --resume and --init-from take the weights'" * (f.name not in RUN_KEEPS)
        text = text[0] or f"the network's (model/gpt.py){weights}"
        help = f"{text} (default: {getattr(base, f.name)})".replace("%", "%%")
        if kind is bool:
            how = dict(action=argparse.BooleanOptionalAction)
        elif get_origin(kind) is Literal:
            how = dict(choices=get_args(kind))
        else:
            how = dict(type=kind, metavar=kind.__name__.upper())
        parser.add_argument(flag(f.name), help=help, **how)
    typed = vars(parser.parse_args(argv))
    typed.pop("config", None)
    cfg = replace(base, **typed)
    saved = cfg.run_dir / "config.json"
    if cfg.resume and saved.is_file():
        run = replace(load_config(str(saved)), **typed)
        # A preset names the run's folder; a file's settings would be ignored, so must be the run's.
        # the folder's, chosen at start-up, the data's, this command's
        mine = ("out_dir", "threads", "vocab_size", "resume")
        other = [n for n, v in asdict(run).items() if n not in mine and v != getattr(cfg, n)]
        if given and (run.name != cfg.name or given not in PRESETS and other):
            raise UserError(
                f"--resume continues {cfg.run_dir} with its own settings; --config {given} has "
                f"others ({flag(other[0])} {getattr(cfg, other[0])}, not "
                f"{getattr(run, other[0])}): leave --config out, and give changes as flags"
            )
        cfg = run
    elif cfg.resume and (cfg.run_dir / "ckpt.pt").is_file():
        raise UserError(
            f"cannot resume {cfg.run_dir}: its config.json is gone; put it back, or start a new "
            f"run from its weights with --init-from {cfg.run_dir} --out-dir NEW"
        )
    if cfg.eval_only and "hellaswag_interval" in typed:
        raise UserError("--eval-only scores HellaSwag once: leave --hellaswag-interval out")
    if cfg.resume and "init_from" in typed:
        raise UserError("--resume goes on from the run's checkpoint: leave --init-from out")
    if cfg.resume and cfg.eval_only:
        raise UserError("--eval-only scores the run's best.pt: leave --resume out")
    return cfg


def settings(cfg: TrainConfig) -> dict:
    """What config.json holds: the settings that repeat the run, in the folder it writes."""
    return asdict(replace(cfg, out_dir=str(cfg.run_dir), resume=False, eval_only=False))
