"""What a run runs on: device, precision, CPU threads, compilation, seeds and the DDP process group.

choose() decides from a Machine alone, by TABLE, so tests can fake any machine. Weights stay float32."""

import contextlib
import datetime
import importlib.util
import os
import random
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from configs.errors import UserError, first_line

# Dense bf16 peak FLOP/s from datasheets, by a substring of the GPU's name; other devices get no MFU (a guess misleads).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
              "L40": 181e12, "A6000": 155e12, "A10": 125e12, "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
              "V100": 125e12, "T4": 65e12}


@dataclass(frozen=True)
class Machine:
    """What the machine reports about itself: everything choose() reads."""
    gpu: str = ""  # the CUDA device's name, "" without a CUDA GPU
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability
    gpu_bf16: bool = False  # native bfloat16 (capability 8.0+), which older GPUs only emulate, slowly
    triton: bool = False  # what torch.compile generates GPU kernels with
    mps: bool = False  # Apple-silicon GPU
    cpu_bf16: bool = False  # AVX512-BF16 or AMX do bf16 matmuls in hardware


def probe(local_rank: int = 0) -> Machine:
    """Ask torch what this machine has (CUDA device `local_rank`, when there is CUDA)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, and absent on some builds
    cpu_bf16 = any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    if (forced := os.environ.get("GPT_CPU_BF16")) is not None:
        if forced not in ("0", "1"):
            raise UserError(f"GPT_CPU_BF16={forced!r}: use 0 (as if the CPU had no bf16 instructions), 1, or unset it")
        cpu_bf16 = forced == "1"  # so that one machine can test both CPU rows, as .ci/run does
    common = dict(mps=torch.backends.mps.is_available(), cpu_bf16=cpu_bf16)
    if not torch.cuda.is_available():
        return Machine(**common)
    index = local_rank if local_rank < torch.cuda.device_count() else 0  # a --device cpu job may outnumber GPUs
    cap = torch.cuda.get_device_capability(index)
    bf16 = torch.version.hip is not None or cap >= (8, 0)  # torch's native-bf16 check, without a CUDA context
    return Machine(gpu=torch.cuda.get_device_name(index), capability=cap, gpu_bf16=bf16,
                   triton=importlib.util.find_spec("triton") is not None, **common)


# The decision table: choose() picks a machine's row; --dtype and --compile apply on top (docs/devices.md).
#   row           dtype for --dtype auto   fused AdamW   why --compile is off there
TABLE = {
    "cuda bf16": (torch.bfloat16, True, ""),  # Ampere (8.0) and later: no loss scaling needed
    "cuda fp16": (torch.float16, True, ""),  # Volta/Turing (7.x): fp16 tensor cores, bf16 only emulated
    "cuda old": (torch.float32, True, "capability {cap} < 7.0, the oldest Triton compiles for"),  # no tensor cores
    "mps": (torch.float32, False, "torch.compile's Metal backend is a prototype"),  # autocast, fused: young there
    "cpu bf16": (torch.bfloat16, True, ""),  # AVX512-BF16/AMX: faster steps
    "cpu": (torch.float32, True, ""),  # emulated bf16 is slower than float32
}


@dataclass(frozen=True)
class Choices:
    """What a run does with the machine; choose() decides it."""
    device: str  # "cuda:0", "mps", "cpu"
    dtype: torch.dtype  # autocast compute dtype; float32 means no autocast
    fused_adamw: bool
    compile: bool  # torch.compile the training step
    name: str = ""  # what describe() adds to the device: the GPU, the CPU's bf16 instructions
    compile_off: str = ""  # why compile is off although it was asked for

    device_type = property(lambda self: self.device.split(":")[0])
    loss_scaling = property(lambda self: self.dtype == torch.float16)  # small fp16 gradients underflow without it


def choose(m: Machine, device: str = "auto", dtype: str = "auto", compile: bool = False, training: bool = True,
           local_rank: int = 0) -> Choices:
    """Device, precision, optimizer kernels and compilation for machine `m` and the options."""
    device = ("cuda" if m.gpu else "mps" if m.mps else "cpu") if device == "auto" else device
    if device not in ("cpu", "cuda", "mps"):
        raise UserError(f"unknown device {device!r}; choose auto, cpu, cuda or mps")
    if (device == "cuda" and not m.gpu) or (device == "mps" and not m.mps):
        missing = "torch sees no CUDA GPU" if device == "cuda" else "MPS is not available"
        raise UserError(f"--device {device} but {missing}; use --device auto or --device cpu")
    gpu, cap = device == "cuda", "{}.{}".format(*m.capability)
    row = "cpu bf16" if device == "cpu" and m.cpu_bf16 else device
    if gpu:
        row = "cuda bf16" if m.gpu_bf16 else "cuda fp16" if m.capability >= (7, 0) else "cuda old"
    auto, fused, why = TABLE[row]
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise UserError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    if dtype == "bfloat16" and gpu and row != "cuda bf16":
        raise UserError("this GPU has no native bfloat16 (capability < 8.0); use --dtype float16 (or auto)")
    # decoding on a bf16 CPU stays float32: one-row bf16 matmuls were no faster (docs/devices.md)
    chosen = getattr(torch, dtype) if dtype != "auto" else torch.float32 if row == "cpu bf16" and not training else auto
    if gpu and not why and not m.triton:
        why = "Triton is not installed (pip install triton; triton-windows on Windows)"
    why = why.format(cap=cap) if compile else ""
    name = f"{m.gpu} (capability {cap})" if gpu else "with bf16 instructions" if row == "cpu bf16" else ""
    return Choices(f"cuda:{local_rank}" if gpu else device, chosen, fused, compile and not why, name, why)


@dataclass
class Runtime(contextlib.AbstractContextManager):
    """A run's device, precision and process group, as setup() returns them. Its with-block ends the group."""

    choices: Choices
    scaler: torch.amp.GradScaler
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    peak_flops: float | None = None  # per device
    attention: str = ""  # the kernel torch picks for the training step's attention, when known
    deterministic: bool = False  # --deterministic: kernels that give the same bits every run
    threads: "CpuThreads | None" = None  # a CPU run's

    device = property(lambda self: self.choices.device)
    device_type = property(lambda self: self.choices.device_type)  # "cuda", "mps", "cpu": for torch.autocast
    dtype = property(lambda self: self.choices.dtype)
    ddp = property(lambda self: self.world_size > 1)
    is_master = property(lambda self: self.rank == 0)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.dtype == torch.float32 else torch.autocast(self.device_type, self.dtype)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Under DDP, a UserError in any rank exits all of them with one line from the first, not lost in peers'."""
        error = None
        try:
            yield
        except UserError as e:
            if not self.ddp:
                raise
            error = e
        failed = [error is not None] * self.world_size
        if self.ddp:
            torch.distributed.all_gather_object(failed, error is not None)
        if any(failed):  # only under DDP, since a single process raised it above
            if failed.index(True) == self.rank:
                print(f"error: {error}", file=sys.stderr, flush=True)
            torch.distributed.barrier()  # no rank exits before the line is out; torchrun then stops the rest
            raise SystemExit(2)

    @contextlib.contextmanager
    def peer_failures(self) -> Iterator[None]:
        """Under DDP, a collective that timed out (--ddp-timeout) or lost its peer is one line, not tracebacks."""
        try:
            yield
        except RuntimeError as e:  # gloo's is a plain RuntimeError whose text names its source file, ".../gloo/..."
            if not self.ddp or not (isinstance(e, torch.distributed.DistError) or "gloo" in str(e)):
                raise
            traceback.clear_frames(e.__traceback__)  # they hold the DDP wrapper, which close() needs gone
            reason = first_line(e).split(". ")[0]  # torch's first sentence: "... Timed out", "... Connection reset"
            raise UserError(f"process {self.rank} of {self.world_size}: {reason}; another process died (see its "
                            "output), hung or was stopped, or took longer than --ddp-timeout; restart the job, with "
                            "--resume if it saved a checkpoint") from None

    def __exit__(self, *exc: Any) -> None:
        """Destroy the process group now: gloo's threads left running into interpreter exit can abort a job."""
        if self.ddp and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def describe(self) -> str:
        p = self.choices
        where = f"{self.world_size} processes x {p.device_type}" if self.ddp else p.device
        dtype = str(p.dtype).removeprefix("torch.") + (" + loss scaling" if p.loss_scaling else "")
        compiled = "compile on" if p.compile else f"compile off: {p.compile_off}" if p.compile_off else "compile off"
        parts = [f"{where} {p.name}".strip(), self.threads.describe() if self.threads else "", dtype,
                 "fused AdamW" if p.fused_adamw else "AdamW (not fused)", self.attention, compiled,
                 "deterministic" if self.deterministic else ""]
        return ", ".join(part for part in parts if part)


