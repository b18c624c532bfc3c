"""Where a run runs (training/runtime.py), decided on faked machines.

setup()'s device, dtype, compile and threads; cpu_has_bf16, idle_cores and check_fits on faked
/proc files; a step's memory, measured; and the first line and the mfu that train.py writes.

Every test fakes what torch and Linux report, so that each kind of machine is decided here,
whatever this one is; nothing touches a real GPU.
"""

import ast
import io
import os
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import in_process, rows, script, tiny_args
from test_train import read  # metrics.jsonl's records

import train
from configs import UserError, cpu_has_bf16, load_config
from model.gpt import GPT
from training.runtime import Runtime, check_fits, idle_cores, peak_flops, setup, step_memory

TINY = load_config("tiny")


# What the machine has (None: no C++ compiler, no Triton), the environment (X_Y) and the flags
# (TrainConfig's) => what setup() decides: the device, autocast's dtype, torch's threads (3 before),
# compile, each idle_cores() it asked, and the seed where it is not tiny's 1337 (the config's plus
# the rank); or its error.
MACHINE = """RANK= LOCAL_RANK= WORLD_SIZE= LOCAL_WORLD_SIZE= OMP_NUM_THREADS= \
cuda=False mps=False capability=(8,0) cxx=True triton=True cpu_bf16=False idle=1"""
SETUPS = """
cuda=True mps=True => cuda:0 bfloat16 threads=3
mps=True cpu_bf16=True => mps float32 threads=3
cpu_bf16=False => cpu float32 threads=1 idle_cores()
cpu_bf16=True => cpu bfloat16 threads=1 idle_cores()
cuda=True LOCAL_RANK=3 => cuda:3 bfloat16 threads=3
cuda=True capability=(7,5) cpu_bf16=True LOCAL_RANK=3 => cuda:3 float16 threads=3
cuda=True capability=(7,5) device='cuda' dtype='float32' => cuda:0 float32 threads=3
cuda=True capability=(7,5) device='cuda' dtype='bfloat16' => cuda:0 bfloat16 threads=3
cuda=True device='cuda' dtype='float16' => cuda:0 float16 threads=3
cpu_bf16=True device='cpu' dtype='float32' => cpu float32 threads=1 idle_cores()
device='cpu' dtype='bfloat16' => cpu bfloat16 threads=1 idle_cores()
cpu_bf16=True dtype='float16' => cpu float16 threads=1 idle_cores()
mps=True cpu_bf16=True device='mps' dtype='float32' => mps float32 threads=3
mps=True device='mps' dtype='bfloat16' => mps bfloat16 threads=3
mps=True dtype='float16' => mps float16 threads=3
device='cuda' => --device cuda, but torch cannot use one here; use --device auto
device='mps' => --device mps, but torch cannot use one here; use --device auto
cuda=True device='cpu' => cpu float32 threads=1 idle_cores()
compile=True triton=None => cpu float32 threads=1 compiled idle_cores()
compile=True cxx=None => cpu float32 threads=1 idle_cores()
cuda=True capability=(7,0) cxx=None compile=True => cuda:0 float16 threads=3 compiled
cuda=True capability=(9,0) compile=True => cuda:0 bfloat16 threads=3 compiled
cuda=True capability=(6,1) compile=True => cuda:0 float16 threads=3
cuda=True triton=None compile=True => cuda:0 bfloat16 threads=3
mps=True compile=True => mps float32 threads=3
idle=2 => cpu float32 threads=2 idle_cores()
idle=4 LOCAL_WORLD_SIZE=2 => cpu float32 threads=2 idle_cores()
idle=5 LOCAL_WORLD_SIZE=2 => cpu float32 threads=2 idle_cores()
idle=1 LOCAL_WORLD_SIZE=2 => cpu float32 threads=1 idle_cores()
idle=2 threads=4 => cpu float32 threads=4
OMP_NUM_THREADS=3 => cpu float32 threads=3
OMP_NUM_THREADS=3 threads=2 => cpu float32 threads=2
cuda=True idle=2 threads=2 => cuda:0 bfloat16 threads=3
seed=5 => cpu float32 threads=1 idle_cores() seed=5
RANK=2 seed=3 => cpu float32 threads=1 idle_cores() seed=5"""


