"""Train a GPT, from one CPU to many GPUs.

    python train.py --config small                  # char-level Shakespeare: minutes on a 2-core CPU
    python train.py --config small --resume         # continue out/small exactly where it stopped
    python train.py --config small --max-time 60    # wall-clock budget (s), final eval and save included
    python train.py --config runs/mine.toml         # TOML of field values, optionally base = "small"
    python train.py --config out/small --out-dir out/again   # a finished run's settings
    python train.py --config finetune_gpt2 --init-from gpt2-medium   # a hub id, a HF GPT-2 dir or a run dir
    python train.py --config finetune_gpt2 --eval-only   # loss and perplexity, no training
    python train.py --config gpt2 --batch-size auto # the largest micro-batch that fits, same tokens/step
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2
    python train.py --config small --help           # every option, with small's values as defaults

A run writes out/<config>/: ckpt.pt (the latest), best.pt (the lowest val loss), config.json,
manifest.json, metrics.jsonl and loss.png. Ctrl-C, SIGTERM, SIGHUP, a scheduler's warning (SIGUSR1/2) or a
reader of the output leaving (`| head`) saves and exits 128 + the signal's number (Ctrl-C twice: at once,
unsaved); a nan/inf loss stops without saving and exits 2, as bad options do.
"""

from configs.errors import start_script

start_script(__name__)  # first: Ctrl-C during the imports below (torch: seconds) is one line

import contextlib
import math
import shlex
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from configs import TrainConfig, parse_config
from configs.cli import ArgumentParser
from configs.errors import UserError, entry_point
from data.loader import GlobalBatchLoader
from model.checkpoint import BEST_NAME, CKPT_NAME, keep_best
from training.budget import StopSignal, TimeBudget, exit_code
from training.optim import lr_multiplier, set_lr
from training.plan import out_of_memory
from training.run import (Run, TrainingDiverged, build_model, build_optimizer, eval_only, evaluate, final_estimate,
                          hellaswag_scores, lock_run_dir, open_data, resumed_checkpoint, sample_text, save)
from training.runtime import Runtime, setup


def forward_backward(train_model: torch.nn.Module, loader: GlobalBatchLoader, rt: Runtime) -> torch.Tensor:
    """Accumulate gradients over this rank's micro-batches of the next step and return their mean loss.
    Under DDP only the last micro-step all-reduces the gradients (no_sync on the others)."""
    loss_sum = torch.zeros((), device=rt.device)
    batches = loader.next_step()
    grad_accum = len(batches)
    for micro, (x, y) in enumerate(batches):
        with train_model.no_sync() if rt.ddp and micro < grad_accum - 1 else contextlib.nullcontext():
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


def checkpoint(run: Run, stop: StopSignal, budget: TimeBudget | None = None, save_first: bool = False) -> None:
    """The one checkpoint step, run every eval_interval and at the end: evaluate, save ckpt.pt, and keep it as
    best.pt when val improved. After a stop signal the save comes first, so that a short grace period still keeps
    the work. A stop signal can cut the eval short (it is then neither recorded nor started again), never a save.
    Only rank 0 evaluates and saves; a non-finite val loss stops every rank before anything is saved."""
    t0, rt = time.time(), run.rt
    if save_first and rt.is_master:
        with stop.holding():
            save(run)
    if run.last_eval.get("step") == run.step:
        return
    run.last_eval = {"step": run.step}  # The losses join it below, unless a stop signal cuts the eval short.
    losses = stop.cut_short(lambda: evaluate(run.model, run.data.dir, run.cfg, rt) | hellaswag_scores(run)) \
        if rt.is_master else {}  # None if a stop signal cut the eval short, and {} on the other ranks.
    val = torch.tensor((losses or {}).get("val_loss", 0.0), device=rt.device)
    if rt.ddp:
        torch.distributed.broadcast(val, src=0)  # also the barrier: the others wait for rank 0
    if not math.isfinite(val.item()):
        raise TrainingDiverged(run, f"val loss became {val.item()} at step {run.step}")
    if losses is None:
        return
    if rt.is_master:
        with stop.holding():
            record(run, losses)
    if budget is not None:  # The final checkpoint also draws loss.png, so its cost is timed with it.
        budget.record_final(time.time() - t0 + (run.log.plot_cost if run.log else 0.0))


def record(run: Run, losses: dict[str, float]) -> None:
    """Rank 0 after an eval: save (kept as best.pt if val improved), then log, plot and print the losses."""
    improved = losses["val_loss"] < run.best_val
    run.best_val, run.last_eval = min(run.best_val, losses["val_loss"]), {"step": run.step, **losses}
    if run.step > 0 and run.saved_at != run.step:
        save(run)
    if improved and run.saved_at == run.step:
        keep_best(run.run_dir)
    run.log.log({"step": run.step, **losses, "time": round(time.time() - run.log.started, 3)})
    if run.cfg.sample_tokens and run.log.wandb is not None:
        run.log.log_sample(run.step, sample_text(run))
    run.log.plot(force=False)
    hellaswag = f", hellaswag acc_norm {losses['hellaswag_acc_norm']:.4f}" if "hellaswag_acc" in losses else ""
    tqdm.write(f"step {run.step}: train {losses['train_loss']:.4f}, val {losses['val_loss']:.4f}{hellaswag}"
               f"{' (best)' if improved else ''}{', saved' if run.saved_at == run.step else ''}")


