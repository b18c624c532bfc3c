"""Where a run executes: what the machine has and what the run does with it (setup); the
training module, compiled with an eager fallback (TrainModule); how it is asked to stop
(StopSignal).

    rt = setup(cfg)                     # or setup(device="auto", dtype="auto") from sample.py
    print(rt.describe())                # cuda:0 NVIDIA T4 (capability 7.5), float16 + loss scaling, ...
    with rt.autocast():
        logits, loss = model(x, y)
    rt.scaler.scale(loss).backward()    # a no-op scaler unless dtype is float16

`probe()` reads what the machine reports into a Machine record and `plan()`, a pure function of
that record and the options, decides with TABLE; tests fake the record to check every row.
Parameters and optimizer state always stay float32; autocast only lowers the matmuls.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import random
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from checkpoint import capture_rng_state, restore_rng_state
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


@dataclass(frozen=True)
class Machine:
    """What the machine reports about itself: everything plan() reads, so tests can fake any machine."""
    gpu: str = ""  # CUDA device name; "" = no CUDA GPU
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability
    gpu_bf16: bool = False  # native bfloat16 (capability 8.0+); older GPUs only emulate it, slowly
    triton: bool = False  # the package torch.compile generates GPU kernels with
    mps: bool = False  # Apple-silicon GPU
    cpu_bf16: bool = False  # AVX512-BF16 or AMX: bf16 matmuls in hardware


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bfloat16 matmul instructions (AVX512-BF16, AMX), where bf16 autocast
    makes small-model training ~17% faster per step; elsewhere bf16 is emulated and slower."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private: absent on some builds
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def probe(local_rank: int = 0) -> Machine:
    """Ask torch what this machine has (CUDA device `local_rank`, when there is CUDA)."""
    common = dict(mps=torch.backends.mps.is_available(), cpu_bf16=cpu_has_native_bf16())
    if not torch.cuda.is_available():
        return Machine(**common)
    cap = torch.cuda.get_device_capability(local_rank)
    # What torch.cuda.is_bf16_supported(including_emulation=False) checks, without making the
    # device current (a CUDA context costs memory even on a --device cpu run).
    bf16 = torch.version.hip is not None or cap >= (8, 0)
    return Machine(gpu=torch.cuda.get_device_name(local_rank), capability=cap, gpu_bf16=bf16,
                   triton=importlib.util.find_spec("triton") is not None, **common)


# The decision table: tier() names a machine's row; --dtype and --compile then apply on top.
#   tier          dtype for --dtype auto   fused AdamW   why --compile is off there
TABLE = {
    "cuda bf16": (torch.bfloat16, True, ""),  # Ampere (8.0) and later: no loss scaling needed
    "cuda fp16": (torch.float16, True, ""),  # Volta/Turing (7.x): fp16 tensor cores, bf16 only emulated
    # Pascal and older: no tensor cores, so fp16 buys little (and runs at 1/64 rate on sm 6.1)
    "cuda old": (torch.float32, True, "capability {cap} < 7.0, the oldest Triton compiles for"),
    # MPS: float32, as autocast coverage varies by macOS version; AdamW's default (foreach) step,
    # as the fused MPS kernel is recent (torch 2.4) and unmeasured here
    "mps": (torch.float32, False, "torch.compile's Metal backend is a prototype"),
    "cpu bf16": (torch.bfloat16, True, ""),  # AVX512-BF16/AMX: ~17% faster steps on the small config
    "cpu": (torch.float32, True, ""),  # emulated bf16 is slower than float32
}


def tier(device_type: str, m: Machine) -> str:
    """The TABLE row of a `device_type` device on machine `m`."""
    if device_type == "cuda":
        return "cuda bf16" if m.gpu_bf16 else "cuda fp16" if m.capability >= (7, 0) else "cuda old"
    return "cpu bf16" if device_type == "cpu" and m.cpu_bf16 else device_type


@dataclass(frozen=True)
class Plan:
    """What a run does with the machine; plan() decides it."""
    device: str  # "cuda:0", "mps", "cpu"
    dtype: torch.dtype  # autocast compute dtype; float32 means no autocast
    fused_adamw: bool
    compile: bool  # torch.compile the training step
    name: str = ""  # what describe() adds to the device: the GPU, the CPU's bf16 instructions
    compile_off: str = ""  # why compile is off although it was asked for

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def loss_scaling(self) -> bool:
        return self.dtype == torch.float16  # small fp16 gradients underflow to zero without it


def _pick_device(device: str, m: Machine, local_rank: int) -> str:
    if device == "auto":
        device = "cuda" if m.gpu else "mps" if m.mps else "cpu"
    if device == "cuda":
        if not m.gpu:
            raise UserError("--device cuda but torch sees no CUDA GPU; use --device auto or --device cpu")
        return f"cuda:{local_rank}"
    if device == "mps" and not m.mps:
        raise UserError("--device mps but MPS is not available; use --device auto or --device cpu")
    if device not in ("cpu", "mps"):
        raise UserError(f"unknown device {device!r}; choose auto, cpu, cuda or mps")
    return device


def _pick_dtype(dtype: str, row: str, training: bool = True) -> torch.dtype:
    if dtype == "auto":
        # Sampling on a bf16 CPU stays float32 at every size measured (bench.py sample, 1 thread,
        # Sapphire Rapids): the small char model's eager bf16 decoding ran 0.60x float32's tokens/s
        # (per-op overhead, plus casts), GPT-2 124M's 0.92-0.96x eager and 0.86-1.01x compiled:
        # one-row bf16 matmuls (oneDNN, prepacked by inductor's freezing or not) read ~6 GB/s
        # where float32's read ~10 GB/s, so halving the bytes does not pay. Fewer bytes that do
        # pay: weight-only int8 (sample.py --quantize int8), a quality trade, so never automatic.
        return torch.float32 if row == "cpu bf16" and not training else TABLE[row][0]
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise UserError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    if dtype == "bfloat16" and row.startswith("cuda") and row != "cuda bf16":
        raise UserError("this GPU has no native bfloat16 (capability < 8.0); use --dtype float16 (or auto)")
    return table[dtype]


def plan(m: Machine, device: str = "auto", dtype: str = "auto", compile: bool = False, training: bool = True,
         local_rank: int = 0) -> Plan:
    """Device, precision, optimizer kernels and compilation for machine `m` and the options."""
    dev = _pick_device(device, m, local_rank)
    row = tier(dev.split(":")[0], m)
    _, fused, why = TABLE[row]
    cap, gpu = "{}.{}".format(*m.capability), row.startswith("cuda")
    if gpu and not why and not m.triton:
        why = "Triton is not installed (pip install triton; triton-windows on Windows)"
    why = why.format(cap=cap) if compile else ""
    name = f"{m.gpu} (capability {cap})" if gpu else "with bf16 instructions" if row == "cpu bf16" else ""
    return Plan(dev, _pick_dtype(dtype, row, training), fused, compile and not why, name, why)


@dataclass
class Runtime:
    plan: Plan
    scaler: torch.amp.GradScaler
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    peak_flops: float | None = None  # per device
    attention: str = ""  # the kernel torch picks for the training step's attention, when known

    @property
    def device(self) -> str:
        return self.plan.device

    @property
    def device_type(self) -> str:  # "cuda", "mps", "cpu": what torch.autocast wants
        return self.plan.device_type

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

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
            traceback.clear_frames(e.__traceback__)  # they hold the DDP wrapper, which close() needs gone
            reason = re.sub(r"^\[[^\]]*\] ", "", str(e).strip().splitlines()[0]).split(". ")[0][:200]
            cause = ("another process hung or was stopped, or took longer than --ddp-timeout"
                     if "timed out" in reason.lower() else "another process died (see its output)")
            raise UserError(f"process {self.rank} of {self.world_size}: {reason}; {cause}; restart the job, with "
                            "--resume if it saved a checkpoint") from None

    def close(self) -> None:
        """Destroy the process group; with the DDP wrapper gone first, this drops its last
        reference, so gloo joins its worker threads now. Left running into interpreter exit, a
        worker that frees a finished collective's tensor needs the GIL of a finalizing
        interpreter, is made to exit, and std::terminate aborts the process after a good run
        ("terminate called without an active exception", SIGABRT: torchrun then fails the job)."""
        if self.ddp and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def describe(self) -> str:
        """One line: device, precision, optimizer kernels, attention kernel, compilation (and why not)."""
        p = self.plan
        where = f"{self.world_size} processes x {p.device_type}" if self.ddp else p.device
        dtype = str(p.dtype).removeprefix("torch.") + (" + loss scaling" if p.loss_scaling else "")
        compiled = "compile on" if p.compile else f"compile off: {p.compile_off}" if p.compile_off else "compile off"
        parts = [f"{where} {p.name}".strip(), dtype, "fused AdamW" if p.fused_adamw else "AdamW (not fused)",
                 self.attention, compiled]
        return ", ".join(part for part in parts if part)


def attention_kernel(cfg: Any, rt: Runtime) -> str:
    """The attention kernel of the training step, as torch's own dispatcher picks it for these
    shapes (it weighs capability, dtype, head size and dropout; on sm90 it may prefer cuDNN)."""
    if cfg.attention == "explicit" or rt.device_type == "mps":  # MPS has one SDPA kernel
        return "explicit attention" if cfg.attention == "explicit" else "SDPA"
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, cfg.n_head, 8, cfg.n_embd // cfg.n_head, device=rt.device, dtype=rt.dtype, requires_grad=True)
    try:  # a private query: where a build lacks it, the line just omits the kernel
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True, dropout_p=cfg.dropout)
    except (AttributeError, RuntimeError, NotImplementedError):
        return "SDPA"
    return f"SDPA {SDPBackend(choice).name.lower().removesuffix('_attention')}"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def setup(cfg: Any = None, *, device: str = "auto", dtype: str = "auto", seed: int | None = 1337,
          training: bool = True, ddp_timeout: float = 600.0) -> Runtime:
    """Decide device, precision and compilation (plan), seed the RNGs, join the process group
    under torchrun.

    `cfg` is anything with .device, .dtype, .seed, .threads, .compile and .ddp_timeout (a
    TrainConfig); without one the keyword arguments are used and nothing is compiled. Each rank seeds with seed + rank
    so dropout masks differ between ranks; the weights still start identical because DDP
    broadcasts rank 0's at wrap time. training=False (sampling) keeps dtype auto at float32 on
    CPU: bf16 speeds up training steps there, but one-token decode steps run faster in float32.
    """
    compile = False
    if cfg is not None:
        device, dtype, seed, compile, ddp_timeout = cfg.device, cfg.dtype, cfg.seed, cfg.compile, cfg.ddp_timeout
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    p = plan(probe(local_rank), device, dtype, compile, training, local_rank)
    dev, device_type = p.device, p.device_type
    if world_size > 1:
        if device_type == "mps":
            raise UserError("DDP does not support MPS; run a single process, or use --device cpu")
        import torch.distributed as dist

        if not dist.is_initialized():
            # Imported now, while there is no group: DDP imports it, and its functions take
            # `group=group.WORLD` as default arguments, which imported later would hold the group
            # for good, so close() could never join gloo's threads.
            import torch.distributed.nn as _  # noqa: F401

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
    scaler = torch.amp.GradScaler(device_type, enabled=p.loss_scaling)
    if seed is not None:
        seed_everything(seed + rank)
    peak = peak_flops(torch.cuda.get_device_name(dev)) if device_type == "cuda" else None
    rt = Runtime(p, scaler, rank, local_rank, world_size, peak)
    if cfg is not None:
        rt.attention = attention_kernel(cfg, rt)
    return rt


class TrainModule:
    """The module the training step runs: `model` compiled when the plan says so, then wrapped
    in DDP under torchrun; `model` itself again, uncompiled, if compiling fails.

    torch.compile is lazy: the forward compiles at the first call, the backward at the first
    backward, so most failures (no Triton, too old a GPU, no C++ compiler, a missing libcuda)
    surface in the first step. run() retries that step eagerly from the same batches and RNG
    state, so the run goes on exactly as an uncompiled one would. A failure never stops the run,
    even with an explicit --compile: the eager step computes the same thing, only slower, and
    one line says why. Evaluation and sampling call `model` directly and are never compiled.
    """

    def __init__(self, model: torch.nn.Module, rt: Runtime) -> None:
        self.model, self.rt = model, rt
        self.untried = False  # compiled, and the first step has yet to show that compiling works
        module = model
        if rt.plan.compile:
            try:
                module, self.untried = torch.compile(model), True
            except Exception as e:  # e.g. a Python version or platform torch.compile does not support
                self._note("wrapping the model", e)
        self.module = self._ddp(module)

    def close(self) -> None:
        """Drop the DDP wrapper, which holds the process group, so that Runtime.close() ends it."""
        self.module = self.model

    def _ddp(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.rt.ddp:
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, device_ids=[self.rt.local_rank] if self.rt.device_type == "cuda" else None)

    def _note(self, when: str, e: BaseException) -> None:
        while (inner := e.__cause__ or getattr(e, "inner_exception", None)) is not None:
            e = inner  # torch wraps the compiler's own error (BackendCompilerFailed): name that one
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:200]
        if self.rt.is_master:
            from tqdm import tqdm  # writes above a progress bar instead of into it

            tqdm.write(f"note: torch.compile failed {when} ({type(e).__name__}: {reason}); continuing uncompiled")

    def run(self, step: Callable[..., Any], loader: Any, *args: Any) -> Any:
        """step(module, loader, *args); if the first compiled one fails, that step again uncompiled."""
        if not self.untried:
            return step(self.module, loader, *args)
        self.untried = False
        before = loader.state_dict(), capture_rng_state()
        try:
            return step(self.module, loader, *args)
        except Exception as e:  # a bug fails again below, uncompiled, with its own traceback
            self._note("in the first step", e)
        self.model.zero_grad(set_to_none=True)
        loader.load_state_dict(before[0])
        restore_rng_state(before[1])
        # Every rank fails alike (same software), so the new DDP's broadcast pairs up across ranks.
        self.module = self._ddp(self.model)
        return step(self.module, loader, *args)


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves, evaluates and exits.

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
            print(f"\n{self.name}: finishing this step, then save + eval (Ctrl-C again to quit without saving)",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