@pytest.mark.parametrize("given, decided", rows(SETUPS, " => "))
def test_setup_decides_device_dtype_threads_and_compile(monkeypatch, given, decided):
    m, fields, gpu, idled = SimpleNamespace(), {}, [], []
    for key, value in (word.split("=") for word in f"{MACHINE} {given}".split()):
        if key.isupper():  # X_Y=: unset
            monkeypatch.setenv(key, value) if value else monkeypatch.delenv(key, raising=False)
        else:
            (fields if hasattr(TINY, key) else vars(m))[key] = ast.literal_eval(value)
    # gpu: what setup() asks of the GPU; idled: its calls of idle_cores
    for target, fake in {
        "torch.cuda.is_available": lambda: m.cuda,
        "torch.mps.is_available": lambda: m.mps,
        "torch.cuda.get_device_capability": lambda *a: gpu.append(a) or m.capability,
        "torch.cuda.set_device": gpu.append,
        "torch.set_float32_matmul_precision": gpu.append,
        "shutil.which": lambda name: m.cxx,
        "importlib.util.find_spec": {"triton": m.triton}.get,  # Triton where it is; nothing else
        "configs.cpu_has_bf16": lambda: m.cpu_bf16,
        "training.runtime.idle_cores": lambda: idled.append(1) or m.idle,
    }.items():
        monkeypatch.setattr(target, fake)
    torch.set_num_threads(3)  # what torch took at start-up
    try:
        rt = setup(replace(TINY, **fields))
    except UserError as e:
        assert str(e) == decided and gpu == []
        return
    seed = torch.initial_seed()
    assert rt.world_size == 1 and decided == (
        f"{rt.device} {str(rt.dtype)[6:]} threads={torch.get_num_threads()}"
        f"{' compiled' * rt.compile}{' idle_cores()' * len(idled)}"
        f"{f' seed={seed}' * (seed != 1337)}"
    )
    # the capability of the process's own GPU, that GPU, TF32 matmuls, then its capability again
    assert gpu == [(rt.local_rank,), rt.device, "high", ()] * rt.device.startswith("cuda")


def test_autocast_is_off_for_float32_and_on_otherwise():
    x = torch.ones(2, 2)
    with warnings.catch_warnings(action="error"):  # on for float32, torch would warn and turn off
        for dtype in torch.float32, torch.bfloat16:
            with Runtime("cpu", dtype).autocast():
                assert (x @ x).dtype == dtype
    with warnings.catch_warnings(action="ignore"):  # without a GPU, torch warns and turns it off
        context = Runtime("cuda:1", torch.float16).autocast()
    assert (context.device, context.fast_dtype) == ("cuda", torch.float16)  # cuda:1 is a cuda


def fake_files(monkeypatch, files):
    """open() in runtime and configs reads these texts, one a read; any other path, or a path
    whose texts were read, is missing."""

    def fake_open(path):
        if not files.get(path):
            raise FileNotFoundError(path)
        return io.StringIO(files[path].pop(0))

    for module in "training.runtime", "configs":
        monkeypatch.setattr(f"{module}.open", fake_open, raising=False)


# /proc/cpuinfo's line => whether it says bfloat16 is in hardware (none: no /proc/cpuinfo)
BF16 = """
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile => True
flags\t\t: fpu sse2 avx512f amx_bf16 amx_tile => True
flags\t\t: fpu sse2 avx512f avx2 => False
flags\t\t: fpu sse2 avx512_bf16x => False
bugs\t\t: avx512_bf16 => False
none => False
"""


@pytest.mark.parametrize("line, has", rows(BF16, " => "))
def test_cpu_has_bf16_reads_the_flags_of_proc_cpuinfo(monkeypatch, line, has):
    info = f"processor\t: 0\nmodel name\t: x avx512_bf16 in its name\n{line}\n"
    fake_files(monkeypatch, {"/proc/cpuinfo": [info] * (line != "none")})
    assert str(cpu_has_bf16()) == has


# The busy share of cores 0, 1 and 2 (this process may use 0 and 1) => torch's threads => the
# idle cores counted. 0.4 of a core busy leaves 1.6 idle: 2; 0.6 leaves 1.4: 1; at least 1; at most
# torch's threads; without /proc/stat, torch's threads.
IDLE = """
0 0 1 => 2 => 2
1 0 0 => 2 => 1
0 1 1 => 2 => 1
0.2 0.2 1 => 2 => 2
0.3 0.3 0 => 2 => 1
1 1 0 => 2 => 1
0 0 0 => 1 => 1
none => 3 => 3
"""


@pytest.mark.parametrize("busy, threads, idle", rows(IDLE, " => "))
def test_idle_cores_counts_the_cores_others_leave_idle(monkeypatch, busy, threads, idle):
    sleeps, ticks = [], os.sysconf("SC_CLK_TCK") * 0.2  # in 0.2 s
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("time.sleep", sleeps.append)
    torch.set_num_threads(int(threads))
    # /proc/stat with no ticks yet, then 0.2 s later: the total, which is not a core, then each core
    # busy for its share of the time in user, system and steal ticks, while idle, iowait and guest
    # ticks pile up anyway
    cores = [
        f"cpu{n} {t // 2} 0 {t // 4} 99 99 0 0 {t - t // 2 - t // 4} 99 99"
        for n, t in enumerate(round(float(b) * ticks) for b in busy.split() if busy != "none")
    ]
    after = "cpu  9 9 9 9 9 9 9 9 9 9\n{}\nintr 5 6 7\nctxt 99\n".format("\n".join(cores))
    fake_files(monkeypatch, {"/proc/stat": ["cpu0 0\ncpu1 0\ncpu2 0\n", after] * (cores != [])})
    assert str(idle_cores()) == idle and sleeps == [0.2] * (cores != [])