def schedule_progress(step: int, cfg: TrainConfig, budget: TimeBudget | None) -> float:
    """The share of the lr schedule done, by steps or, under --max-time, by the clock if that is further along."""
    progress = (step - cfg.warmup_iters) / max(1, (cfg.lr_decay_iters or cfg.max_iters) - cfg.warmup_iters)
    return max(progress, budget.progress()) if budget is not None else progress


def agree(rt: Runtime, loss: torch.Tensor, *flags: bool) -> tuple[float, ...]:
    """One small all-reduce per step, for the global mean loss and for each flag that any rank raised."""
    values = torch.stack([loss.float(), *(torch.tensor(float(f), device=rt.device) for f in flags)])
    if rt.ddp:
        torch.distributed.all_reduce(values)
        values[0] /= rt.world_size
    loss_val, *raised = values.tolist()
    return loss_val, *(r > 0 for r in raised)


def log_progress(run: Run, window: list[tuple[float, float]], lr: float, grad_norm: torch.Tensor | None,
                 bar: Any) -> None:
    """Log one metrics line, and show it on the progress bar, for the (loss, seconds) of each step in window."""
    tok_s = run.tokens_per_step * len(window) / sum(dt for _, dt in window)
    peak = run.rt.peak_flops * run.rt.world_size if run.rt.peak_flops else None
    mfu = run.model.flops_per_token(run.cfg.block_size) * tok_s / peak if peak else None
    loss = sum(v for v, _ in window) / len(window)
    run.log.log({"step": run.step, "loss": loss, "lr": lr, "tokens_per_s": round(tok_s, 1), "mfu": mfu,
                 "grad_norm": grad_norm.item() if grad_norm is not None else None, "threads": torch.get_num_threads(),
                 "time": round(time.time() - run.log.started, 3)})
    bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} {tok_s:,.0f} tok/s"
                        + (f" mfu {100 * mfu:.1f}%" if mfu is not None else ""), refresh=False)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the training job that cfg describes; return its final losses, its paths and why it stopped."""
    t_start = time.time()
    with setup(cfg) as rt:  # device, dtype, seeds, DDP; the process group ends with the block
        if rt.is_master:
            print(rt.describe())  # The device, precision, kernels and compile mode, in one line.
        if cfg.eval_only:
            return eval_only(cfg, rt)
        # Only rank 0 writes the run directory, and its lock keeps a second run out.
        with torch_errors(cfg, rt), lock_run_dir(cfg.run_dir, fresh=not cfg.resume) if rt.is_master \
                else contextlib.nullcontext(), StopSignal(escalate=not rt.ddp) as stop, rt.peer_failures(), \
                open_data(cfg, rt) as data:
            with rt.together():  # A mistake that every process finds (a bad --tokens-per-step) is printed once.
                ckpt = resumed_checkpoint(cfg, rt, data)
                model, cfg = build_model(cfg, rt, data.manifest, ckpt)
                optimizer = build_optimizer(model, cfg, rt, ckpt)
                run = Run(cfg, rt, model, optimizer, data, ckpt, t_start)  # On --resume, where ckpt stopped.
            with run:
                try:
                    loop(run, stop)
                except KeyboardInterrupt:  # A second Ctrl-C.
                    run.stopped = "quit"
                stop.hold = True  # From here a second Ctrl-C only marks a quit, so the plot and summary still run.
            if stop.quit:
                run.stopped = "quit"
            return finish(run, stop)


@contextlib.contextmanager
def torch_errors(cfg: TrainConfig, rt: Runtime) -> Iterator[None]:
    """Turn running out of memory, and an op with no deterministic kernel under --deterministic, into one line."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError.
        # A missing deterministic kernel is a plain RuntimeError that only its text tells apart (the op is not named).
        if rt.deterministic and "does not have a deterministic implementation" in str(e):
            raise UserError(f"--deterministic: an op this run needs has no deterministic kernel on {rt.device}; drop "
                            "--deterministic (runs then repeat only approximately)") from None
        if (oom := out_of_memory(e, rt.device, cfg.run_dir / CKPT_NAME)) is None:
            raise
        raise oom from None