def attention_kernel(cfg: Any, rt: Runtime) -> str:
    """The training step's attention kernel as torch's dispatcher picks it for these shapes, dtype and dropout."""
    if cfg.attention == "explicit" or rt.device_type == "mps":  # MPS has one SDPA kernel
        return "explicit attention" if cfg.attention == "explicit" else "SDPA"
    try:  # a private query: a build without it, or no memory for q, names no kernel
        q = torch.zeros(1, cfg.n_head, 8, cfg.n_embd // cfg.n_head, device=rt.device, dtype=rt.dtype).requires_grad_()
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True, dropout_p=cfg.dropout)
    except (AttributeError, RuntimeError, NotImplementedError):
        return "SDPA"
    return f"SDPA {torch.nn.attention.SDPBackend(choice).name.lower().removesuffix('_attention')}"


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (taskset and cgroups can allow fewer than the machine has)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def set_threads(threads: int) -> None:
    """--threads sets torch's CPU threads, 0 leaving its default. More than the cores only thrash or exhaust memory."""
    if threads > (cores := len(usable_cpus())):
        raise UserError(f"--threads {threads}: this process may use {cores} core{'s' * (cores > 1)}; "
                        f"use at most {cores} (0 = torch's default)")
    if threads:
        torch.set_num_threads(threads)