def test_check_fits_refuses_a_step_that_needs_more_than_is_free(monkeypatch):
    config, rt = replace(TINY, vocab_size=65), Runtime("cpu", torch.float32)
    kb = -(-step_memory(config, 4, rt.dtype) // 1024)  # the fewest kB that hold it
    meminfo = "MemTotal:  9999999 kB\nMemFree:  1 kB\nMemAvailable:  {} kB\n".format
    fake_files(monkeypatch, {"/proc/meminfo": [meminfo(kb), meminfo(kb - 1), "MemTotal:  5 kB"]})
    check_fits(config, 4, rt)
    with pytest.raises(UserError, match=r"needs at least 0\.0 GiB, and 0\.0 GiB of cpu memory"):
        check_fits(config, 4, rt)
    for _ in range(2):  # no MemAvailable, then no /proc/meminfo: nothing to check
        check_fits(config, 10**6, rt)
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (3 << 30, 0))
    # 16 GiB of embedding alone, and 3 GiB free
    with pytest.raises(UserError, match=r"needs at least 16\.\d GiB, and 3\.0 GiB of cuda:0"):
        check_fits(replace(config, vocab_size=2**20, n_embd=2**10), 1, replace(rt, device="cuda:0"))


# One step of 4 layers x 128 on 8 x 256 tokens of GPT-2's vocabulary in bfloat16: its logits
# (8 x 256 x 50304 in float32: 0.41 GB) are over 3 of the loss's chunks, and the estimate's
# parameters, activations and chunk are each a part of its 0.56 GB.
MEASURE_A_STEP = """
import torch
torch.set_num_threads(1)  # the memory of one thread's allocations: the same on a busy machine
from model.gpt import GPT, GPTConfig
from training.runtime import step_memory
config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256, vocab_size=50304)
batch, dtype = 8, torch.bfloat16
x = torch.randint(0, config.vocab_size, (batch, config.block_size))

def status(key):  # kB
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))

def step(model, x):  # AdamW makes its moments while the gradients are there
    with torch.autocast("cpu", dtype):
        model(x, x)[1].backward()
    torch.optim.AdamW(model.parameters(), fused=True).step()

step(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=16)), x[:1, :8] % 16)  # the kernels
with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: VmHWM = VmRSS
    f.write("5")
before = status("VmRSS:")
step(GPT(config), x)
print((status("VmHWM:") - before) * 1024, step_memory(config, batch, dtype), x.numel() * 50304 * 4)
"""


@pytest.mark.slow
def test_a_step_holds_at_most_twice_its_logits_and_step_memory_is_within_a_quarter():
    """Measured in a process of its own: the memory a step adds (its peak resident set), against the
    estimate check_fits refuses a run by; the loss never holds the whole logits."""
    proc = script("-c", MEASURE_A_STEP)
    assert not proc.returncode, proc.stderr
    peak, estimate, logits = map(int, proc.stdout.split())
    assert peak <= 2 * logits and 0.75 * peak <= estimate <= 1.25 * peak, proc.stdout


# A GPU's name => its peak FLOP/s (not in the table: 0, no MFU)
PEAKS = """
NVIDIA H100 80GB HBM3 => 989e12
NVIDIA H100 PCIe => 756e12
NVIDIA A100-SXM4-40GB => 312e12
NVIDIA A10G => 70e12
Tesla T4 => 65e12
NVIDIA GeForce GTX 1080 => 0
"""


@pytest.mark.parametrize("name, flops", rows(PEAKS, " => "))
def test_peak_flops_reads_the_gpus_name(monkeypatch, name, flops):
    monkeypatch.setattr("torch.cuda.get_device_name", lambda device: name)
    assert peak_flops("cuda:0") == float(flops) and peak_flops("cpu") == 0


# train.py's flags => its first line, on a CPU with bfloat16, no C++ compiler and one idle core
# (conftest's)
FIRST_LINES = """
--max-iters 2 --dtype auto => cpu, 1 thread, bfloat16, compile off
--max-iters 2 --threads 2 --dtype float32 --compile --deterministic => cpu, 2 threads, float32, \
compile off (this machine cannot compile: docs/devices.md), deterministic
"""


@pytest.mark.parametrize("flags, first_line", rows(FIRST_LINES, " => "))
def test_the_first_line_and_the_mfu(tmp_path, data_root, monkeypatch, flags, first_line):
    monkeypatch.setattr("configs.cpu_has_bf16", lambda: True)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr("train.peak_flops", lambda device: 1e9)
    proc = in_process(train.main, *tiny_args(tmp_path, data_root, *flags.split()))
    torch.use_deterministic_algorithms(False)  # which setup() set for this whole process
    assert not proc.returncode and proc.stdout.startswith(f"{first_line}\n"), proc.stderr
    # as nanoGPT counts them: 6 a parameter, and 12 x 2 layers x 16 wide x 32 long
    flops = (6 * GPT(TINY.model_config(65)).num_params() + 12288) / 1e9  # a token's, of the peak
    steps = [r for r in read(tmp_path / "run") if "loss" in r]
    assert len(steps) == 2 and all(
        r["mfu"] == pytest.approx(r["tokens_per_s"] * flops, rel=1e-3, abs=1e-4) for r in steps
    )
