"""Training configs: one typed dataclass, named presets, TOML files and command-line overrides.

    cfg = load_config("small")                                  # configs/small.py: CONFIG
    cfg = load_config("runs/my.toml")                           # overrides, optionally base = "small"
    cfg = load_config("small", ["--max-iters", "200", "--no-compile", "--lr=3e-4"])

A named config is a module `configs/<name>.py` that defines `CONFIG = replace(BASE, ...)`
(or `replace(<other config>.CONFIG, ...)`): plain typed Python, so a typo in a field name
fails at import instead of being silently ignored. The fields are flat (model shape next
to optimiser settings) so every one of them is a single `--flag` on the command line.
"Off" is spelled 0 or "" rather than None (max_time=0: no limit) to keep parsing trivial.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import textwrap
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, get_type_hints

from errors import UserError

if TYPE_CHECKING:
    from model.config import GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    name: str = "custom"  # the config's name; the run directory defaults to out/<name>
    # data
    dataset: str = "shakespeare_char"  # a data.prepare preset, prepared on first use
    data_root: str = "data/prepared"  # where prepared datasets live
    sampling: Literal["random", "epoch"] = "random"  # how the train loader picks windows
    # model (see model/config.py); vocab_size 0 = the tokenizer's
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 0  # 0 = the tokenizer's; larger pads the embedding (e.g. 50304)
    dropout: float = 0.0  # only while training; > 0 helps small data, not big corpora
    bias: bool = True
    pos_emb: Literal["learned", "rope"] = "learned"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    activation: Literal["gelu", "relu2"] = "gelu"
    qk_norm: bool = False
    tie_weights: bool = True
    attention: Literal["sdpa", "explicit"] = "sdpa"  # same numbers; which kernel is faster depends on the device
    # optimisation: batch_size is per process; tokens_per_step is the global batch of one
    # optimizer step, reached by gradient accumulation (0 = one micro-batch per process)
    batch_size: int = 12  # sequences per micro-batch per process; auto (0) = the largest that fits (plan.py)
    tokens_per_step: int = 0  # global tokens per optimizer step; 0 = one micro-batch per process
    lr: float = 1e-3  # peak learning rate, reached after warmup_iters
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    lr_decay_iters: int = 0  # where the schedule reaches min_lr; 0 = max_iters
    decay_frac: float = 0.2  # wsd: the final fraction of lr_decay_iters spent decaying
    weight_decay: float = 0.1
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon for block matrices, AdamW for the rest
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 = off
    # run length, evaluation and logging
    max_iters: int = 2000
    max_time: float = 0.0  # wall-clock budget in seconds incl. the final eval+save; 0 = none
    eval_interval: int = 250  # steps between eval + checkpoint
    eval_iters: int = 20  # batches per eval; 0 = the whole val split
    eval_batch_size: int = 0  # 0 = batch_size; eval has no backward pass, so it can be larger
    log_interval: int = 10  # steps between metrics.jsonl lines
    sample_tokens: int = 200  # length of the samples printed at the end / sent to wandb; 0 = none
    # system
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # auto: cuda > mps > cpu
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # autocast; auto: bf16 on GPU, fp32 on CPU
    compile: bool = False
    threads: int = 0  # CPU threads for torch; 0 = torch's default (all cores)  # torch.compile the model (slow start, faster steps on GPU)
    seed: int = 1337
    out_dir: str = ""  # "" = out/<name>
    resume: bool = False  # continue from out_dir/ckpt.pt
    init_from: str = ""  # a run dir of ours or a local HF GPT-2 dir; ignored by --resume
    wandb: bool = False  # log to Weights & Biases (offline without an API key)
    wandb_project: str = "gpt"
    wandb_run_name: str = ""  # "" = the config name

    def __post_init__(self) -> None:
        self.model_config(vocab_size=1)  # GPTConfig validates the model fields
        positive = ("max_iters", "eval_interval", "log_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        non_negative = ("batch_size", "tokens_per_step", "lr", "min_lr", "warmup_iters",
                        "lr_decay_iters", "weight_decay", "grad_clip", "max_time", "eval_iters",
                        "eval_batch_size", "threads", "muon_lr",
                        "sample_tokens")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.decay_frac <= 1.0:
            raise UserError(f"decay_frac must be in (0, 1], got {self.decay_frac}")
        if self.min_lr > self.lr:
            raise UserError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The network this config describes: every field GPTConfig shares with TrainConfig,
        with vocab_size 0 meaning the tokenizer's (the argument)."""
        from model.config import GPTConfig

        shared = {k: getattr(self, k) for k in model_fields()}
        return GPTConfig(**shared | {"vocab_size": self.vocab_size or vocab_size})

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir or f"out/{self.name}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self, width: int = 100) -> str:
        """The resolved config as a few wrapped `key=value` lines."""
        text = " ".join(f"{k}={v}" for k, v in self.to_dict().items())
        return textwrap.fill(text, width=width, subsequent_indent="  ")


