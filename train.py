"""Train a GPT, from one CPU to many GPUs.

    python train.py --config small                 # the main job: char-level Shakespeare, ~2 min on a CPU
    python train.py --config small --max-iters 200 --device cpu --lr 3e-4 --no-compile
    python train.py --config small --resume        # continue out/small exactly where it stopped
    python train.py --config small --max-time 60   # wall-clock budget (s), final eval+save included
    python train.py --config runs/mine.toml        # TOML of field overrides, optionally base = "small"
    python train.py --config finetune_gpt2 --init-from models/gpt2   # a local Hugging Face GPT-2 dir
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2
    python train.py --config gpt2 --plan --gpu h100 --nproc 8   # memory and time on paper (plan.py)
    python train.py --config gpt2 --batch-size auto # the largest micro-batch that fits, same global batch
    python train.py --help                         # every option, with its default

Configs: configs/<name>.py; every field is a flag (--max-iters 200, --max_iters=200, --no-wandb).
A run writes out/<config>/: ckpt.pt, config.json, manifest.json, metrics.jsonl and loss.png.
Ctrl-C (or SIGTERM) finishes the current step, evaluates, saves and exits 130 (143 for SIGTERM);
Ctrl-C twice quits at once without saving. A nan/inf loss stops the run without saving (the last
good checkpoint stays) and exits 2, as do bad options. Sample afterwards: python sample.py.
On a CPU shared with other busy processes, OMP_NUM_THREADS=1 can be many times faster (idle
OpenMP threads spin-wait for threads the OS has descheduled).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint, write_json
from configs import TrainConfig, available_configs, help_text, load_config, model_fields
from errors import UserError, entry_point
from optim import configure_optimizer, lr_multiplier, set_lr
from runtime import GlobalBatchLoader, Runtime, RunLog, StopSignal, setup

# The architecture a checkpoint brings replaces these; dropout and block_size stay the run's.
ARCH_FIELDS = tuple(k for k in model_fields() if k not in ("dropout", "block_size"))


class TrainingDiverged(UserError):
    """The loss became nan/inf; carries the user-facing advice."""


def build_model(cfg: TrainConfig, vocab_size: int, ckpt: dict | None) -> tuple[torch.nn.Module, TrainConfig]:
    """The GPT for this run: the resumed checkpoint's, --init-from weights, or fresh from cfg.

    Weights from a checkpoint or a pretrained model bring their architecture (cfg's model fields
    are updated to match and the difference is printed); dropout always comes from cfg."""
    from checkpoint import model_from_checkpoint
    from model import GPT

    source, src = ("checkpoint", ckpt) if ckpt is not None else (cfg.init_from, None)
    path = Path(cfg.init_from)
    if ckpt is None and cfg.init_from:
        if (path / "ckpt.pt").is_file() or path.suffix == ".pt":
            src = load_checkpoint(path)
        elif (path / "config.json").is_file():
            from model.hf import load_hf_gpt2

            model = load_hf_gpt2(path, dropout=cfg.dropout)
        else:
            what = "not a run directory (no ckpt.pt) nor a Hugging Face GPT-2 directory (no config.json)"
            raise UserError(f"--init-from {path}: {what if path.exists() else 'does not exist'}; for GPT-2 run "
                            f"`huggingface-cli download gpt2 --local-dir {path}` where there is internet")
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


def check_resumable(cfg: TrainConfig, ckpt: dict, path: Path) -> None:
    saved = ckpt["train_config"]
    if saved.get("dataset") != cfg.dataset:
        raise UserError(f"cannot resume {path}: it trained on {saved.get('dataset')!r}, this run asks for "
                        f"{cfg.dataset!r}; drop --resume, or use --init-from {path} to fine-tune")
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
def sample_text(model: torch.nn.Module, tok: Any, n_tokens: int, rt: Runtime, seed: int) -> str:
    """One sample from a newline (char) or end-of-text (BPE) prompt, with its own generator so
    the training RNG streams are untouched (exact resume does not depend on sampling)."""
    start = tok.eot_id if tok.eot_id is not None else tok.encode("\n")[0]
    idx = torch.tensor([[start]], dtype=torch.long, device=rt.device)
    gen = torch.Generator(device=rt.device).manual_seed(seed)
    with rt.autocast():
        ids = [int(t[0]) for t in model.generate(idx, n_tokens, temperature=0.8, top_k=200, generator=gen)]
    return tok.decode(ids)


def forward_backward(train_model: torch.nn.Module, loader: GlobalBatchLoader, rt: Runtime,
                     grad_accum: int) -> torch.Tensor:
    """Accumulate gradients over grad_accum micro-batches; returns this rank's mean loss (a tensor).

    Under DDP only the last micro-step all-reduces the gradients (no_sync on the others)."""
    loss_sum = torch.zeros((), device=rt.device)
    for micro in range(grad_accum):
        x, y = loader.next_batch()
        sync = train_model.no_sync() if rt.ddp and micro < grad_accum - 1 else contextlib.nullcontext()
        with sync:
            with rt.autocast():
                _, loss = train_model(x, y)
            loss = loss / grad_accum
            rt.scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
    return loss_sum


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime,
                   grad_clip: float) -> torch.Tensor | None:
    """Clip (on unscaled gradients), step, zero; returns the pre-clip gradient norm if clipping."""
    grad_norm = None
    if grad_clip:
        rt.scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    rt.scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
    rt.scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run one training job described by cfg; returns final losses, paths and why it stopped."""
    t_start = time.time()
    rt = setup(cfg)
    try:
        with StopSignal(escalate=not rt.ddp) as stop:
            return _train(cfg, rt, stop, t_start)
    finally:
        rt.close()


