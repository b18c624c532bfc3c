"""Where a run runs: device, autocast dtype, compile, CPU threads, seed, DDP group, free memory."""

import datetime
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch

from configs import UserError, device_and_dtype
from model.gpt import LOSS_CHUNK


@dataclass(frozen=True)
class Runtime:
    """What setup() decided: the device, autocast's dtype (float32: none), this process's place."""

    device: str
    dtype: torch.dtype
    compile: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    def autocast(self):
        return torch.autocast(
            self.device.split(":")[0], self.dtype, enabled=self.dtype != torch.float32
        )


def idle_cores() -> int:
    """Of the cores this process may use, those that others leave idle over 0.2 s (torch's count
    off Linux)."""
    try:
        cpus = os.sched_getaffinity(0)

        # the clock ticks these cores have spent working since the machine started
        def busy():
            with open("/proc/stat") as f:
                rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
            return sum(
                int(n) for row in rows if int(row[0][3:]) in cpus for n in row[1:4] + row[6:9]
            )

        before = busy()
        time.sleep(0.2)
        others = (busy() - before) / os.sysconf("SC_CLK_TCK") / 0.2
    except (OSError, AttributeError):  # not Linux
        return torch.get_num_threads()
    return max(1, min(torch.get_num_threads(), round(len(cpus) - others)))


def setup(cfg) -> Runtime:
    """Decide the device, dtype and compile from what torch reports; set the CPU threads and the
    seed; and, when torchrun started this process, join its group (NCCL on GPUs, gloo on CPUs)."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise UserError(f"WORLD_SIZE={world_size} is set without torchrun; start with torchrun")
    device, dtype = device_and_dtype(cfg.device, cfg.dtype)
    gpu = device == "cuda"
    # torch.compile makes a CPU's kernels with a C++ compiler, which many Windows and macOS machines
    # lack, and a GPU's with Triton (Volta on): without them it runs uncompiled.
    cxx = "cl" if os.name == "nt" else "clang++" if sys.platform == "darwin" else "g++"
    compiles = device == "cpu" and shutil.which(os.environ.get("CXX", cxx)) is not None
    if gpu:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: nearly free speed from Ampere on
        compiles = (
            torch.cuda.get_device_capability() >= (7, 0)
            and importlib.util.find_spec("triton") is not None
        )
    if device == "cpu":
        # A thread per core that others leave idle: OpenMP's threads spin while they wait for each
        # other, so one on a busy core slows every step. OMP_NUM_THREADS or --threads overrides it.
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if cfg.threads or "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cfg.threads or max(1, idle_cores() // processes))
    if cfg.deterministic:  # cuBLAS needs a fixed workspace before its first matmul to repeat itself
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if world_size > 1 or "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's, even alone
        # Imported before the group exists: its functions' defaults, bound to the group later, would
        # keep it alive into the interpreter's exit, where gloo's threads can abort a finished job.
        import torch.distributed.nn as _  # noqa: F401

        torch.distributed.init_process_group(
            "nccl" if gpu else "gloo",
            timeout=datetime.timedelta(seconds=cfg.ddp_timeout),
            device_id=torch.device(device) if gpu else None,
        )
    torch.manual_seed(cfg.seed + rank)
    return Runtime(device, dtype, cfg.compile and compiles, rank, local_rank, world_size)


def summed(totals: torch.Tensor, stopped: bool, rt) -> torch.Tensor | None:
    """An eval's totals summed over the processes, or None where a stop signal reached any of them:
    every process reduces, stopped or not, so that none is left waiting."""
    totals = torch.cat([totals, totals.new_tensor([float(stopped)])])
    if rt.world_size > 1:
        torch.distributed.all_reduce(totals)
    return None if totals[-1] > 0 else totals[:-1]


# Dense bfloat16 tensor-core FLOP/s (float16 before Ampere) of common GPUs, by a part of their
# name, longer names first: model FLOPs utilization's denominator.
PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "4090": 165e12,
    "3090": 71e12,
    "T4": 65e12,
    "V100": 125e12,
}


def peak_flops(device: str) -> float:
    """The GPU's peak from PEAK_FLOPS; 0 for a CPU, or a GPU not in it."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else ""
    return next((flops for part, flops in PEAK_FLOPS.items() if part in name), 0.0)


def step_memory(config, batch_size: int, dtype: torch.dtype) -> int:
    """About the most bytes a training step of config holds (measured on CPUs within 25%,
    docs/devices.md): 16 a parameter (weights, gradients, AdamW's two moments), the causal masks,
    what backward keeps of each token (of each attention score, spelled out), and one chunk of the
    loss's logits."""
    C, L, T, V = config.n_embd, config.n_layer, config.block_size, config.vocab_size
    per_token = L * C * (72 if dtype == torch.float32 else 40)
    scores = L * config.n_head * T * 10 if config.attention == "explicit" else 0
    logits = 12 * V * min(batch_size * T, max(1, LOSS_CHUNK // V))
    return (
        16 * (12 * L * C * C + V * C) + L * T * T + batch_size * T * (per_token + scores) + logits
    )


def check_fits(config, batch_size: int, rt) -> None:
    """Refuse a run that cannot fit in free memory, before its model exists."""
    need = step_memory(config, batch_size, rt.dtype)
    if rt.device.startswith("cuda"):
        free = torch.cuda.mem_get_info()[0]
    else:
        try:  # what Linux could still give this process, the page cache included
            with open("/proc/meminfo") as f:
                free = next(
                    int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")
                )
        except (OSError, StopIteration):
            return
    if need > free:
        raise UserError(
            f"this run needs at least {need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB "
            f"of {rt.device} memory is free; use a smaller --batch-size, --block-size or model"
        )
