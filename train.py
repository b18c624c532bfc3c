"""Train a GPT, from one CPU to many GPUs.

    python train.py --config small                # char-level Shakespeare: minutes on a 2-core CPU
    python train.py --config small --resume       # continue out/small exactly where it stopped
    python train.py --config small --max-time 60  # a time limit, the final eval and save included
    python train.py --config runs/mine.toml       # settings from a file (base = "small" in it)
    python train.py --config out/small/config.json --out-dir out/again   # a run's settings again
    python train.py --config finetune_gpt2 --init-from gpt2-medium      # GPT-2's weights, or a run
    python train.py --config small --eval-only    # out/small's best.pt: its loss, without training
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2
    python train.py --help                        # every setting, with small's values

A run writes out/<name>/: ckpt.pt (the latest), best.pt (the lowest val loss), config.json,
metrics.jsonl and loss.png. Ctrl-C, SIGTERM or SIGUSR1 stops it after the step in progress, saves
it and exits 128 + the signal's number (a second Ctrl-C quits at once); a loss that becomes nan or
inf stops it without saving, and exits 2, as a mistake in the settings does.
"""

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from filelock import FileLock, Timeout
from tqdm import tqdm

from configs import TrainConfig, UserError, load_config, parse_args, replacing, run, settings
from data.loader import Batches, eval_batches, windows
from data.prepare import dataset_dir, read_manifest
from data.tokenizer import tokenizer
from model.checkpoint import (
    checkpoint_file,
    keep_best,
    load_checkpoint,
    model_from,
    save_checkpoint,
)
from model.gpt import GPT, generate
from training.optim import lr_factor, make_optimizers
from training.runtime import check_fits, peak_flops, setup, summed

RUN_FILES = {"ckpt.pt", "best.pt", "config.json", "metrics.jsonl", "loss.png", "wandb"}


@dataclass
class TrainState:
    """Where a run is, besides its weights and optimizer: what a checkpoint restores to go on."""

    step: int = 0
    best_val: float = math.inf
    evaluated: int = -1  # the last step whose eval finished: --resume does not evaluate it again
    seconds: float = 0.0  # spent in the loop: a --max-time run's schedule and clock go on from it
    wandb_id: str = ""


@torch.no_grad()
def evaluate(
    model, data_dir, cfg: TrainConfig, rt, limit: int, stopped=lambda: False
) -> dict | None:
    """The mean loss per token on the first `limit` batches of val and of train. Each process takes
    its share of the batches. None when stopped() became true in any process: a stop signal ends an
    eval at once."""
    if rt.world_size > 1:  # each process steps its own copy of the weights: they must stay equal
        sums = torch.stack([p.detach().float().sum() for p in model.parameters()])
        first = sums.clone()
        dist.broadcast(first, 0)
        if not torch.equal(sums, first):
            print(f"warning: process {rt.rank}'s weights differ from process 0's", file=sys.stderr)
    model.eval()
    batch_size = cfg.eval_batch_size or cfg.batch_size
    losses = {}
    for split in "val", "train":
        total = torch.zeros(2, device=rt.device)  # the loss summed over the tokens, the tokens
        path = data_dir / f"{split}.bin"
        for x, y in eval_batches(
            path, cfg.block_size, batch_size, rt.device, limit, rt.rank, rt.world_size
        ):
            if stopped():
                break
            with rt.autocast():
                _, loss = model(x, y)
            total += torch.stack([loss * y.numel(), loss.new_tensor(y.numel())])
        if (total := summed(total, stopped(), rt)) is None:
            losses = None
            break
        losses[f"{split}_loss"] = (total[0] / total[1]).item()
    model.train()
    return losses


