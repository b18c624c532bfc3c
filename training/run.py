"""A training run's pieces, built in train.py's order: data, model, optimizer and the Run."""

import contextlib
import math
import os
import sys
import textwrap
import timeit
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from configs import TrainConfig
from configs.errors import UserError
from configs.model import GPTConfig
from data.files import is_dataset, write_json
from data.loader import GlobalBatchLoader, eval_batches
from data.manifest import VOCABULARY, differences, read_dataset_manifest
from data.prepare import dataset_dir, hold_dataset
from data.tokenfile import read_tokens
from data.tokenizer import tokenizer_from_manifest
from model.checkpoint import BEST_NAME, CKPT_NAME, is_checkpoint, load_checkpoint, model_from_checkpoint, save_checkpoint
from model.gpt import GPT
from model.hf import load_pretrained, pretrained_manifest
from model.kv_cache import generate
from training import hellaswag
from training.optim import configure_optimizer
from training.runlog import RunLog
from training.plan import auto_batch_size, check_fits
from training.budget import exit_code
from training.runtime import Runtime, attention_kernel, capture_rng_state, restore_rng_state, trainable

# The architecture that loaded weights bring with them; dropout and block_size stay the run's.
ARCH_FIELDS = tuple(f.name for f in fields(GPTConfig) if f.name not in ("dropout", "block_size"))
RESUME_KEYS = ("model", "train_config", "optimizer", "scaler", "step", "loader", "rng", "best_val", "manifest")


def build_model(cfg: TrainConfig, rt: Runtime, manifest: dict[str, Any], ckpt: dict | None) -> tuple[GPT, TrainConfig]:
    """The GPT for this run on its device (the resumed checkpoint's, --init-from weights, or fresh from cfg), and
    cfg with --batch-size auto resolved. Loaded weights keep their architecture; dropout is always cfg's."""
    vocab_size, trained_on = manifest["vocab_size"], ckpt and ckpt.get("manifest")
    if not cfg.init_from:  # Pretrained weights bring an architecture that is known only once they load.
        shape = GPTConfig.from_dict(ckpt["model_config"], dropout=cfg.dropout) if ckpt else cfg.model_config(vocab_size)
        check_fits(cfg, shape, rt)  # Before building, which allocates the masks.
    if ckpt is not None:
        source: str | Path = cfg.run_dir / CKPT_NAME
        model = model_from_checkpoint(ckpt, source, dropout=cfg.dropout)
    elif cfg.init_from:
        model, src, source = load_pretrained(cfg.init_from, dropout=cfg.dropout)
        if src is not None:
            trained_on = src.get("manifest")
        elif (source / "manifest.json").is_file() or model.config.vocab_size >= 50257:
            trained_on = pretrained_manifest(source, None)  # Else GPT-2 BPE's, if the model has that many rows.
    else:
        source, model = "", GPT(cfg.model_config(vocab_size))
    if trained_on and (changes := differences(trained_on, manifest, VOCABULARY)):
        raise UserError(f"{source} was trained with another vocabulary than dataset {cfg.dataset}'s "
                        f"({', '.join(changes)}): its token ids would mean other text; use data of its tokenizer"
                        + (f" (--dataset {trained_on['name']})" if trained_on.get("name") else ""))
    mc = model.config
    if mc.vocab_size < vocab_size:  # A fresh model's comes from --vocab-size, so say how to fix that.
        what, fix = (f"the vocabulary of {source} ({mc.vocab_size})", "use a dataset with the model's tokenizer") \
            if source else (f"--vocab-size {mc.vocab_size}", f"use --vocab-size 0 (the tokenizer's) or >= {vocab_size}")
        raise UserError(f"{what} is smaller than the vocabulary of dataset {cfg.dataset} ({vocab_size}); {fix}")
    if cfg.block_size > mc.block_size:
        raise UserError(f"block_size {cfg.block_size} exceeds the context of {source} ({mc.block_size}); "
                        f"pass --block-size {mc.block_size} or less")
    if changed := [f"{k}={getattr(mc, k)}" for k in ARCH_FIELDS if getattr(cfg, k) != getattr(mc, k)
                   and not (k == "vocab_size" and cfg.vocab_size == 0)]:
        print(f"note: architecture taken from {source}: {' '.join(changed)}")
    if cfg.batch_size == 0:  # --batch-size auto is sized from free memory, before the weights move there.
        cfg = auto_batch_size(cfg, model, rt)
    return model.to(rt.device), cfg


