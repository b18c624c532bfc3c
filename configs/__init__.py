"""Training configs: TrainConfig, whose fields are train.py's flags, and where a run starts from.

    cfg = load_config("small")                    # configs/small.py: CONFIG = replace(BASE, ...)
    cfg = load_config("runs/my.toml")             # field values, optionally base = "small"
    cfg = load_config("out/small")                # that run's config.json, as it ran
    cfg = load_config("small", ["--max-iters", "200", "--no-compile", "--lr=3e-4"])

"Off" is 0 or "" (max_time=0), never None, so every flag takes one plain value.
"""

import importlib
import json
import pkgutil
import sys
from argparse import ArgumentTypeError, Namespace
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from .cli import ArgumentParser, Number, argument, closest, integer, number, seed, setting
from .errors import UserError
from .model import GPTConfig, checks

Device = Literal["auto", "cpu", "cuda", "mps"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


def micro_batch(value: Any) -> int:
    """--batch-size: a whole number, or auto (0, as config files hold it: plan.auto_batch_size picks it at start)."""
    auto = str(value).lower() == "auto" or (type(value) is int and value == 0)
    return 0 if auto else Number(int, lo=1, expects="a whole number >= 1 or auto")(value)


@dataclass(frozen=True)
class TrainConfig(GPTConfig):
    """A run's settings: the network's fields, inherited from GPTConfig with their defaults, and the training's."""

    # A run may leave the vocabulary to its data, which a model cannot: 0 here means the tokenizer's size.
    vocab_size: int = setting(0, "0 = the tokenizer's; larger pads the embedding (e.g. 50304)", "model")
    name: str = setting("custom", "the config's name; the run directory defaults to out/<name>", "config")
    dataset: str = setting("shakespeare_char", "a data.prepare preset (prepared on first use) or a dataset "
                           "prepared into data_root", "data")
    data_root: str = setting("data/prepared", "where prepared datasets live")
    sampling: Literal["random", "epoch"] = setting("random", "train windows: random start positions (nanoGPT), "
                                                   "or each non-overlapping window once per epoch")
    batch_size: int = setting(12, "sequences per micro-batch per process; auto (stored as 0) = the largest "
                              "that fits free memory, keeping tokens_per_step (training/plan.py)", "optimization",
                              micro_batch)
    tokens_per_step: int = setting(0, "global tokens per optimizer step, reached by gradient accumulation; "
                                   "0 = one micro-batch per process")
    lr: float = setting(1e-3, "peak learning rate (AdamW), reached after warmup_iters")
    min_lr: float = setting(1e-4, "where the schedule ends (cosine, wsd)")
    warmup_iters: int = setting(100, "steps of linear warmup")
    lr_schedule: Literal["cosine", "wsd", "constant"] = setting("cosine", "after warmup: half a cosine to min_lr; "
                                                                "warmup-stable-decay; or constant")
    lr_decay_iters: int = setting(0, "where the schedule reaches min_lr; 0 = max_iters")
    decay_frac: float = setting(0.2, "wsd: the final fraction of the run decaying", check=number(0, 1, lo_open=True))
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices (not of biases and norms)")
    optimizer: Literal["adamw", "muon"] = setting("adamw", "muon: Muon for the block matrices, AdamW for the rest")
    muon_lr: float = setting(0.02, "Muon's peak learning rate")
    muon_momentum: float = setting(0.95, "Muon's momentum", check=number(0, 1, hi_open=True))
    beta1: float = setting(0.9, "AdamW beta1", check=number(0, 1, hi_open=True))
    beta2: float = setting(0.99, "AdamW beta2", check=number(0, 1, hi_open=True))
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 = off")
    max_iters: int = setting(2000, "optimizer steps", "run length, evaluation and logging", check=integer(lo=1))
    max_time: float = setting(0.0, "wall-clock budget in seconds, final eval and save included (the LR "
                              "schedule then runs on time); 0 = none")
    eval_interval: int = setting(250, "steps between evaluation + checkpoint", check=integer(lo=1))
    eval_iters: int = setting(20, "batches per evaluation; 0 = the whole val split")
    eval_batch_size: int = setting(0, "0 = batch_size; eval has no backward pass, so it can be larger")
    log_interval: int = setting(10, "steps between metrics.jsonl lines and progress-bar updates", check=integer(lo=1))
    sample_tokens: int = setting(200, "length of the samples printed at the end and sent to wandb; 0 = none")
    device: Device = setting("auto", "auto: cuda > mps > cpu", "system")
    dtype: Dtype = setting("auto", "autocast; auto: bfloat16 on GPUs that have it (else float16 with a grad "
                           "scaler) and on CPUs with bf16 instructions, else float32")
    compile: bool = setting(False, "torch.compile the model (slow start, faster steps on GPU)")
    deterministic: bool = setting(False, "bit-identical repeats: deterministic kernels only (slower on a GPU), and "
                                  "a fixed CPU thread count")
    threads: int = setting(0, "CPU threads for torch; 0 = as many as other processes leave cores idle, checked "
                           "twice a second (results then depend on the load in the last bits)")
    seed: int = setting(1337, "seed of every random stream (each DDP rank adds its rank)", check=seed)
    ddp_timeout: float = setting(600.0, "seconds a process waits for the others (at most a week: one silent for "
                                 "longer is hung); then a hung or stopped one ends the job",
                                 check=number(0, 604800, lo_open=True))
    out_dir: str = setting("", "the run directory; empty = out/<name>")
    resume: bool = setting(False, "continue from out_dir/ckpt.pt")
    init_from: str = setting("", "start from a run dir of ours, a local HF GPT-2 dir or a hub id (gpt2, "
                             "gpt2-medium, ...); ignored by --resume")
    eval_only: bool = setting(False, "no training: loss and perplexity of --init-from (or out_dir's checkpoint)")
    hellaswag: str = setting("", "HellaSwag-format items (a .jsonl file, or a hub id: Rowan/hellaswag) to score "
                             "with --eval-only or while training; empty = none")
    hellaswag_interval: int = setting(0, "steps between HellaSwag scores while training, a multiple of "
                                      "--eval-interval; 0 = at every eval")
    wandb: bool = setting(False, "log to Weights & Biases (offline without an API key)")
    wandb_project: str = setting("", "the wandb project (default: $WANDB_PROJECT, else gpt)")
    wandb_run_name: str = setting("", "empty = the config name")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_lr > self.lr:
            raise UserError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr}); lower --min-lr")
        if self.hellaswag_interval % self.eval_interval or (self.hellaswag_interval and not self.hellaswag):
            raise UserError("--hellaswag-interval scores --hellaswag SOURCE at eval steps: give a SOURCE and a "
                            f"multiple of --eval-interval ({self.eval_interval})")
        if not self.data_root or not self.dataset:  # "" would prepare into the working directory
            raise UserError("--data-root and --dataset must not be empty")
        if self.name in ("", ".", "..") or "/" in self.name:  # out/<name> would be out/ itself or outside it
            raise UserError(f"--name {self.name!r}: a run's name is one folder name under out/; pick another")
        if tilde := next((f for f in ("out_dir", "data_root") if getattr(self, f).startswith("~")), None):
            raise UserError(f"{_flag(tilde)} {getattr(self, tilde)}: the shell left ~ as it is (quoted?), which would "
                            f"make a folder named ~ here; write $HOME instead, or ./~ to mean that folder")

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The network this config describes; vocab_size 0 takes the argument."""
        return GPTConfig.from_dict(self.to_dict(), vocab_size=self.vocab_size or vocab_size)

    def accumulation(self, processes: int) -> int:
        """Micro-steps per optimizer step: tokens_per_step over batch_size x block_size x processes."""
        micro = self.batch_size * self.block_size * processes
        tokens = self.tokens_per_step or micro
        if tokens % micro:
            raise UserError(f"--tokens-per-step {tokens} is not a multiple of batch_size x block_size x processes "
                            f"= {micro}; pick a multiple (or 0 for one micro-batch per step)")
        return tokens // micro

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir or f"out/{self.name}")


FIELDS = checks(TrainConfig)  # each field's check, by name
BASE = TrainConfig()
# Fields that act only beside another field's values; typed without them they would do nothing, so are refused.
ONLY_WITH = dict.fromkeys(("muon_lr", "muon_momentum"), ("optimizer", ("muon",))) \
    | dict.fromkeys(("min_lr", "lr_decay_iters"), ("lr_schedule", ("cosine", "wsd"))) \
    | dict.fromkeys(("wandb_project", "wandb_run_name"), ("wandb", (True,))) | {"decay_frac": ("lr_schedule", ("wsd",))}


def check_typed(cfg: TrainConfig, typed: Iterable[str], at: str = "") -> None:
    """Refuse a field set by hand that cfg's other values leave without effect (ONLY_WITH); `at` starts the message."""
    if cfg.resume and (other := next((f for f in ("init_from", "eval_only") if f in typed), None)):
        raise UserError(f"{at}--resume continues this run's training, which {_flag(other)} does not; drop one of them")
    if "warmup_iters" in typed and cfg.warmup_iters > cfg.max_iters:
        raise UserError(f"{at}--warmup-iters {cfg.warmup_iters} is longer than the run (--max-iters "
                        f"{cfg.max_iters}): it would end before reaching --lr; lower --warmup-iters")
    for name in typed:
        other, acting = ONLY_WITH.get(name, ("", ()))
        if other and getattr(cfg, other) not in acting:
            flag, needed = _flag(name), _flag(other) + ("" if acting == (True,) else f" {'/'.join(acting)}")
            now = "" if acting == (True,) else f" (this run: {_flag(other)} {getattr(cfg, other)})"
            raise UserError(f"{at}{flag} does nothing without {needed}{now}; add {needed} or drop {flag}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def available_configs() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("cli", "errors", "model"))


def read_config_file(path: Path) -> Any:
    """A .json or TOML file's contents; a file that cannot be read or parsed is a UserError."""
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        import tomllib  # here, not at the top: Python < 3.11 can still run the named configs
        return tomllib.loads(path.read_text())
    except (OSError, ValueError) as e:  # JSON and TOML syntax errors are ValueErrors
        raise UserError(f"cannot read config file {path}: {e}") from None


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    return f"did you mean {hint!r}? " if (hint := closest(word, options)) else ""


def resolve_config(config: str) -> TrainConfig:
    """--config: a preset, a TOML file (base = "<preset>" starts from one), or a run directory / its config.json."""
    path, names = Path(config), available_configs()
    if config in names:
        return replace(importlib.import_module(f"configs.{config}").CONFIG, name=config)
    if not (path.exists() or "/" in config or path.suffix in (".toml", ".json")):
        raise UserError(f"unknown config {config!r}; {_did_you_mean(config, names)}choose one of {', '.join(names)}, "
                        "a .toml file or a run directory")
    if not path.exists():
        raise UserError(f"config file {path} not found")
    if path.is_dir() and not (path := path / "config.json").is_file():
        raise UserError(f"{path.parent} has no config.json; --config takes a preset, a .toml file or a run directory")
    if path.suffix not in (".toml", ".json") or not path.is_file():
        # an empty file would read as no fields; a pipe (<(...), /dev/stdin) has no name to tell TOML by
        raise UserError(f"--config {path}: expected a .toml file, a run's config.json or its directory; "
                        "save the settings to a .toml file and give that")
    data = read_config_file(path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected an object of TrainConfig fields, got {type(data).__name__}")
    if path.suffix == ".json":  # a run's settings, not its place: training again must not write into it
        data = {k: v for k, v in data.items() if k not in ("out_dir", "resume")}
    preset = str(data.pop("base", ""))
    if preset and preset not in names and Path(preset).exists():  # it would be read as --config
        raise UserError(f"{path}: base takes a preset ({', '.join(names)}), not a path; to start "
                        f"from a run's settings use --config {preset}")
    base = resolve_config(preset) if preset else BASE
    values = {}
    for key, value in data.items():
        if key not in FIELDS:
            raise UserError(f"{path}: unknown key {key!r}; {_did_you_mean(key, FIELDS)}the keys are TrainConfig's "
                            "fields (train.py --help)")
        try:
            values[key] = FIELDS[key](value)
        except ArgumentTypeError as e:
            raise UserError(f"{path}: {key} {e}") from None
    return replace(base, **{"name": path.stem} | values)


def run_named(config: str) -> Path | None:
    """The run directory a --config value names (the folder or its config.json; a preset first), else None."""
    run = Path(config).parent if Path(config).name == "config.json" else Path(config)
    return run if config not in available_configs() and (run / "config.json").is_file() else None


def parse_config(parser: ArgumentParser, argv: Sequence[str] | None = None) -> tuple[TrainConfig, Namespace]:
    """Parse `argv` as train.py does: `--config` picks the starting config (and --help's defaults), every field
    is a flag, and `parser`'s own flags come back in the namespace; --resume takes the rest from the run's config."""
    argv = sys.argv[1:] if argv is None else list(argv)
    first = ArgumentParser(add_help=False)
    first.add_argument("--config", default="small")
    base = resolve_config(config := first.parse_known_args(argv)[0].config)
    group = parser.add_argument_group("config")  # --help lists --config first, before the model's fields
    group.add_argument("--config", default=config, metavar="NAME|FILE|RUN_DIR",
                       help=f"a preset ({', '.join(available_configs())}), a .toml file of fields "
                            "(base = \"small\" starts from a preset), or a run directory / its config.json")
    groups = {"config": group}
    for f in fields(TrainConfig):
        if section := f.metadata["section"]:
            group = groups.get(section) or parser.add_argument_group(section)
        kind = argument(FIELDS[f.name]) | ({"metavar": "INT|auto"} if f.name == "batch_size" else {})
        group.add_argument(_flag(f.name), default=getattr(base, f.name), help=f.metadata["help"], **kind)
    untyped = object()  # argparse sets a default only where the namespace has no value yet
    args = vars(parser.parse_args(argv, Namespace(**dict.fromkeys(FIELDS, untyped))))
    typed = {k: v for k in FIELDS if (v := args.pop(k)) is not untyped}
    cfg = replace(base, **typed)
    if cfg.resume and "out_dir" not in typed and (run := run_named(config)):  # --config RUN_DIR: that run
        cfg = replace(cfg, out_dir=str(run))
    cfg = cfg if cfg.out_dir else replace(cfg, out_dir=f"out/{cfg.name}")
    if cfg.resume and (saved := cfg.run_dir / "config.json").is_file():  # the run's settings, unless typed again
        cfg = replace(resolve_config(str(saved)), **typed | {"resume": True, "out_dir": cfg.out_dir})
    check_typed(cfg, typed)
    if Path(config).suffix == ".toml":  # its fields were set by hand as well
        check_typed(cfg, set(read_config_file(Path(config))) - set(typed), f"{config}: ")
    return cfg, Namespace(**args)


def load_config(name_or_path: str = "small", overrides: Sequence[str] | None = None) -> TrainConfig:
    """The config `train.py --config name_or_path *overrides` would run."""
    return parse_config(ArgumentParser(prog="train.py"), ["--config", name_or_path, *(overrides or [])])[0]