def cpu_times(cpus: set[int]) -> tuple[float, float]:
    """The busy seconds of `cpus` since boot, from /proc/stat, and this process's CPU seconds."""
    with open("/proc/stat") as f:
        rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    busy = sum(int(n) for row in rows if int(row[0][3:]) in cpus for n in row[1:4] + row[6:9])  # not idle, iowait
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time()


class CpuThreads:
    """Torch's CPU threads, one per core that other processes leave idle (torch's default off Linux). OpenMP threads
    spin waiting for each other, so one whose core is taken slows every step, up to 200x (docs/performance.md).
    --threads N, OMP_NUM_THREADS and --deterministic fix the count, since only a fixed count repeats a run exactly."""

    LOOK_S = 0.5  # 50 clock ticks a core, enough to tell a busy core from an idle one

    def __init__(self, requested: int = 0, fixed: bool = False, read: Any = cpu_times,
                 clock: Any = time.monotonic) -> None:
        self.most, self.read, self.clock = torch.get_num_threads(), read, clock  # torch's default, or as asked
        self.cpus = usable_cpus()
        self.fixed = fixed or bool(requested) or "OMP_NUM_THREADS" in os.environ or self.most == 1
        try:
            self.last = None if self.fixed else (clock(), *read(self.cpus))  # (when, busy, own)
        except OSError:  # no /proc/stat off Linux
            self.fixed = True
        if not self.fixed:
            torch.set_num_threads(1)

    def update(self) -> None:
        """Called each step. Once LOOK_S has passed, it sets one thread per core that stayed more than half idle."""
        if self.fixed or (now := self.clock()) - self.last[0] < self.LOOK_S:
            return
        busy, own = self.read(self.cpus)
        others = max(0.0, (busy - self.last[1]) - (own - self.last[2])) / (now - self.last[0])
        self.last = now, busy, own
        torch.set_num_threads(max(1, min(self.most, round(len(self.cpus) - others))))

    def describe(self) -> str:
        fixed = f"{self.most} thread{'s' * (self.most > 1)}"
        return fixed if self.fixed else f"1-{self.most} threads as cores are idle"


def torchrun_environment() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun set them, or (0, 0, 1); a partial set is one error line."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    given = {name: os.environ[name] for name in names if name in os.environ}
    if not given:
        return 0, 0, 1
    missing = [name for name in names if name not in given]
    numbers = [given.get(name, "") for name in names[:3]]
    if missing or not all(n.isdigit() for n in numbers) or int(numbers[0]) >= int(numbers[2]):
        found = " ".join(f"{name}={value}" for name, value in given.items())
        lacking = f" without {', '.join(missing)}" if missing else ""
        raise UserError(f"the environment has {found}{lacking}, not a whole torchrun set; unset "
                        f"{'them' if len(given) > 1 else 'it'} to train one process, or launch with torchrun")
    return int(numbers[0]), int(numbers[1]), int(numbers[2])


