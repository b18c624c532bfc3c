"""Where a run executes: device, precision, seeds and DDP (setup); how ranks share the data
(GlobalBatchLoader); how it is asked to stop (StopSignal).

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
import datetime
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Iterator
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

    @contextlib.contextmanager
    def peer_failures(self) -> Iterator[None]:
        """Under DDP, a collective that timed out (a hung or stopped process: --ddp-timeout) or lost
        its peer (a dead one) becomes one line instead of a traceback per process."""
        try:
            yield
        except RuntimeError as e:
            # NCCL raises DistError; gloo a plain RuntimeError whose message names its source file
            if not self.ddp or not (isinstance(e, torch.distributed.DistError) or "gloo" in str(e)):
                raise
            reason = re.sub(r"^\[[^\]]*\] ", "", str(e).strip().splitlines()[0])[:200]
            raise UserError(f"process {self.rank} of {self.world_size}: {reason}; another process hung, stopped or "
                            "died (see its output), or took longer than --ddp-timeout; restart it, with --resume "
                            "if it saved a checkpoint") from None

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
          training: bool = True, ddp_timeout: float = 600.0) -> Runtime:
    """Pick device and precision, seed the RNGs, join the process group under torchrun.

    `cfg` is anything with .device, .dtype, .seed and .ddp_timeout (a TrainConfig); without one
    the keyword arguments are used. Each rank seeds with seed + rank so dropout masks differ
    between ranks; the weights still start identical because DDP broadcasts rank 0's at wrap time.
    training=False (sampling) keeps dtype auto at float32 on CPU: bf16 speeds up training
    steps there, but one-token decode steps are overhead-bound and run faster in float32.
    """
    if cfg is not None:
        device, dtype, seed, ddp_timeout = cfg.device, cfg.dtype, cfg.seed, cfg.ddp_timeout
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
            # A collective that waits longer than this fails (NCCL's watchdog ends the process), so a
            # hung or SIGSTOPped rank ends the job instead of stalling the others forever.
            timeout = datetime.timedelta(seconds=ddp_timeout)
            if device_type == "cuda":
                torch.cuda.set_device(dev)
                dist.init_process_group("nccl", device_id=torch.device(dev), timeout=timeout)
            else:
                dist.init_process_group("gloo", timeout=timeout)
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