def model_fields() -> tuple[str, ...]:
    """TrainConfig fields that define the network (the rest is optimisation and bookkeeping)."""
    from model.config import GPTConfig

    return tuple(f.name for f in fields(GPTConfig) if f.name in FIELDS)


FIELDS = tuple(f.name for f in fields(TrainConfig))
BASE = TrainConfig()
_TYPES = get_type_hints(TrainConfig)


def available_configs() -> list[str]:
    """Names of the config modules in this package."""
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def named_config(name: str) -> TrainConfig:
    names = available_configs()
    if name not in names:
        raise UserError(f"unknown config {name!r}; {_suggest(name, names)}"
                        f"choose one of {', '.join(names)} or give a path to a .toml file")
    module = importlib.import_module(f"configs.{name}")
    cfg = getattr(module, "CONFIG", None)
    if not isinstance(cfg, TrainConfig):  # a broken preset is a bug, not a user error
        raise TypeError(f"configs/{name}.py must define CONFIG = replace(BASE, ...)")
    return replace(cfg, name=name)


def coerce(key: str, value: Any) -> Any:
    """Convert a command-line string (or TOML value) to the type of field `key`."""
    typ = _TYPES[key]
    if key == "batch_size" and str(value).lower() == "auto":  # issue 14: 0 means auto
        return 0
    if get_origin(typ) is Literal:
        choices = get_args(typ)
        if value not in choices:
            hint = "did you mean 'cuda'?" if value == "gpu" else _suggest(str(value), choices)
            raise UserError(f"--{key.replace('_', '-')}: {value!r} is not one of {', '.join(choices)}; "
                            f"{hint}".rstrip("; "))
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        lowered = str(value).lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise UserError(f"--{key.replace('_', '-')} expects true/false (or use --{key} / --no-{key}), "
                        f"got {value!r}")
    try:
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            # accept 1e6 and 2_000 for int fields, but not 2.5
            number = float(value) if isinstance(value, str) and ("e" in value.lower() or "." in value) else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        if typ is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        kind = {int: "an integer", float: "a number"}.get(typ, typ.__name__)
        raise UserError(f"--{key.replace('_', '-')} expects {kind}, got {value!r}") from None


def _field_name(flag: str) -> str:
    key = flag.lstrip("-").replace("-", "_")
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.6)
        hint = f"did you mean --{close[0].replace('_', '-')}? " if close else ""
        raise UserError(f"unknown option {flag!r}; {hint}run with --help to list all {len(FIELDS)} options")
    return key


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, `--flag` / `--no-flag` for booleans; dashes or underscores."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"unexpected argument {arg!r}; options look like --max-iters 200")
        flag, eq, inline = arg.partition("=")
        raw = flag[2:].replace("-", "_")
        if raw.startswith("no_") and raw not in FIELDS and raw[3:] in FIELDS and _TYPES[raw[3:]] is bool:
            if eq:
                raise UserError(f"{flag} takes no value")
            out[raw[3:]] = False
            i += 1
            continue
        key = _field_name(flag)
        if eq:
            value: Any = inline
        elif _TYPES[key] is bool and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            value = True  # bare --compile
        elif i + 1 < len(argv):
            i += 1
            value = argv[i]
        else:
            raise UserError(f"{flag} needs a value")
        out[key] = coerce(key, value)
        i += 1
    return out


def load_toml(path: Path) -> TrainConfig:
    import tomllib  # here, not at the top: Python < 3.11 can still run the named configs

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot read config file {path}: {e}") from None
    base_name = data.pop("base", None)
    base = named_config(base_name) if base_name else replace(BASE, name=path.stem)
    unknown = [k for k in data if k not in FIELDS]
    if unknown:
        raise UserError(f"{path}: unknown key {unknown[0]!r}; {_suggest(unknown[0], FIELDS)}"
                        f"valid keys are the TrainConfig fields (see --help)")
    values = {k: coerce(k, v) for k, v in data.items()}
    values.setdefault("name", path.stem)
    return replace(base, **values)


def load_config(name_or_path: str = "small", overrides: list[str] | None = None) -> TrainConfig:
    """Resolve a named config or a .toml file, then apply command-line overrides."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise UserError(f"config file {path} not found")
        cfg = load_toml(path)
    else:
        cfg = named_config(name_or_path)
    cfg = replace(cfg, **parse_overrides(list(overrides or [])))
    return cfg if cfg.out_dir else replace(cfg, out_dir=f"out/{cfg.name}")


def help_text() -> str:
    """One line per field: `--flag  type  default  # the comment from TrainConfig's source`."""
    import inspect
    import re

    notes = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.+)$", inspect.getsource(TrainConfig), re.M))
    lines = []
    for f in fields(TrainConfig):
        typ = _TYPES[f.name]
        kind = "|".join(get_args(typ)) if get_origin(typ) is Literal else typ.__name__
        note = f"  {notes[f.name]}" if f.name in notes else ""
        lines.append(f"  --{f.name.replace('_', '-'):<16} {kind:<20} {getattr(BASE, f.name)!r:<18}{note}".rstrip())
    return "\n".join(lines)