def build_optimizer(model: GPT, cfg: TrainConfig, rt: Runtime, ckpt: dict | None) -> torch.optim.Optimizer:
    """AdamW (or Muon) for model, with its moments (and the loss scaler's state) from the checkpoint on --resume."""
    optimizer = configure_optimizer(model, cfg, fused=rt.choices.fused_adamw, dtype=rt.choices.dtype)
    if ckpt is not None:
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
            rt.scaler.load_state_dict(ckpt["scaler"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise UserError(f"cannot resume {cfg.run_dir}: its optimizer state does not fit this run ({e}); resume "
                            f"with the --optimizer it was saved with, or use --init-from {cfg.run_dir}") from None
    return optimizer


def eval_only(cfg: TrainConfig, rt: Runtime) -> dict[str, Any]:
    """--eval-only: loss and perplexity of --init-from (or out_dir's best checkpoint) on the whole val split."""
    if rt.ddp:
        raise UserError("--eval-only runs in one process; start it with python, not torchrun")
    manifest = read_dataset_manifest(ds_dir := dataset_dir(cfg.dataset, cfg.data_root))
    if not cfg.init_from and not is_checkpoint(cfg.run_dir):
        raise UserError(f"--eval-only: no checkpoint in {cfg.run_dir}; train one first, or pass --init-from "
                        "(a run dir, a Hugging Face GPT-2 dir or a hub id such as gpt2)")
    items = hellaswag.load_items(cfg.hellaswag, tokenizer_from_manifest(manifest)) if cfg.hellaswag else []
    ckpt = None if cfg.init_from else load_checkpoint(cfg.run_dir, best=True)
    model, cfg = build_model(replace(cfg, eval_iters=0), rt, manifest, ckpt)
    losses = evaluate(model, ds_dir, cfg, rt)
    print(f"{cfg.init_from or cfg.run_dir} on {cfg.dataset} (block_size {cfg.block_size}):")
    for split, extent in (("val", "the whole split"), ("train", "as many windows")):
        loss = losses[f"{split}_loss"]
        print(f"  {split:<5} loss {loss:.4f}  perplexity {math.exp(loss):.2f}  ({extent})")
    if items:
        losses |= hellaswag.score(model, items, manifest["vocab_size"], rt, cfg.eval_batch_size or cfg.batch_size)
        print(f"hellaswag acc {losses['hellaswag_acc']:.4f}  acc_norm {losses['hellaswag_acc_norm']:.4f} "
              f"(per ending token)  items {losses['hellaswag_items']}")
    return {**losses, "stopped": "eval_only"}


@torch.no_grad()
def evaluate(model: torch.nn.Module, ds_dir: Path, cfg: TrainConfig, rt: Runtime,
             splits: tuple[str, ...] = ("val", "train")) -> dict[str, float]:
    """Mean loss per token on the first eval_iters batches of each split; with 0, as many as the whole val split."""
    model.eval()
    out = {}
    batch_size = cfg.eval_batch_size or cfg.batch_size
    limit = cfg.eval_iters or math.ceil(len(read_tokens(ds_dir / "val.bin")) // cfg.block_size / batch_size)
    for split in splits:
        total, count = torch.zeros((), device=rt.device), 0
        for x, y in eval_batches(ds_dir / f"{split}.bin", cfg.block_size, batch_size, rt.device, max_batches=limit):
            if rt.threads:
                rt.threads.update()  # --eval-only has no training loop to do it.
            with rt.autocast():
                _, loss = model(x, y)
            total += loss.float() * y.numel()  # Weighted by tokens, since the last batch may be short.
            count += y.numel()
        out[f"{split}_loss"] = total.item() / count
    model.train()
    return out


def hellaswag_scores(run: "Run") -> dict[str, float]:
    """HellaSwag's accuracies at every eval, or at the steps --hellaswag-interval names; else nothing."""
    if not run.data.hellaswag or (run.cfg.hellaswag_interval and run.step % run.cfg.hellaswag_interval):
        return {}
    return hellaswag.score(run.model, run.data.hellaswag, run.data.manifest["vocab_size"], run.rt,
                           run.cfg.eval_batch_size or run.cfg.batch_size)


@torch.no_grad()
def sample_text(run: "Run") -> str:
    """One sample of cfg.sample_tokens, with its own generator so that exact resume does not depend on sampling."""
    tok, rt = tokenizer_from_manifest(run.data.manifest), run.rt
    idx = torch.tensor([[tok.start_id]], dtype=torch.long, device=rt.device)
    gen = torch.Generator(device=rt.device).manual_seed(run.cfg.seed)
    with rt.autocast():
        out = generate(run.model, idx, run.cfg.sample_tokens, temperature=0.8, top_k=200, generator=gen,
                       vocab_size=tok.vocab_size)
    return tok.decode([int(t[0]) for t in out])


@dataclass(frozen=True)
class Data:
    """The run's dataset: its folder and manifest; on rank 0, also the HellaSwag items it scores, if any."""

    dir: Path
    manifest: dict[str, Any]
    hellaswag: list[hellaswag.Item]


@contextlib.contextmanager
def open_data(cfg: TrainConfig, rt: Runtime) -> Iterator[Data]:
    """Rank 0 prepares the dataset; every rank then holds it (so that no prepare changes it mid-run) and checks it."""
    with rt.together():
        ds_dir = dataset_dir(cfg.dataset, cfg.data_root) if rt.is_master else None
    ds_dir = ds_dir or dataset_dir(cfg.dataset, cfg.data_root, verbose=False)  # Rank 0 has said it.
    with contextlib.ExitStack() as held:
        with rt.together():
            held.enter_context(hold_dataset(ds_dir))
            manifest = read_dataset_manifest(ds_dir)
            tok = tokenizer_from_manifest(manifest)  # Fails now, not at the end-of-run sample.
            if short := [s for s in ("val", "train") if manifest[f"{s}_tokens"] <= cfg.block_size]:
                raise UserError(f"{short[0]} split of {cfg.dataset} is shorter than one block "
                                f"({cfg.block_size + 1} tokens); lower --block-size")
            items = hellaswag.load_items(cfg.hellaswag, tok) if cfg.hellaswag and rt.is_master else []
        yield Data(ds_dir, manifest, items)


def resumed_checkpoint(cfg: TrainConfig, rt: Runtime, data: Data) -> dict[str, Any] | None:
    """--resume's checkpoint, refused unless this run can continue it exactly; None for a new run."""
    path = cfg.run_dir
    if not cfg.resume:
        if rt.is_master and ((path / CKPT_NAME).is_file() or (path / BEST_NAME).is_file()):
            raise UserError(f"{path} holds a trained run; continue it with --resume, or start over in another "
                            f"--out-dir (or after deleting {path})")
        return None
    if not is_checkpoint(path) and not (path / BEST_NAME).is_file():
        raise UserError(f"--resume: no checkpoint at {path / CKPT_NAME}; drop --resume to start this run")
    ckpt = load_checkpoint(path / CKPT_NAME)
    if missing := [k for k in RESUME_KEYS if k not in ckpt]:
        raise UserError(f"cannot resume {path}: its checkpoint has no {', '.join(missing)} (not saved by train.py, "
                        f"or damaged); use --init-from {path} to start from its weights")
    saved = ckpt["train_config"]
    if saved.get("dataset") != cfg.dataset:
        raise UserError(f"cannot resume {path}: it trained on {saved.get('dataset')!r}, this run asks for "
                        f"{cfg.dataset!r}; drop --resume, or use --init-from {path} to fine-tune")
    if changes := differences(ckpt["manifest"], data.manifest):
        raise UserError(f"cannot resume {path}: dataset {cfg.dataset} was prepared again since it was saved "
                        f"({', '.join(changes)}), so its token ids mean other text; prepare the data it trained "
                        "on again, or train afresh without --resume")
    old_sha, sha = ckpt["manifest"].get("sha256"), data.manifest.get("sha256")  # The same sizes can be other text.
    if old_sha and sha and old_sha != sha:
        raise UserError(f"cannot resume {path}: dataset {cfg.dataset} was rebuilt from other text since this run "
                        f"started; use --init-from {path} to fine-tune on it, or prepare the old text again to resume")
    ignore = {"resume", "init_from", *ARCH_FIELDS}  # The checkpoint's architecture wins anyway.
    if changes := [f"{k} {saved[k]!r} -> {v!r}" for k, v in cfg.to_dict().items()
                   if k in saved and k not in ignore and saved[k] != v]:
        print(f"note: resuming with changed settings: {', '.join(changes)}")
    return ckpt


class Run(contextlib.AbstractContextManager):
    """What the loop works with (model, batches, progress, log), restored on --resume; closing it draws loss.png."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, model: GPT, optimizer: torch.optim.Optimizer, data: Data,
                 ckpt: dict[str, Any] | None, started: float) -> None:
        self.cfg, self.rt, self.model, self.optimizer, self.data, self.started = cfg, rt, model, optimizer, data, started
        # What config.json, the checkpoint and wandb record: cfg, with the architecture the weights have.
        self.settings = cfg.to_dict() | {k: getattr(model.config, k) for k in ARCH_FIELDS}
        self.grad_accum, self.run_dir = cfg.accumulation(rt.world_size), cfg.run_dir
        rows = self.grad_accum * cfg.batch_size * rt.world_size
        self.tokens_per_step = rows * cfg.block_size
        self.loader = GlobalBatchLoader(data.dir / "train.bin", cfg.block_size, rows, self.grad_accum, rt.rank,
                                        rt.world_size, rt.device, cfg.seed, cfg.sampling)
        self.step, self.saved_at = 0, None  # saved_at: the newest ckpt.pt's step
        self.best_val, self.wandb_id, self.stopped = math.inf, None, None
        resumed = ckpt is not None
        if resumed:
            self.loader.load_state_dict(ckpt["loader"])
            self.step = self.saved_at = ckpt["step"]
            self.best_val, self.wandb_id = ckpt["best_val"], ckpt.get("wandb_id")
        example = torch.zeros(2, cfg.batch_size, cfg.block_size, dtype=torch.long, device=rt.device)
        self.train_model: torch.nn.Module | None = trainable(model, rt, tuple(example))  # Compiled, DDP-wrapped.
        self.log = RunLog(self.run_dir, started, resume_step=self.step if resumed else None) if rt.is_master else None
        # The newest eval's record; {"step": n} if a signal cut it short, or on a resumed rank that keeps no log.
        self.last_eval = next((r for r in (self.log.records if self.log else [])
                               if r["step"] == self.step and "val_loss" in r), {"step": self.step} if resumed else {})
        if rt.is_master:
            announce(self, resumed)
            if rt.device_type == "cpu":
                say_if_long(self)
        if resumed:  # Last, so that nothing above (model init, compile) shifts the random streams.
            restore_rng_state(ckpt["rng"])
            if rt.rank:  # Only rank 0's streams are saved; the other ranks' dropout masks must differ from it.
                torch.manual_seed(int(np.random.SeedSequence([cfg.seed, rt.rank, self.step]).generate_state(1)[0]))

    def __exit__(self, failed: type | None, *exc: Any) -> None:
        self.train_model = None  # The DDP wrapper holds the process group, which rt.close() ends.
        if self.log is not None:
            self.log.plot()  # After a crash or a nan, still draw what was logged.
            self.log.close(exit_code=1 if failed or self.stopped is None else exit_code(self.stopped))

    @property
    def losses(self) -> dict[str, float]:
        """This step's train and val loss, if this step was evaluated."""
        now = self.last_eval if self.last_eval.get("step") == self.step else {}
        return {k: now[k] for k in ("train_loss", "val_loss") if k in now}


def final_estimate(run: Run) -> Callable[[float], float]:
    """--max-time's guess of the final eval, save and plot until one is timed: an eval batch, scaled, plus a write."""
    cfg = run.cfg
    batch_tokens = (cfg.eval_batch_size or cfg.batch_size) * cfg.block_size
    batches = min(math.ceil(run.data.manifest["val_tokens"] / batch_tokens), cfg.eval_iters or math.inf)
    batch_seconds = min(timeit.repeat(lambda: probe_loss(run), number=1, repeat=2))  # The first warms up.
    evaluating = 2 * batches * batch_seconds  # The val split, then as many train batches.
    # The weights and AdamW's two moments at a slow disk's 200 MB/s, plus 0.2 s to pickle and fsync.
    saving = 0.2 + 3 * sum(p.numel() * p.element_size() for p in run.model.parameters()) / 200e6
    return lambda step_seconds: evaluating + saving + (run.log.plot_cost if run.log else 0.0)


def probe_loss(run: Run) -> float:
    """The loss on the first val batch, in eval mode (no random draw): a cheap look at the weights."""
    return evaluate(run.model, run.data.dir, replace(run.cfg, eval_iters=1), run.rt, splits=("val",))["val_loss"]


def announce(run: Run, resumed: bool) -> None:
    """Start wandb, write config.json and manifest.json, print what runs where."""
    cfg, rt = run.cfg, run.rt
    if cfg.wandb:  # First, so that a wandb that cannot start leaves no files behind.
        run.wandb_id = run.log.start_wandb(cfg.wandb_project, cfg.wandb_run_name or cfg.name, run.settings,
                                           run.wandb_id)
    if not resumed:  # A resume's settings replace the run's at its first save, since it may fail before.
        write_json(run.run_dir / "config.json", run.settings)
    write_json(run.run_dir / "manifest.json", run.data.manifest)
    settings = " ".join(f"{k}={v}" for k, v in run.settings.items())
    print(f"config {cfg.name}: {textwrap.fill(settings, 100, subsequent_indent='  ')}")
    print(f"{run.model.num_params() / 1e6:.2f}M params | {run.tokens_per_step} tokens/step = "
          f"{run.grad_accum} accum x {rt.world_size} proc x {cfg.batch_size} x {cfg.block_size} | "
          f"{cfg.dataset}: {run.data.manifest['train_tokens']:,} train tokens"
          + (f" | resuming at step {run.step}" if resumed else "")
          + ("" if rt.attention else f" | {attention_kernel(run.model.config, rt)}"))  # setup() left it to the weights.


def say_if_long(run: Run) -> None:
    """Before a CPU run that would take over an hour, say so; the micro-batch it times (eval mode) leaves no trace."""
    cfg, rt = run.cfg, run.rt
    x = torch.zeros(cfg.batch_size, cfg.block_size, dtype=torch.long, device=rt.device)
    run.model.eval()
    with rt.autocast():  # Evals are left out; "about" needs no more.
        step = run.grad_accum * timeit.timeit(lambda: run.model(x, x)[1].backward(), number=1)
    run.model.train().zero_grad(set_to_none=True)
    seconds = min(step * (cfg.max_iters - run.step), cfg.max_time or math.inf)
    if seconds > 3600:  # A run over an hour is one a user should choose knowingly.
        print(f"note: this run would take about {seconds / 3600:.0f} h on this CPU ({step:.1f} s a step); {cfg.name} "
              "is sized for a GPU; on a CPU use --config small, or set --max-time", file=sys.stderr)


class TrainingDiverged(UserError):
    """The loss or the weights became nan/inf: the message names the last good checkpoint and what to try."""

    def __init__(self, run: Run, what: str) -> None:
        kept = f"the last good checkpoint is {run.run_dir / CKPT_NAME} (step {run.saved_at})" if run.saved_at \
            else "this run saved no checkpoint"
        super().__init__(f"{what}; stopped without saving, {kept}; try a lower --lr, --grad-clip 1.0 or "
                         "--dtype float32")


def save(run: Run) -> None:
    """Write ckpt.pt, never from weights that blew up (a stop right after such an update leaves them finite)."""
    loss = run.losses["val_loss"] if run.losses else probe_loss(run)
    if not (math.isfinite(loss) and torch.stack([p.isfinite().all() for p in run.model.parameters()]).all()):
        raise TrainingDiverged(run, f"the weights diverged at step {run.step} (loss {loss} on a val batch)")
    save_checkpoint(run.run_dir, {
        "model": run.model.state_dict(), "model_config": asdict(run.model.config), "train_config": run.settings,
        "optimizer": run.optimizer.state_dict(), "scaler": run.rt.scaler.state_dict(), "step": run.step,
        "loader": run.loader.state_dict(), "rng": capture_rng_state(), "best_val": run.best_val,
        "wandb_id": run.wandb_id, "manifest": run.data.manifest})
    write_json(run.run_dir / "config.json", run.settings)  # --resume reads the settings of this ckpt.pt.
    run.saved_at = run.step


LOCK_NAME = ".lock"
RUN_FILES = (CKPT_NAME, BEST_NAME, "config.json", "manifest.json", "metrics.jsonl", "loss.png")  # And "wandb/".


def lock_run_dir(run_dir: str | Path, fresh: bool = False) -> contextlib.ExitStack:
    """Create and lock run_dir (flock: no stale lock after kill -9) until the stack closes; failing undoes creating."""
    import fcntl
    run_dir = Path(run_dir)
    created, lock = _usable_out_dir(run_dir, fresh)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        holder = (run_dir / LOCK_NAME).read_text().strip() or "?"
        raise UserError(f"{run_dir} is in use by another run (pid {holder}); wait for it to finish, "
                        "or pick another --out-dir") from None
    lock.truncate(0)
    print(os.getpid(), file=lock, flush=True)
    # Every writer holds the lock, so the temp files of atomic writes found now are from dead processes.
    if stale := [p for name in RUN_FILES for p in run_dir.glob(f".{name}.*.tmp") if p.is_file()]:
        for p in stale:
            p.unlink(missing_ok=True)
        print(f"note: removed {len(stale)} temp file(s) of interrupted saves from {run_dir}")

    def remove_if_unused(failed: type | None, *_: Any) -> None:  # A run that failed before writing leaves nothing.
        with contextlib.suppress(OSError):  # A folder that is not empty holds something else.
            if failed is not None and created and os.listdir(created[0].parent) == [LOCK_NAME]:
                for path in created:  # The lock file, then the folders, innermost first.
                    path.rmdir() if path.is_dir() else path.unlink()

    held = contextlib.ExitStack()
    held.enter_context(lock)
    held.push(remove_if_unused)  # It returns None, so the error goes on.
    return held


def _usable_out_dir(run_dir: Path, fresh: bool) -> tuple[list[Path], Any]:
    """Create run_dir and open its lock file; return both. A fresh run refuses files no run wrote."""
    try:
        if is_dataset(run_dir):  # Its next rebuild would replace the run.
            raise UserError(f"--out-dir {run_dir} holds a prepared dataset; pick another --out-dir")
        created = [p for p in (run_dir / LOCK_NAME, run_dir, *run_dir.parents) if not p.exists()]
        run_dir.mkdir(parents=True, exist_ok=True)
        held = sorted(os.listdir(run_dir))
        if links := [name for name in held if (run_dir / name).is_symlink()]:  # They would write outside it.
            raise UserError(f"{run_dir} holds symbolic links ({', '.join(links)}); a run writes only inside its out "
                            "dir: remove them or pick another --out-dir")
        ours = LOCK_NAME in held
        if foreign := [name for name in held if fresh and not (ours and name in (*RUN_FILES, "wandb"))
                       and name[0] != "." and not name.endswith(".log")]:  # `| tee out/x/train.log` comes first.
            foreign.sort(key=lambda name: name in RUN_FILES)  # The telling names first.
            raise UserError(f"--out-dir {run_dir} holds files no run of this project wrote ({', '.join(foreign[:3])}"
                            f"{', ...' * (len(foreign) > 3)}); pick another --out-dir")
        return created, open(run_dir / LOCK_NAME, "a+")
    except OSError as e:
        what = "is a file, not a directory" if os.path.isfile(run_dir) else f"cannot be written ({e.strerror}: {e.filename})"
        raise UserError(f"--out-dir {run_dir} {what}; pick another --out-dir") from None