def setup(cfg: Any = None, *, device: str = "auto", dtype: str = "auto", seed: int | None = 1337,
          training: bool = True) -> Runtime:
    """Decide device, precision and compilation, seed the RNGs and join torchrun's group, as cfg or the keywords say."""
    compile, ddp_timeout = False, 600.0
    if cfg is not None:
        device, dtype, seed, compile, ddp_timeout = cfg.device, cfg.dtype, cfg.seed, cfg.compile, cfg.ddp_timeout
        set_threads(cfg.threads)  # a bad --threads fails before anything else is decided
        if cfg.deterministic:  # torch's reproducibility notes: cuBLAS needs a fixed workspace before any matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rank, local_rank, world_size = torchrun_environment() if training else (0, 0, 1)
    p = choose(probe(local_rank), device, dtype, compile, training, local_rank)
    rt = Runtime(p, torch.amp.GradScaler(p.device_type, enabled=p.loss_scaling), rank, local_rank, world_size)
    if rt.device_type == "cuda":
        torch.cuda.set_device(rt.device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls are nearly free speed on Ampere and later
        hits = [k for k in PEAK_FLOPS if k in torch.cuda.get_device_name(rt.device)]  # longest wins: L40S, not L4
        rt.peak_flops = PEAK_FLOPS[max(hits, key=len)] if hits else None
    if rt.ddp:  # join the processes torchrun started, with NCCL on CUDA and gloo on the CPU
        if rt.device_type == "mps":
            raise UserError("DDP does not support MPS; run a single process, or use --device cpu")
        if not torch.distributed.is_initialized():
            # imported before the group exists: its defaults, bound to group.WORLD later, would keep the group alive
            import torch.distributed.nn as _  # noqa: F401
            gpu = rt.device_type == "cuda"  # a collective waiting past ddp_timeout fails: a hung process ends the job
            torch.distributed.init_process_group("nccl" if gpu else "gloo", device_id=torch.device(rt.device) if gpu
                                                 else None, timeout=datetime.timedelta(seconds=ddp_timeout))
    if seed is not None:
        random.seed(seed + rank)
        np.random.seed((seed + rank) % 2**32)
        torch.manual_seed(seed + rank)  # seeds every CUDA device too
    if cfg is not None:
        if not (cfg.resume or cfg.init_from or cfg.eval_only):  # else announce() names the weights' attention
            rt.attention = attention_kernel(cfg, rt)
        rt.deterministic = cfg.deterministic
        if rt.device_type == "cpu":
            rt.threads = CpuThreads(cfg.threads, fixed=cfg.deterministic)
        torch.use_deterministic_algorithms(cfg.deterministic)  # an op without such a kernel then raises
    return rt


def trainable(model: torch.nn.Module, rt: Runtime, example: tuple[torch.Tensor, torch.Tensor]) -> torch.nn.Module:
    """`model` for the training step, DDP-wrapped under torchrun; compiled now, by a step on `example` that leaves
    no gradients and the RNGs as they were, if the run compiles (a failed compile is one note, and runs eager)."""
    module = model
    if rt.choices.compile:
        when, rng = "wrapping the model", capture_rng_state()
        try:
            module = torch.compile(model)
            when = "in the first step"
            with rt.autocast():
                module(*example)[1].backward()
        except Exception as e:  # a bug fails again, uncompiled, in the first step, with its traceback
            module = model
            while (inner := e.__cause__ or getattr(e, "inner_exception", None)) is not None:
                e = inner  # torch wraps the compiler's own error (BackendCompilerFailed): name that one
            if rt.is_master:
                print(f"note: torch.compile failed {when} ({type(e).__name__}: {first_line(e)}); continuing uncompiled")
        model.zero_grad(set_to_none=True)
        restore_rng_state(rng)
    ids = [rt.local_rank] if rt.device_type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids) if rt.ddp else module


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step can touch, in types that torch.load(weights_only=True) reads back."""
    name, keys, *rest = np.random.get_state()
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), *rest], "torch": torch.get_rng_state(), **cuda}


def restore_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))  # older checkpoints hold a list
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())
    # on a machine with another GPU count than the checkpoint's, the CUDA RNGs stay as seeded
    if (cuda := state.get("cuda")) and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.cpu() for t in cuda])
