"""One training run's pieces: its data, model and optimizer, fresh or resumed (start_run),
its state (Run, RunState), and how it is evaluated and saved. train.py's loop drives them.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkpoint import CKPT_NAME, capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint, write_json
from configs import TrainConfig, model_fields
from data import tokenizer_from_manifest
from data.manifest import VOCABULARY, differences, read_dataset_manifest
from errors import UserError
from optim import configure_optimizer
from reference import Reference
from runlog import RunLog
from data.loader import GlobalBatchLoader
from runtime import Runtime, TrainModule

# The architecture a checkpoint brings replaces these; dropout and block_size stay the run's.
ARCH_FIELDS = tuple(k for k in model_fields() if k not in ("dropout", "block_size"))
RESUME_KEYS = ("model", "train_config", "optimizer", "scaler", "step", "loader", "rng", "best_val", "manifest")


def build_model(cfg: TrainConfig, manifest: dict[str, Any], ckpt: dict | None) -> tuple[torch.nn.Module, TrainConfig]:
    """The GPT for this run: the resumed checkpoint's, --init-from weights, or fresh from cfg.

    Weights from a checkpoint or a pretrained model bring their architecture (cfg's model fields
    are updated to match and the difference is printed); dropout always comes from cfg."""
    from checkpoint import find_checkpoint, model_from_checkpoint
    from model import GPT

    src, vocab_size = ckpt, manifest["vocab_size"]
    source: str | Path = cfg.run_dir / CKPT_NAME if ckpt is not None else cfg.init_from
    if ckpt is None and cfg.init_from:
        from checkpoint import is_checkpoint
        from model.hf import load_hf_gpt2, resolve_init_from

        path = resolve_init_from(cfg.init_from)  # a run of ours, a HF GPT-2 dir, or a hub id from the HF cache
        if is_checkpoint(path):
            source = find_checkpoint(path, best=True)
            src = load_checkpoint(source)
            if src.get("manifest") and (changes := differences(src["manifest"], manifest, VOCABULARY)):
                raise UserError(f"--init-from {source}: it was trained with another vocabulary than dataset "
                                f"{cfg.dataset}'s ({', '.join(changes)}); fine-tune on data of its tokenizer")
        else:
            model = load_hf_gpt2(path, dropout=cfg.dropout)
    if src is not None:
        model = model_from_checkpoint(src, source, dropout=cfg.dropout)
    elif not cfg.init_from:
        model = GPT(cfg.model_config(vocab_size))
    mc = model.config
    if mc.vocab_size < vocab_size:
        raise UserError(f"the model's vocabulary ({mc.vocab_size}) is smaller than the tokenizer's of "
                        f"dataset {cfg.dataset} ({vocab_size}); use a dataset with the model's tokenizer")
    if cfg.block_size > mc.block_size:
        raise UserError(f"--block-size {cfg.block_size} exceeds the model's context ({mc.block_size})")
    built = replace(cfg, **{k: getattr(mc, k) for k in ARCH_FIELDS})
    changed = [f"{k}={getattr(built, k)}" for k in ARCH_FIELDS if getattr(cfg, k) != getattr(built, k)
               and not (k == "vocab_size" and cfg.vocab_size == 0)]
    if changed:
        print(f"note: architecture taken from {source}: {' '.join(changed)}")
    return model, built


def eval_only(cfg: TrainConfig, rt: Runtime) -> dict[str, Any]:
    """--eval-only: mean loss and perplexity of --init-from (or out_dir's best checkpoint) on the
    whole val split of cfg.dataset, and on as many train windows (from the start)."""
    from checkpoint import is_checkpoint

    if rt.ddp:
        raise UserError("--eval-only runs in one process; start it with python, not torchrun")
    ds_dir = dataset_dir(cfg)
    manifest = read_dataset_manifest(ds_dir)
    if not cfg.init_from and not is_checkpoint(cfg.run_dir):
        raise UserError(f"--eval-only: no checkpoint in {cfg.run_dir}; train one first, or pass --init-from "
                        "(a run dir, a Hugging Face GPT-2 dir or a hub id such as gpt2)")
    ckpt = None if cfg.init_from else load_checkpoint(cfg.run_dir, best=True)
    model, cfg = build_model(replace(cfg, eval_iters=0), manifest, ckpt)
    losses = evaluate(model.to(rt.device), ds_dir, cfg, rt)
    print(f"{cfg.init_from or cfg.run_dir} on {cfg.dataset} (block_size {cfg.block_size}):")
    for split, extent in (("val", "the whole split"), ("train", "as many windows")):
        loss = losses[f"{split}_loss"]
        print(f"  {split:<5} loss {loss:.4f}  perplexity {math.exp(loss):.2f}  ({extent})")
    return {**losses, "stopped": "eval_only"}


def check_resumable(cfg: TrainConfig, ckpt: dict, path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a checkpoint --resume cannot continue exactly: incomplete, or from other data."""
    if missing := [k for k in RESUME_KEYS if k not in ckpt]:
        raise UserError(f"cannot resume {path}: its checkpoint has no {', '.join(missing)} (not saved by train.py, "
                        f"or damaged); use --init-from {path} to start from its weights")
    saved = ckpt["train_config"]
    if saved.get("dataset") != cfg.dataset:
        raise UserError(f"cannot resume {path}: it trained on {saved.get('dataset')!r}, this run asks for "
                        f"{cfg.dataset!r}; drop --resume, or use --init-from {path} to fine-tune")
    if changes := differences(ckpt["manifest"], manifest):
        raise UserError(f"cannot resume {path}: dataset {cfg.dataset} was prepared again since it was saved "
                        f"({', '.join(changes)}), so its token ids mean other text; prepare the data it trained "
                        "on again, or train afresh without --resume")
    ignore = {"resume", "init_from", *ARCH_FIELDS}  # the checkpoint's architecture wins anyway
    changes = [f"{k} {saved[k]!r} -> {v!r}" for k, v in cfg.to_dict().items()
               if k in saved and k not in ignore and saved[k] != v]
    if changes:
        print(f"note: resuming with changed settings: {', '.join(changes)}")


def dataset_dir(cfg: TrainConfig) -> Path:
    """A preset is prepared on first use (a no-op later); anything else must have been prepared
    with `python -m data.prepare` (e.g. a Hugging Face corpus) and is used as it is."""
    from data.prepare import PRESETS, prepare

    if cfg.dataset in PRESETS:
        return prepare(cfg.dataset, out_root=cfg.data_root)
    path = Path(cfg.data_root) / cfg.dataset
    if (path / "manifest.json").is_file():
        return path
    raise UserError(f"dataset {cfg.dataset!r} is neither a preset ({', '.join(PRESETS)}) nor prepared in {path}; "
                    f"prepare it first: python -m data.prepare --hf <hub dataset> --name {cfg.dataset}")


@torch.no_grad()
def evaluate(model: torch.nn.Module, ds_dir: Path, cfg: TrainConfig, rt: Runtime) -> dict[str, float]:
    """Mean loss per token on fixed batches: the first eval_iters batches of each split; with
    eval_iters 0 the whole val split, and as many batches of train (which can be huge)."""
    from data import eval_batches, read_tokens

    model.eval()
    out = {}
    batch_size = cfg.eval_batch_size or cfg.batch_size
    val_batches = math.ceil(len(read_tokens(ds_dir / "val.bin")) // cfg.block_size / batch_size)
    for split in ("val", "train"):
        limit = cfg.eval_iters or val_batches
        total, count = torch.zeros((), device=rt.device), 0
        for x, y in eval_batches(ds_dir / f"{split}.bin", cfg.block_size, batch_size, rt.device, max_batches=limit):
            with rt.autocast():
                _, loss = model(x, y)
            total += loss.float() * y.numel()  # weight by tokens: the last batch may be short
            count += y.numel()
        if count == 0:
            raise UserError(f"{split} split of {cfg.dataset} is shorter than one block "
                            f"({cfg.block_size + 1} tokens); lower --block-size")
        out[f"{split}_loss"] = total.item() / count
    model.train()
    return out


@torch.no_grad()
def sample_text(model: torch.nn.Module, manifest: dict[str, Any], n_tokens: int, rt: Runtime, seed: int) -> str:
    """One sample from the tokenizer's start token (end-of-text, else a newline), with its own
    generator so the training RNG streams are untouched (exact resume does not depend on sampling)."""
    tok = tokenizer_from_manifest(manifest)
    idx = torch.tensor([[tok.start_id]], dtype=torch.long, device=rt.device)
    gen = torch.Generator(device=rt.device).manual_seed(seed)
    with rt.autocast():
        ids = [int(t[0]) for t in model.generate(idx, n_tokens, temperature=0.8, top_k=200, generator=gen)]
    return tok.decode(ids)


@dataclass
class RunState:
    """The loop's own progress; every checkpoint stores it."""

    step: int = 0
    best_val: float = math.inf
    saved_at: int | None = None  # step of the newest ckpt.pt of this run
    evaluated_at: int | None = None
    losses: dict[str, float] = field(default_factory=dict)  # the newest eval's
    wandb_id: str | None = None


@dataclass
class Run:
    """Everything the loop works with, built once by start_run()."""

    cfg: TrainConfig
    rt: Runtime
    model: torch.nn.Module  # the raw module: what is saved, evaluated and sampled
    train_model: TrainModule  # model, compiled and/or DDP-wrapped: what trains
    optimizer: Any
    loader: GlobalBatchLoader
    manifest: dict[str, Any]
    ds_dir: Path
    run_dir: Path
    grad_accum: int
    log: RunLog | None  # rank 0 only
    state: RunState

    @property
    def tokens_per_step(self) -> int:
        return self.grad_accum * self.cfg.batch_size * self.cfg.block_size * self.rt.world_size

    def final_estimate(self, step_seconds: float) -> float:
        """Seconds the final eval + save + plot take, until one has been timed. The eval is one
        timed eval batch scaled to the eval's size, not a fixed share of a step's time: that share
        was 0.2 on a bf16 CPU and 0.33 on an AVX2 one, where the run overshot --max-time by 1.3 s."""
        eval_batch = (self.cfg.eval_batch_size or self.cfg.batch_size) * self.cfg.block_size
        val_tokens = min(self.manifest["val_tokens"], self.cfg.eval_iters * eval_batch or math.inf)
        evaluating = self.eval_batch_seconds * 2 * math.ceil(val_tokens / eval_batch)  # val, and as much train
        ckpt_bytes = CKPT_BYTES_PER_WEIGHT_BYTE * sum(p.numel() * p.element_size() for p in self.model.parameters())
        return evaluating + SAVE_FIXED_S + ckpt_bytes / DISK_BYTES_PER_S + (self.log.plot_cost if self.log else 0.0)

    @cached_property
    def eval_batch_seconds(self) -> float:
        """One eval batch's forward, timed once, warm: a cold first call took 1.2x as long."""
        from data import eval_batches

        x, y = next(eval_batches(self.ds_dir / "val.bin", self.cfg.block_size,
                                 self.cfg.eval_batch_size or self.cfg.batch_size, self.rt.device, max_batches=1))
        self.model.eval()
        with torch.no_grad(), self.rt.autocast():
            for _ in range(2):
                t0 = time.perf_counter()
                self.model(x, y)[1].item()  # .item(): wait for the device
        self.model.train()
        return time.perf_counter() - t0


# A checkpoint holds the weights and AdamW's two moments (~3x the weights), written at the
# speed of a slow disk, plus a fixed cost for pickling and fsync.
CKPT_BYTES_PER_WEIGHT_BYTE, DISK_BYTES_PER_S, SAVE_FIXED_S = 3, 200e6, 0.2


def start_run(cfg: TrainConfig, rt: Runtime, t_start: float) -> Run:
    """Data, model, optimizer, loader and run log, fresh or restored from --resume."""
    master, run_dir = rt.is_master, cfg.run_dir
    ds_dir = dataset_dir(cfg) if master else None
    rt.barrier()  # rank 0 prepared the data (idempotent); the others now just find it
    ds_dir = ds_dir or dataset_dir(cfg)
    manifest = read_dataset_manifest(ds_dir)
    tokenizer_from_manifest(manifest)  # fails now, not at the end-of-run sample, if it cannot be built
    ckpt = load_checkpoint(run_dir / CKPT_NAME) if cfg.resume else None
    if ckpt is not None:
        check_resumable(cfg, ckpt, run_dir, manifest)
    elif master and (run_dir / CKPT_NAME).is_file():
        print(f"note: starting fresh; this run will overwrite {run_dir / CKPT_NAME} (--resume continues it)")
    model, cfg = build_model(cfg, manifest, ckpt)
    if cfg.batch_size == 0:  # --batch-size auto: sized from free memory, before the weights move there
        from plan import auto_batch_size

        cfg = auto_batch_size(cfg, model, rt)
    model.to(rt.device)
    optimizer = configure_optimizer(model, cfg, fused=rt.plan.fused_adamw, dtype=rt.plan.dtype)
    micro_tokens = cfg.batch_size * cfg.block_size * rt.world_size
    tokens_per_step = cfg.tokens_per_step or micro_tokens
    if tokens_per_step % micro_tokens:
        raise UserError(f"--tokens-per-step {tokens_per_step} is not a multiple of batch_size x block_size x "
                        f"processes = {micro_tokens}; pick a multiple (or 0 for one micro-batch per step)")
    grad_accum = tokens_per_step // micro_tokens
    loader = GlobalBatchLoader(ds_dir / "train.bin", cfg.block_size, tokens_per_step // cfg.block_size, grad_accum,
                               rt.rank, rt.world_size, rt.device, cfg.seed, cfg.sampling)
    state = RunState()
    if ckpt is not None:
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
            rt.scaler.load_state_dict(ckpt["scaler"])
            loader.load_state_dict(ckpt["loader"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise UserError(f"cannot resume {run_dir}: its optimizer state does not fit this run ({e}); resume with "
                            f"the --optimizer it was saved with, or use --init-from {run_dir}") from None
        state = RunState(step=ckpt["step"], best_val=ckpt["best_val"], saved_at=ckpt["step"],
                         wandb_id=ckpt.get("wandb_id"))
    train_model = TrainModule(model, rt)  # compiled (or not) and DDP-wrapped
    log = RunLog(run_dir, t_start, resume_step=state.step if ckpt is not None else None,
                 reference=Reference.matching(cfg.to_dict(), rt.world_size)) if master else None
    run = Run(cfg, rt, model, train_model, optimizer, loader, manifest, ds_dir, run_dir,
              grad_accum, log, state)
    if master:
        announce(run, resumed=ckpt is not None)
    if ckpt is not None:  # last, so nothing above (model init, compile) shifts the streams
        restore_rng_state(ckpt["rng"])
        if rt.rank:  # only rank 0's streams are saved; keep the ranks' dropout masks distinct
            torch.manual_seed(int(np.random.SeedSequence([cfg.seed, rt.rank, state.step]).generate_state(1)[0]))
    return run


def announce(run: Run, resumed: bool) -> None:
    """Write config.json and manifest.json, print what runs where, start wandb."""
    cfg, rt, st = run.cfg, run.rt, run.state
    write_json(run.run_dir / "config.json", cfg.to_dict())
    write_json(run.run_dir / "manifest.json", run.manifest)
    print(f"config {cfg.name}: {cfg.summary()}")
    print(f"{run.model.num_params() / 1e6:.2f}M params | {run.tokens_per_step} tokens/step = "
          f"{run.grad_accum} accum x {rt.world_size} proc x {cfg.batch_size} x {cfg.block_size} | "
          f"{cfg.dataset}: {run.manifest['train_tokens']:,} train tokens"
          + (f" | resuming at step {st.step}" if resumed else ""))
    if cfg.wandb:
        st.wandb_id = run.log.start_wandb(cfg.wandb_project, cfg.wandb_run_name or cfg.name, cfg.to_dict(),
                                          st.wandb_id)


def save(run: Run) -> None:
    st = run.state
    save_checkpoint(run.run_dir, {
        "model": run.model.state_dict(), "model_config": asdict(run.model.config),
        "train_config": run.cfg.to_dict(), "optimizer": run.optimizer.state_dict(),
        "scaler": run.rt.scaler.state_dict(), "step": st.step, "loader": run.loader.state_dict(),
        "rng": capture_rng_state(), "best_val": st.best_val, "wandb_id": st.wandb_id,
        "manifest": run.manifest})
    st.saved_at = st.step