def _train(cfg: TrainConfig, rt: Runtime, stop: StopSignal, t_start: float) -> dict[str, Any]:
    from tqdm import tqdm

    from data import tokenizer_from_manifest

    master, run_dir = rt.is_master, Path(cfg.out_dir or f"out/{cfg.name}")
    ds_dir = dataset_dir(cfg) if master else None
    rt.barrier()  # rank 0 prepared the data (idempotent); the others now just find it
    ds_dir = ds_dir or dataset_dir(cfg)
    manifest = json.loads((ds_dir / "manifest.json").read_text())
    tok = tokenizer_from_manifest(manifest)

    ckpt = load_checkpoint(run_dir) if cfg.resume else None
    if ckpt is not None:
        check_resumable(cfg, ckpt, run_dir)
    elif master and (run_dir / "ckpt.pt").is_file():
        print(f"note: starting fresh; this run will overwrite {run_dir / 'ckpt.pt'} (--resume continues it)")
    model, cfg = build_model(cfg, manifest["vocab_size"], ckpt)
    if cfg.batch_size == 0:  # --batch-size auto (issue 14): sized from free memory, before the weights move there
        from plan import auto_batch_size

        cfg = auto_batch_size(cfg, model, rt)
    model.to(rt.device)
    optimizer = configure_optimizer(model, cfg, rt.device_type)
    micro_tokens = cfg.batch_size * cfg.block_size * rt.world_size
    tokens_per_step = cfg.tokens_per_step or micro_tokens
    if tokens_per_step % micro_tokens:
        raise UserError(f"--tokens-per-step {tokens_per_step} is not a multiple of batch_size x block_size x "
                        f"processes = {micro_tokens}; pick a multiple (or 0 for one micro-batch per step)")
    grad_accum = tokens_per_step // micro_tokens
    loader = GlobalBatchLoader(ds_dir / "train.bin", cfg, rt)
    step, best_val, wandb_id = 0, math.inf, None
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        rt.scaler.load_state_dict(ckpt["scaler"])
        loader.load_state_dict(ckpt["loader"])
        step, best_val, wandb_id = ckpt["step"], ckpt["best_val"], ckpt.get("wandb_id")
    train_model = torch.compile(model) if cfg.compile else model  # `model` stays the raw module we save
    if rt.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(train_model, device_ids=[rt.local_rank] if rt.device_type == "cuda" else None)

    log = RunLog(run_dir, resume_step=step if ckpt is not None else None) if master else None
    if master:
        write_json(run_dir / "config.json", cfg.to_dict())
        write_json(run_dir / "manifest.json", manifest)
        print(f"config {cfg.name}: {cfg.summary()}")
        print(f"{rt.describe()} | {model.num_params() / 1e6:.2f}M params | {tokens_per_step} tokens/step = "
              f"{grad_accum} accum x {rt.world_size} proc x {cfg.batch_size} x {cfg.block_size} | "
              f"{cfg.dataset}: {manifest['train_tokens']:,} train tokens" + (f" | resuming at step {step}" if ckpt else ""))
        if cfg.wandb:
            wandb_id = log.start_wandb(cfg.wandb_project, cfg.wandb_run_name or cfg.name, cfg.to_dict(), wandb_id)
    if ckpt is not None:  # last, so nothing above (model init, compile) shifts the streams
        restore_rng_state(ckpt["rng"])
        if rt.rank:  # only rank 0's streams are saved; keep the ranks' dropout masks distinct
            torch.manual_seed(cfg.seed + rt.rank + 7919 * step)
        del ckpt

    ckpt_path = run_dir / "ckpt.pt"
    flops_per_token = model.flops_per_token(cfg.block_size)
    peak = rt.peak_flops * rt.world_size if rt.peak_flops else None
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cost = {"eval": None, "save": 0.2 + 3 * param_bytes / 200e6}  # seconds; measured ones replace these
    state = {"evaluated": None, "saved": step if cfg.resume else None, "losses": {}}

    eval_batch = (cfg.eval_batch_size or cfg.batch_size) * cfg.block_size
    val_tokens = manifest["val_tokens"] if not cfg.eval_iters else cfg.eval_iters * eval_batch
    eval_tokens = 2 * min(val_tokens, manifest["val_tokens"])  # val, and as much of train

    def final_cost(step_time: float) -> float:
        """Seconds the final eval + save + plot take: measured once an eval has run, before that
        estimated from the step time: an eval token, forward only and in big batches, costs
        about a fifth of a training token (measured on CPU; the first real eval replaces it)."""
        ev = cost["eval"] if cost["eval"] is not None else step_time * eval_tokens / tokens_per_step / 5
        return ev + cost["save"] + (log.plot_cost if log else 0.0)

    def eval_and_save(at: int, final: bool = False) -> None:
        nonlocal best_val
        t_eval, note = time.time(), ""
        if master:
            losses = evaluate(model, ds_dir, cfg, rt)
            improved = losses["val_loss"] < best_val
            best_val = min(best_val, losses["val_loss"])
            log.log({"step": at, **losses, "time": round(time.time() - t_start, 3)})
            if cfg.sample_tokens and log.wandb is not None:
                log.log_sample(at, sample_text(model, tok, cfg.sample_tokens, rt, cfg.seed))
            if at > 0 and state["saved"] != at:
                t0 = time.time()
                save_checkpoint(run_dir, {
                    "model": model.state_dict(), "model_config": asdict(model.config),
                    "train_config": cfg.to_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": rt.scaler.state_dict(), "step": at, "loader": loader.state_dict(),
                    "rng": capture_rng_state(), "best_val": best_val, "wandb_id": wandb_id,
                    "manifest": manifest})
                cost["save"], state["saved"], note = time.time() - t0, at, ", saved"
            log.plot(force=final)
            state["losses"] = losses
            tqdm.write(f"step {at}: train {losses['train_loss']:.4f}, val {losses['val_loss']:.4f}"
                       f"{' (best)' if improved else ''}{note}")
        state["evaluated"] = at
        rt.barrier()
        drawn = log.plot_cost if log and log.plotted_at > t_eval else 0.0
        cost["eval"] = time.time() - t_eval - (cost["save"] if note else 0.0) - drawn  # eval + samples

    bar = tqdm(total=cfg.max_iters, initial=step, disable=not master, dynamic_ncols=True, unit="step")
    stopped, trained, train_time, window = None, 0, 0.0, []
    try:
        if step == 0 and not cfg.max_time:
            eval_and_save(0)  # the untrained model's loss anchors the curve (ln(vocab) expected)
        t_loop, step_time = time.time(), 0.0
        while step < cfg.max_iters:
            t0 = time.perf_counter()
            decay_iters = (cfg.lr_decay_iters or cfg.max_iters) - cfg.warmup_iters
            progress = (step - cfg.warmup_iters) / max(1, decay_iters)
            if cfg.max_time:  # share of the time left for training, once startup and the final eval are paid
                budget = cfg.max_time - (t_loop - t_start) - final_cost(step_time)
                progress = max(progress, (time.time() - t_loop) / max(budget, 1e-3))
            multiplier = lr_multiplier(step, progress, cfg)
            set_lr(optimizer, multiplier)
            lr = cfg.lr * multiplier
            loss_sum = forward_backward(train_model, loader, rt, grad_accum)
            # Stop after this step if the next one plus the final eval+save would overrun max_time.
            step_time = time.perf_counter() - t0
            reserve = 1.2 * final_cost(step_time) + step_time
            late = cfg.max_time > 0 and time.time() - t_start + reserve > cfg.max_time
            # one small collective: the global mean loss, and whether any rank must stop
            flags = torch.tensor([0.0, float(stop.name is not None), float(late)], device=rt.device)
            flags[0] = loss_sum
            if rt.ddp:
                torch.distributed.all_reduce(flags)
                flags[0] /= rt.world_size
            loss_val, signalled, late = flags.tolist()
            if not math.isfinite(loss_val):
                optimizer.zero_grad(set_to_none=True)
                kept = (f"the last good checkpoint is {ckpt_path} (step {state['saved']})" if state["saved"]
                        else "no checkpoint was written")
                raise TrainingDiverged(f"loss became {loss_val} at step {step + 1}; stopped without saving, {kept}; "
                                       "try a lower --lr, --grad-clip 1.0 or --dtype float32")
            grad_norm = optimizer_step(model, optimizer, rt, cfg.grad_clip)
            step, trained = step + 1, trained + 1
            dt = time.perf_counter() - t0
            train_time += dt
            window.append((loss_val, dt))
            bar.update(1)
            if master and (step % cfg.log_interval == 0 or signalled or late or step == cfg.max_iters):
                tok_s = tokens_per_step * len(window) / sum(d for _, d in window)
                mfu = flops_per_token * tok_s / peak if peak else None
                mean_loss = sum(v for v, _ in window) / len(window)
                log.log({"step": step, "loss": mean_loss, "lr": lr, "tokens_per_s": round(tok_s, 1), "mfu": mfu,
                         "grad_norm": grad_norm.item() if grad_norm is not None else None,
                         "time": round(time.time() - t_start, 3)})
                bar.set_postfix_str(f"loss {mean_loss:.4f} lr {lr:.2e} {tok_s:,.0f} tok/s"
                                    + (f" mfu {100 * mfu:.1f}%" if mfu is not None else ""), refresh=False)
                window = []
            if signalled or late:
                stopped = (stop.name or "SIGTERM") if signalled else "max_time"
                break
            if step % cfg.eval_interval == 0 and step < cfg.max_iters:
                eval_and_save(step)
        stopped = stopped or "max_iters"
        bar.close()
        if state["evaluated"] != step or state["saved"] != step:
            eval_and_save(step, final=True)
    finally:
        bar.close()
        if log is not None:
            log.plot(force=stopped is None)  # a crash or nan: still draw what was logged
            log.close()

    elapsed = time.time() - t_start
    result = {"step": step, "stopped": stopped, "best_val": best_val, "elapsed": elapsed, "out_dir": str(run_dir),
              "checkpoint": str(ckpt_path), "metrics": str(run_dir / "metrics.jsonl"),
              "plot": str(run_dir / "loss.png"), "iters_per_s": trained / train_time if train_time else None,
              **state["losses"]}
    if master:
        speed = f", {result['iters_per_s']:.1f} it/s" if trained else ""
        print(f"stopped at step {step} ({stopped}) after {elapsed:.1f}s{speed}")
        if state["losses"]:
            print(f"final: train loss {result['train_loss']:.4f}, val loss {result['val_loss']:.4f} "
                  f"(best val {best_val:.4f})")
        print(f"checkpoint {ckpt_path}\nmetrics    {result['metrics']}\nloss curve {result['plot']}")
        if cfg.sample_tokens:
            result["sample"] = sample_text(model, tok, cfg.sample_tokens, rt, cfg.seed)
            print(f"sample (python sample.py --out-dir {run_dir} for more):\n{result['sample']}")
    return result


@entry_point
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__ + f"\nConfigs: {', '.join(available_configs())}\nOptions:\n{help_text()}")
        return 0
    name, rest = "small", []
    while argv:  # --config NAME may sit anywhere; the rest are field overrides
        arg = argv.pop(0)
        if arg == "--config" and argv:
            name = argv.pop(0)
        elif arg.startswith("--config="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if "--plan" in rest:  # issue 14: print sizes, memory and time (plan.py); nothing is trained
        from plan import plan_command

        return plan_command(name, rest)
    result = train(load_config(name, rest))
    return {"SIGINT": 130, "SIGTERM": 143}.get(result["stopped"], 0)


if __name__ == "__main__":
    sys.exit(main())