def train(cfg: TrainConfig) -> dict:
    """Run the training cfg describes; return its step, final losses, and the signal that stopped
    it (0: none)."""
    started = time.time()
    # device, dtype, compile, CPU threads, the seed and DDP: the first line names them
    rt = setup(cfg)
    master, ddp = rt.rank == 0, dist.is_initialized()
    parts = [rt.device]  # e.g. "cpu, 2 threads, bfloat16, compile off"
    if rt.device == "cpu":  # saved with the run, so that --resume sums in the same order
        cfg = replace(cfg, threads=torch.get_num_threads())
        parts.append(f"{cfg.threads} thread" + "s" * (cfg.threads > 1))
    if rt.device.startswith("cuda"):
        parts.append(torch.cuda.get_device_name())
    if ddp:
        parts.append(f"{rt.world_size} processes")
    parts += [str(rt.dtype)[6:], f"compile {'on' if rt.compile else 'off'}"]
    if cfg.compile and not rt.compile:
        parts[-1] += " (this machine cannot compile: docs/devices.md)"
    if master:
        print(", ".join(parts + ["deterministic"] * cfg.deterministic))
    with contextlib.ExitStack() as stack:
        if ddp:
            stack.callback(dist.destroy_process_group)

        # the run folder: locked while this run writes it; a new run takes no folder that another
        # run, or its user, filled
        run_dir = cfg.run_dir
        if master and not cfg.eval_only:
            names, mine = os.listdir(run_dir) if run_dir.is_dir() else [], RUN_FILES
            if "ckpt.pt" not in names:  # a run's files are those beside a run's config.json
                try:
                    load_config(str(run_dir / "config.json"))
                except UserError:
                    mine = set()
            others = sorted(n for n in names if n[0] != "." and n not in mine)
            if not cfg.resume and others:
                raise UserError(
                    f"{run_dir} holds files no run wrote ({', '.join(others[:3])}); "
                    "pick another --out-dir"
                )
            try:  # the lock dies with its process: a killed run leaves none behind
                run_dir.mkdir(parents=True, exist_ok=True)
                stack.enter_context(FileLock(run_dir / ".lock", timeout=0))
            except Timeout:
                raise UserError(
                    f"{run_dir} is in use by another run; wait for it, or pick another --out-dir"
                ) from None
            except OSError as e:
                fix = "make it writable to resume it" if cfg.resume else "pick another --out-dir"
                raise UserError(f"cannot write in {run_dir} ({e.strerror}); {fix}") from None
            if not cfg.resume and {"ckpt.pt", "best.pt"} & set(names):
                raise UserError(
                    f"{run_dir} holds a trained run; continue it with --resume, or start "
                    "another with --out-dir"
                )

        # data: the token files (each node's first process prepares a preset on first use, the
        # others wait for it) and their tokenizer
        if ddp and rt.local_rank > 0:
            dist.barrier()
        data_dir = dataset_dir(cfg.dataset, cfg.data_root, quiet=not master)
        if ddp and rt.local_rank == 0:
            dist.barrier()
        manifest = read_manifest(data_dir)
        val_windows = windows(data_dir / "val.bin", cfg.block_size)[:: cfg.block_size]

        # model: fresh, from --init-from's weights, or the checkpoint's on --resume, which took its
        # settings from the run's config.json
        checkpoint = load_checkpoint(run_dir / "ckpt.pt") if cfg.resume else None
        if checkpoint is not None:
            if checkpoint["manifest"] != manifest:
                raise UserError(
                    f"cannot resume {run_dir}: dataset {cfg.dataset} is not the data "
                    "it trained on (prepared again, or another); give the --dataset it had, or "
                    f"train a new run from its weights: --init-from {run_dir} --out-dir NEW"
                )
            model = model_from(checkpoint, cfg.dropout)
        elif cfg.init_from or cfg.eval_only:
            from model.hf import load_weights  # GPT-2's too, from Hugging Face

            weights = cfg.init_from or str(checkpoint_file(run_dir))
            model, trained_on = load_weights(weights, cfg.dropout)
            vocabulary = ("tokenizer", "vocab_size", "chars")
            if any(trained_on.get(k) != manifest.get(k) for k in vocabulary):
                raise UserError(
                    f"{weights} was trained with another tokenizer than dataset "
                    f"{cfg.dataset}'s: its token ids would mean other text"
                )
        else:
            config = cfg.model_config(manifest["vocab_size"])
            # before the model: its masks alone take block_size^2 bytes a layer
            check_fits(config, cfg.batch_size, rt)
            model = GPT(config)
        tok = tokenizer(manifest, model.config.vocab_size)
        if cfg.block_size > model.config.block_size:
            raise UserError(
                f"--block-size {cfg.block_size} is longer than the model's context "
                f"({model.config.block_size}); lower it"
            )
        model.crop(cfg.block_size)  # one block_size from here on, which the checkpoint holds
        cfg = replace(cfg, **asdict(model.config))  # the weights bring their shape
        run_settings = settings(cfg)  # config.json's, and the checkpoint's: cfg changes no more
        model.to(rt.device)
        eval_rows = cfg.eval_batch_size or cfg.batch_size  # the batches of all of val, if any
        whole_val = math.ceil(len(val_windows) / eval_rows)
        score_hellaswag, hellaswag_every = None, cfg.hellaswag_interval or cfg.eval_interval
        hellaswag_rows = 0  # what a --max-time run keeps time for
        if cfg.hellaswag:
            from training import hellaswag

            hellaswag_rows = 4 * len(hellaswag.load_items(cfg.hellaswag, tok))

            def score_hellaswag(stopped):  # the file is read afresh each time
                items = hellaswag.load_items(cfg.hellaswag, tok)
                return hellaswag.score(model, items, rt, eval_rows, tok.vocab_size, stopped)

        if cfg.eval_only:
            losses = evaluate(model, data_dir, cfg, rt, whole_val)  # Ctrl-C: 130
            if score_hellaswag:
                losses |= score_hellaswag(lambda: False)
            if master:
                print(f"{weights} on {cfg.dataset}, windows of {cfg.block_size}:")
                for k, v in losses.items():
                    perplexity = f"  perplexity {math.exp(v):.2f}" if k.endswith("loss") else ""
                    print(f"  {k} {v:.4f}{perplexity}" if isinstance(v, float) else f"  {k} {v}")
            return {"stop_signal": 0, **losses}

        # optimizer: AdamW (and Muon), and the loss scaler that float16 needs
        optimizers = make_optimizers(model, cfg, rt)
        scaler = torch.amp.GradScaler(rt.device.split(":")[0], enabled=rt.dtype == torch.float16)

        # resume: the optimizer's moments, the scaler and the step; metrics.jsonl forgets what came
        # after the checkpoint
        state = TrainState()
        if checkpoint is not None:
            try:
                for optimizer, saved in zip(optimizers, checkpoint["optimizer"], strict=True):
                    optimizer.load_state_dict(saved)
            except (ValueError, KeyError) as e:
                raise UserError(
                    f"cannot resume {run_dir}: its optimizer state does not fit this "
                    f"run ({e}); resume with the --optimizer it had, or use "
                    f"--init-from {run_dir}"
                ) from None
            if checkpoint["scaler"]:  # empty unless the run trained in float16
                scaler.load_state_dict(checkpoint["scaler"])
            state = TrainState(**checkpoint["state"])
            changed = [  # a flag typed, or config.json edited; out_dir is where the run is now
                f"{k} {v} -> {run_settings.get(k)}"
                for k, v in checkpoint["config"].items()
                if v != run_settings.get(k) and k != "out_dir"
            ]
            if master and changed:
                print(f"settings changed since the checkpoint: {', '.join(changed)}")
            if master and (metrics := run_dir / "metrics.jsonl").is_file():
                # An eval at the checkpoint's own step is run again unless the checkpoint holds it.
                kept = []
                for line in metrics.read_text(errors="replace").splitlines():
                    try:  # a line cut short by a kill, or damaged, is dropped
                        r = json.loads(line)
                        again = "val_loss" in r and state.evaluated != state.step
                        if r["step"] < state.step or r["step"] == state.step and not again:
                            kept.append(line)
                    except (ValueError, TypeError, KeyError):
                        pass
                with replacing(metrics) as tmp:
                    tmp.write_text("".join(line + "\n" for line in kept))
            del checkpoint

        # the training step's model: compiled, and under DDP wrapped (checkpoints hold the model),
        # in a list that the run's end empties: a DDP module still alive then would keep its
        # process group, and gloo's threads, into interpreter exit, which they can hang or abort
        step_model = [torch.compile(model) if rt.compile else model]
        if ddp:
            # No buffer is broadcast before each forward: the masks and rotary angles follow from
            # the config, the same in every process.
            ids = [rt.local_rank] if rt.device.startswith("cuda") else None
            step_model[0] = torch.nn.parallel.DistributedDataParallel(
                step_model[0], device_ids=ids, broadcast_buffers=False
            )
            stack.callback(step_model.clear)

        micro_step = cfg.batch_size * cfg.block_size * rt.world_size  # tokens
        # Model FLOPs utilization: a token's FLOPs as nanoGPT counts them (6 a parameter, and
        # attention's), over the GPUs' peak; none on a CPU.
        token_flops = 6 * model.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        gpu_flops = peak_flops(rt.device) * rt.world_size
        if cfg.tokens_per_step % micro_step:
            raise UserError(
                f"--tokens-per-step {cfg.tokens_per_step} is not a multiple of "
                f"batch_size x block_size x processes ({micro_step})"
            )
        grad_accum = max(1, cfg.tokens_per_step // micro_step)
        tokens_a_step = grad_accum * micro_step
        batches = Batches(
            data_dir / "train.bin",
            cfg.block_size,
            cfg.batch_size,
            grad_accum,
            rt.rank,
            rt.world_size,
            cfg.seed,
            rt.device,
        )

        # the record: metrics.jsonl, wandb if asked, and the settings that repeat the run
        def write_settings() -> None:
            with replacing(run_dir / "config.json") as tmp:
                tmp.write_text(json.dumps(run_settings, indent=1))

        wandb_run = None
        if master:
            if cfg.wandb:
                from training.tracking import start_wandb

                wandb_run = start_wandb(cfg, run_settings, state.wandb_id)
                state.wandb_id = wandb_run.id
            metrics = stack.enter_context(
                open(run_dir / "metrics.jsonl", "a" if cfg.resume else "w")
            )
            if not cfg.resume:  # a resume's settings become the run's at its first save
                write_settings()
            resuming = f"; resuming at step {state.step}" if cfg.resume else ""
            print(
                f"{model.num_params() / 1e6:.2f}M parameters; {tokens_a_step:,} tokens a "
                f"step = {grad_accum} x {rt.world_size} processes x {cfg.batch_size} rows x "
                f"{cfg.block_size}; {cfg.dataset}: {manifest['train_tokens']:,} train tokens"
                + resuming
            )

        def log(record: dict) -> None:
            print(json.dumps(record), file=metrics, flush=True)
            if wandb_run is not None:
                wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

        def diverged(what: str) -> UserError:
            kept = f"{run_dir / 'ckpt.pt'} (step {saved})" if saved else "no checkpoint of this run"
            return UserError(
                f"{what} at step {state.step}; stopped, keeping {kept}; "
                "try a lower --lr, or --dtype float32"
            )

        def save() -> int:
            """ckpt.pt, and the config.json it continues with for --resume; returns the step."""
            if not all(p.isfinite().all() for p in model.parameters()):
                raise diverged("the weights became nan or inf")
            state.seconds = seconds_before + time.time() - loop_started
            save_checkpoint(
                {
                    "model": model.state_dict(),
                    "model_config": asdict(model.config),
                    "config": run_settings,
                    "optimizer": [o.state_dict() for o in optimizers],
                    "scaler": scaler.state_dict(),
                    "state": asdict(state),
                    "manifest": manifest,
                },
                run_dir / "ckpt.pt",
            )
            write_settings()
            return state.step

        # stop signals: each is a request that the loop reads at the top of its next step (an eval
        # in progress ends at once); a second Ctrl-C quits at once
        requests = []

        def request_stop(signum, frame):
            requests.append(signum)
            if signal.getsignal(signal.SIGINT) is request_stop:  # not if the job ignores it
                signal.signal(signal.SIGINT, signal.default_int_handler)

        for sig in signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGUSR1", signal.SIGTERM):
            # A job that a script started with `cmd &` ignores Ctrl-C, and keeps to it.
            if signal.getsignal(sig) is not signal.SIG_IGN:
                stack.callback(signal.signal, sig, signal.signal(sig, request_stop))

        # the loop: a step's rows and dropout are drawn from (seed, step), so that a resumed run
        # repeats them exactly; a resumed --max-time run goes on with the time its checkpoint had
        bar = stack.enter_context(tqdm(total=cfg.max_iters, initial=state.step, disable=not master))
        seconds_before = state.seconds if cfg.max_time else 0.0
        deadline = started + cfg.max_time - seconds_before if cfg.max_time else math.inf
        saved = first_step = state.step  # a resumed run's step is the checkpoint's, saved
        losses = {}
        loss_sum, logged_step, evaluating = torch.zeros((), device=rt.device), state.step, 0.0
        loop_started = logged_time = time.time()
        while True:
            # One decision: the last step comes from max_iters, a stop signal, or the clock, when
            # the next step would leave too little time for the end: the final eval, sized to a
            # twentieth of a --max-time budget (an eval reads about twice the rows a second that a
            # step trains), and a second for the save, the plot and the sample. Under torchrun the
            # processes agree on it, and on the eval's size, in one collective.
            steps_run = max(1, state.step - first_step)
            step_seconds = (time.time() - loop_started - evaluating) / steps_run
            eval_batches, eval_seconds = cfg.eval_iters or whole_val, 0.0
            if cfg.max_time and state.step > first_step:
                row_seconds = step_seconds * cfg.block_size / (2 * tokens_a_step)
                fits = int(cfg.max_time / 20 / 2 / eval_rows / row_seconds)  # of val and of train
                eval_batches = max(1, min(eval_batches, fits))
                eval_seconds = (2 * eval_batches * eval_rows + hellaswag_rows) * row_seconds
            late = time.time() + step_seconds + eval_seconds + 1.0 > deadline
            decision = [len(requests), late, eval_batches]
            if ddp:
                agreed = torch.tensor(decision, device=rt.device)
                dist.all_reduce(agreed)
                decision = agreed.tolist()
            signalled, late = decision[0] > 0, decision[1] > 0
            eval_batches = decision[2] // rt.world_size
            if late and not signalled and state.step == first_step < cfg.max_iters:
                left = deadline - time.time()
                raise UserError(
                    f"--max-time {cfg.max_time:g} leaves no time for a step: {left:.1f} s of it "
                    "are left after start-up; give more"
                )
            last_step = state.step >= cfg.max_iters or signalled or late

            # evaluate every eval_interval steps and at the end (not after a signal), having saved
            # the steps before it: an eval that fails or is killed loses none
            due = state.step % cfg.eval_interval == 0 or last_step
            if due and state.step > 0 and not signalled and state.evaluated != state.step:
                t0 = time.time()
                if master and state.step > saved:
                    saved = save()
                losses = evaluate(model, data_dir, cfg, rt, eval_batches, lambda: bool(requests))
                if losses and score_hellaswag and (state.step % hellaswag_every == 0 or last_step):
                    scores = score_hellaswag(lambda: bool(requests))
                    losses = losses | scores if scores else None
                if losses is None:  # a signal, here or in another process, ended the eval
                    signalled = last_step = True
                    losses = {}
                elif not math.isfinite(losses["val_loss"]):
                    raise diverged(f"the val loss became {losses['val_loss']}")
                else:
                    improved, state.evaluated = losses["val_loss"] < state.best_val, state.step
                    state.best_val = min(state.best_val, losses["val_loss"])
                    if master:
                        if last_step:  # the final checkpoint holds its eval
                            saved = save()
                        if improved:
                            keep_best(run_dir)
                        log({"step": state.step, **losses, "time": round(time.time() - started, 2)})
                        from training.plot import plot_losses

                        plot_losses(run_dir)
                        scores = ", ".join(
                            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in losses.items()
                        )
                        tqdm.write(f"step {state.step}: {scores}" + " (best)" * improved)
                evaluating += time.time() - t0
                logged_time += time.time() - t0  # the steps' speed, as logged, leaves evals out
            if last_step:
                if master and state.step > saved:
                    saved = save()
                break

            # the learning rate: each optimizer's peak (its defaults' lr) x one factor, by the steps
            # or under --max-time by the clock, ending where the end's share of the budget starts
            progress = (state.step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
            if cfg.max_time:
                spent = seconds_before + time.time() - loop_started
                end = seconds_before + deadline - eval_seconds - 1.0 - loop_started
                progress = max(progress, spent / max(1e-3, end))
            lr = lr_factor(state.step, cfg, progress)
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = optimizer.defaults["lr"] * lr

            # forward and backward over the step's micro-batches; under DDP, only the last one
            # all-reduces the gradients
            torch.manual_seed(hash((cfg.seed, state.step, rt.rank)))  # dropout's (ints hash alike)
            for i, (x, y) in enumerate(batches(state.step)):
                last_micro_step = not ddp or i == grad_accum - 1
                with contextlib.nullcontext() if last_micro_step else step_model[0].no_sync():
                    with rt.autocast():
                        _, loss = step_model[0](x, y)
                    scaler.scale(loss / grad_accum).backward()
                loss_sum += loss.detach().float() / grad_accum

            # clip the gradients (unscaled first), step, zero
            if cfg.grad_clip:
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            for optimizer in optimizers:
                scaler.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            scaler.update()
            state.step += 1
            bar.update()

            # log every log_interval steps: the loss's host sync
            if state.step % cfg.log_interval == 0 or state.step == cfg.max_iters:
                now, steps = time.time(), state.step - logged_step
                if ddp:
                    dist.all_reduce(loss_sum)
                loss_value = loss_sum.item() / steps / rt.world_size
                if not math.isfinite(loss_value):
                    raise diverged(f"the loss became {loss_value}")
                tokens_per_s = steps * tokens_a_step / (now - logged_time)
                if master:
                    speed = {"tokens_per_s": round(tokens_per_s), "time": round(now - started, 2)}
                    if gpu_flops:
                        speed["mfu"] = round(tokens_per_s * token_flops / gpu_flops, 4)
                    log({"step": state.step, "loss": loss_value, "lr": lr * cfg.lr, **speed})
                    shown = f"loss {loss_value:.4f} lr {lr * cfg.lr:.2e} {tokens_per_s:,.0f} tok/s"
                    shown += f" mfu {speed['mfu']:.1%}" if gpu_flops else ""
                    bar.set_postfix_str(shown, refresh=False)
                loss_sum.zero_()
                logged_step, logged_time = state.step, now
        bar.close()
        stop_signal = (requests or [signal.SIGTERM])[0] if signalled else 0  # another's: SIGTERM

        # the end: where the outputs are, and a sample
        if wandb_run is not None:
            wandb_run.finish(exit_code=128 + stop_signal if stop_signal else 0)
        final = losses if state.evaluated == state.step else {}  # a stop signal skips the eval
        if master:
            why = "max_iters" if state.step >= cfg.max_iters else "max_time"
            why = signal.Signals(stop_signal).name if stop_signal else why
            scores = "".join(f", {k} {v:.4f}" for k, v in final.items() if k.endswith("loss"))
            print(
                f"stopped at step {state.step} by {why} after {time.time() - started:.1f}s{scores}"
            )
            if saved:
                print(f"checkpoint {run_dir / 'ckpt.pt'} (the latest, for --resume)")
            if (run_dir / "best.pt").is_file():
                print(f"best       {run_dir / 'best.pt'} (the lowest val loss: sample.py's)")
            plot = f" and {run_dir / 'loss.png'}" * (run_dir / "loss.png").is_file()
            print(f"metrics    {run_dir / 'metrics.jsonl'}{plot}")
            if cfg.sample_tokens and not stop_signal:
                model.eval()
                start = torch.tensor([[tok.start_id]], device=rt.device)
                generator = torch.Generator(rt.device).manual_seed(cfg.seed)
                ids = []
                with rt.autocast():  # temperature 0.8, top-k 200
                    for t in generate(
                        model, start, cfg.sample_tokens, 0.8, 200, None, generator, tok.vocab_size
                    ):
                        if requests or time.time() > deadline:  # a signal or the time limit
                            break
                        ids.append(int(t))
                print(
                    f"a sample (python sample.py --out-dir {run_dir} for more):\n{tok.decode(ids)}"
                )
        return {
            "step": state.step,
            "stop_signal": requests[0] if requests else stop_signal,
            **final,
        }


def main(argv=None) -> int:
    stop_signal = train(parse_args(argv, doc=__doc__))["stop_signal"]
    return 128 + stop_signal if stop_signal else 0


if __name__ == "__main__":
    run(main)
