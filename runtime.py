"""Where a run executes and what it reports: device, precision, seeds and DDP (setup); how
ranks share the data (GlobalBatchLoader); Ctrl-C handling (StopSignal); metrics.jsonl,
loss.png and wandb (RunLog).

    rt = setup(cfg)                     # or setup(device="auto", dtype="auto") from sample.py
    with rt.autocast():
        logits, loss = model(x, y)
    rt.scaler.scale(loss).backward()    # a no-op scaler unless dtype is float16

Choices (`--device auto`, `--dtype auto`):
  device  cuda > mps > cpu. Under torchrun each process takes cuda:LOCAL_RANK.
  dtype   bfloat16 autocast on GPUs that support it (Ampere and later), float16 autocast with a
          GradScaler on older GPUs; on CPU bfloat16 where the CPU has bf16 instructions
          (AVX512-BF16 or AMX), else float32 (emulated bf16 is slower than fp32); float32 on MPS
          (its autocast coverage varies by macOS version).
Parameters and optimizer state always stay float32; autocast only lowers the matmuls.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.loader import BatchLoader, to_device
from errors import UserError

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched by substring of
# torch.cuda.get_device_name(). MFU is reported against these even for float32 runs (the fair
# question is "how much of the machine did we use"). Unknown GPUs, CPU and MPS get no MFU:
# a CPU's peak depends on cores, clocks and vector units, and a guess would mislead.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12,
    "L40S": 362e12, "L40": 181e12, "A6000": 155e12, "A10": 125e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
}
# Memory of the same GPUs in GB as sold (the common variant; plan.py's --gpu a100-40gb picks another).
GPU_MEMORY_GB = {
    "H200": 141, "H100": 80, "GH200": 96, "A100": 80, "A800": 80, "L40S": 48, "L40": 48, "A6000": 48,
    "A10": 24, "L4": 24, "RTX 4090": 24, "RTX 3090": 24, "V100": 32, "T4": 16,
}


def peak_flops(device_name: str) -> float | None:
    """Peak FLOP/s for a CUDA device name, or None when unknown (longest match wins: L40S vs L4)."""
    hits = [k for k in PEAK_FLOPS if k in device_name]
    return PEAK_FLOPS[max(hits, key=len)] if hits else None


@dataclass
class Runtime:
    device: str  # "cuda:0", "mps", "cpu"
    device_type: str  # "cuda", "mps", "cpu" (what torch.autocast wants)
    dtype: torch.dtype  # autocast compute dtype; float32 means no autocast
    scaler: torch.amp.GradScaler
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    peak_flops: float | None = None  # per device

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def barrier(self) -> None:
        if self.ddp:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.ddp and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device_type == "cuda" else self.device
        where = f"{self.world_size} processes x {name}" if self.ddp else name
        return f"{where}, {str(self.dtype).removeprefix('torch.')}"


def _pick_device(device: str, local_rank: int) -> str:
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda but torch sees no CUDA GPU; use --device auto or --device cpu")
        return f"cuda:{local_rank}"
    if device == "mps" and not has_mps:
        raise UserError("--device mps but MPS is not available; use --device auto or --device cpu")
    if device not in ("cpu", "mps"):
        raise UserError(f"unknown device {device!r}; choose auto, cpu, cuda or mps")
    return device


def _pick_dtype(dtype: str, device_type: str, training: bool = True) -> torch.dtype:
    if dtype == "auto":
        if device_type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        # Decoding one token at a time is overhead-bound on CPU, and fp32 is faster there.
        if device_type == "cpu" and training and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise UserError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    if dtype == "bfloat16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("this GPU has no bfloat16 support; use --dtype float16 (or auto)")
    return table[dtype]


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bfloat16 matmul instructions (AVX512-BF16, AMX), where bf16 autocast
    makes small-model training ~17% faster per step; elsewhere bf16 is emulated and slower."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private: absent on some builds
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def setup(cfg: Any = None, *, device: str = "auto", dtype: str = "auto", seed: int | None = 1337,
          training: bool = True) -> Runtime:
    """Pick device and precision, seed the RNGs, join the process group under torchrun.

    `cfg` is anything with .device, .dtype and .seed (a TrainConfig); without one the keyword
    arguments are used. Each rank seeds with seed + rank so dropout masks differ between
    ranks; the weights still start identical because DDP broadcasts rank 0's at wrap time.
    training=False (sampling) keeps dtype auto at float32 on CPU: bf16 speeds up training
    steps there, but one-token decode steps are overhead-bound and run faster in float32.
    """
    if cfg is not None:
        device, dtype, seed = cfg.device, cfg.dtype, cfg.seed
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    device_type = dev.split(":")[0]
    if world_size > 1:
        if device_type == "mps":
            raise UserError("DDP does not support MPS; run a single process, or use --device cpu")
        import torch.distributed as dist

        if not dist.is_initialized():
            if device_type == "cuda":
                torch.cuda.set_device(dev)
                dist.init_process_group("nccl", device_id=torch.device(dev))
            else:
                dist.init_process_group("gloo")
    if device_type == "cuda":
        torch.cuda.set_device(dev)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: ~free speed on Ampere+
        torch.backends.cudnn.allow_tf32 = True
    amp_dtype = _pick_dtype(dtype, device_type, training)
    scaler = torch.amp.GradScaler(device_type, enabled=amp_dtype == torch.float16)
    if seed is not None:
        seed_everything(seed + rank)
    peak = peak_flops(torch.cuda.get_device_name(dev)) if device_type == "cuda" else None
    return Runtime(dev, device_type, amp_dtype, scaler, rank, local_rank, world_size, peak)


class GlobalBatchLoader:
    """Every rank draws the same global micro-batch (one shared seed) and keeps rows rank::world.

    Reading world_size x the rows costs next to nothing against the model, and buys: the data
    order does not depend on the number of processes (a 2-GPU run sees the batches a 1-GPU run
    with the same global batch sees), and rank 0's loader state is every rank's state, so a
    checkpoint saved by rank 0 resumes exactly on any process count.
    """

    def __init__(self, path: Path, cfg: Any, rt: Runtime) -> None:
        self.rt = rt
        self.loader = BatchLoader(path, cfg.block_size, cfg.batch_size * rt.world_size, device="cpu",
                                  seed=cfg.seed, rank=0, world_size=1, sampling=cfg.sampling)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.loader.next_batch()  # on the CPU: keep only this rank's rows before the copy
        rank, world = self.rt.rank, self.rt.world_size
        if world > 1:
            x, y = x[rank::world].contiguous(), y[rank::world].contiguous()
        return to_device(x, y, self.rt.device)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, evaluates, saves and exits.

    A second Ctrl-C quits at once (single process only: under torchrun every worker gets the
    signal from the terminal and again from torchrun, which must not count as a second press)."""

    def __init__(self, escalate: bool) -> None:
        self.name: str | None = None
        self.escalate = escalate
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.name and self.escalate:
            raise KeyboardInterrupt
        if not self.name:
            self.name = signal.Signals(signum).name
            print(f"\n{self.name}: finishing this step, then eval + save (Ctrl-C again to quit without saving)",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _wandb_has_key(wandb: Any) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:  # older wandb without prompt=, or a broken settings file: treat as no key
        return False


class RunLog:
    """The run's record: metrics.jsonl and loss.png always, wandb when asked.

    On resume, metric lines past the checkpoint's step are dropped (they describe steps the
    resumed run will redo), so the file and the plot stay one consistent history.
    """

    def __init__(self, out_dir: Path, resume_step: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rec = json.loads(line)
                    if rec.get("step", 0) <= resume_step:
                        self.records.append(rec)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.records)
        self.wandb: Any = None
        self.plotted_at, self.plot_cost = 0.0, 0.5
        self.samples: list[list[Any]] = []

    def start_wandb(self, project: str, name: str, config: dict[str, Any], run_id: str | None) -> str:
        """Start (or continue, given run_id) a wandb run in out_dir/wandb; returns its id."""
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install wandb (or drop --wandb)") from None
        mode = None  # wandb's own choice: WANDB_MODE, its settings, else online
        if "WANDB_MODE" not in os.environ and not _wandb_has_key(wandb):
            mode = "offline"  # no account needed; same effect as WANDB_MODE=offline
        self.wandb = wandb.init(project=project, name=name, config=config, dir=str(self.out_dir),
                                id=run_id, resume="allow", mode=mode)
        if self.wandb.settings.mode == "offline" or mode == "offline":
            print("wandb: logging offline; upload later with "
                  f"`wandb sync {self.out_dir / 'wandb'}/offline-run-*`")
        return self.wandb.id

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None},
                           step=record["step"])

    def log_sample(self, step: int, text: str) -> None:
        if self.wandb is not None:
            import wandb

            self.samples.append([step, text])  # the whole table each time: wandb tables are immutable
            self.wandb.log({"samples": wandb.Table(columns=["step", "text"], data=self.samples)}, step=step)

    def plot(self, force: bool = True) -> Path | None:
        """Train and val loss against step in loss.png; None (and a note) without matplotlib.

        force=False redraws at most every 30 s (a redraw costs ~0.3 s on a small CPU)."""
        if not force and time.time() - self.plotted_at < 30:
            return None
        self.plotted_at = time.time()
        try:
            return self._plot()
        finally:
            self.plot_cost = time.time() - self.plotted_at  # for max_time's reserve

    def _plot(self) -> Path | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("note: matplotlib is not installed, skipping loss.png (pip install matplotlib)")
            return None

        def series(key: str) -> tuple[list[int], list[float]]:
            pts = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
            return [p[0] for p in pts], [p[1] for p in pts]

        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(*series("loss"), color="tab:blue", alpha=0.35, lw=1, label="train (running)")
        ax.plot(*series("train_loss"), "o-", color="tab:blue", ms=3, label="train (eval)")
        ax.plot(*series("val_loss"), "o-", color="tab:orange", ms=3, label="val")
        ax.set(xlabel="step", ylabel="loss", title=self.out_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.out_dir / "loss.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