def loop(run: Run, stop: StopSignal) -> None:
    """Train until max_iters, the time limit or a stop signal (run.stopped says which), then checkpoint."""
    cfg, rt = run.cfg, run.rt
    budget = TimeBudget(cfg.max_time, run.started, final_estimate(run)) if cfg.max_time else None
    run.stopped, window = "max_iters", []
    with tqdm(total=cfg.max_iters, initial=run.step, disable=not rt.is_master, dynamic_ncols=True, unit="step") as bar:
        if run.step == 0 and budget is None:
            checkpoint(run, stop)  # The untrained model's loss, about ln(vocab_size), anchors the curve.
        if budget is not None:
            budget.begin()
        while run.step < cfg.max_iters:
            t0 = time.perf_counter()
            if rt.threads:
                rt.threads.update()  # As many CPU threads as other processes leave cores idle.
            multiplier = lr_multiplier(run.step, schedule_progress(run.step, cfg, budget), cfg)
            set_lr(run.optimizer, multiplier)
            loss = forward_backward(run.train_model, run.loader, rt)
            late = budget is not None and budget.out_of_time()
            loss, signalled, late = agree(rt, loss, stop.name is not None, late)
            if not math.isfinite(loss):
                run.optimizer.zero_grad(set_to_none=True)
                raise TrainingDiverged(run, f"loss became {loss} at step {run.step + 1}")
            grad_norm = optimizer_step(run.model, run.optimizer, rt, cfg.grad_clip)
            run.step += 1
            window.append((loss, time.perf_counter() - t0))
            if budget is not None:
                budget.record(window[-1][1])
            bar.update(1)
            if rt.is_master and (run.step % cfg.log_interval == 0 or signalled or late or run.step == cfg.max_iters):
                log_progress(run, window, cfg.lr * multiplier, grad_norm, bar)
                window = []
            if signalled or late:
                run.stopped = (stop.name or "SIGTERM") if signalled else "max_time"
                break
            if run.step % cfg.eval_interval == 0 and run.step < cfg.max_iters:
                checkpoint(run, stop, budget)
                if agree(rt, torch.zeros((), device=rt.device), stop.name is not None)[1]:  # A signal during it.
                    run.stopped = stop.name or "SIGTERM"
                    break
    if run.last_eval.get("step") != run.step or run.saved_at != run.step:
        checkpoint(run, stop, budget, save_first=run.stopped.startswith("SIG"))


def finish(run: Run, stop: StopSignal) -> dict[str, Any]:
    """Print where the outputs are, and a sample; return the run's result."""
    run_dir, stopped, losses = run.run_dir, run.stopped, run.losses
    result = {"step": run.step, "stopped": stopped, "best_val": run.best_val, "elapsed": time.time() - run.started,
              "out_dir": str(run_dir), "checkpoint": str(run_dir / CKPT_NAME), "best": str(run_dir / BEST_NAME),
              "metrics": str(run_dir / "metrics.jsonl"), "plot": str(run_dir / "loss.png"), **losses,
              "device": run.rt.device, "dtype": str(run.rt.dtype).removeprefix("torch.")}
    if not run.rt.is_master:
        return result
    kept = f"kept {run_dir / CKPT_NAME} (step {run.saved_at})" if run.saved_at else "kept no checkpoint of this run"
    if stopped == "quit":
        print(f"quit at step {run.step}{'' if run.saved_at == run.step else ' without saving'}; {kept}",
              file=sys.stderr)
        return result
    print(f"stopped at step {run.step} ({stopped}{'' if losses else ', during its eval'}) after "
          f"{result['elapsed']:.1f}s")
    if losses:
        print(f"final: train loss {losses['train_loss']:.4f}, val loss {losses['val_loss']:.4f} "
              f"(best val {run.best_val:.4f})")
    best = f"best       {result['best']} (lowest val loss, what sample.py reads)\n" \
        if (run_dir / BEST_NAME).is_file() else ""  # None if stopped before its first eval finished.
    plot = f"\nloss curve {result['plot']}" if (run_dir / "loss.png").is_file() else ""  # If matplotlib drew it.
    print(f"checkpoint {result['checkpoint']} (latest, for --resume)\n{best}metrics    {result['metrics']}{plot}")
    if run.cfg.sample_tokens and not stop.name:  # A stop signal asks for an end now, not a sample first.
        sample = stop.cut_short(lambda: sample_text(run))
        if sample is None:
            result["stopped"] = stop.name
            print(f"{stop.name}: the sample was cut short; {kept}", file=sys.stderr)
        else:
            result["sample"] = sample
            where = shlex.quote(f"./{run_dir}" if str(run_dir).startswith("-") else str(run_dir))  # Not a flag.
            print(f"sample (python sample.py --out-dir {where} for more):\n{sample}")
    return result


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="train.py", description=__doc__,
                            usage="python train.py [--config NAME|FILE|RUN_DIR] [--FIELD VALUE ...]")
    cfg, _ = parse_config(parser, argv)
    return exit_code(train(cfg)["stopped"])


if __name__ == "__main__":
    sys.exit(main())
