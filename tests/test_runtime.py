"""Where a run runs (training/runtime.py), decided on faked machines.

setup()'s device, dtype, compile and threads; cpu_has_bf16, idle_cores and check_fits on faked
/proc files; and the first line that train.py prints.

Every test fakes what torch and Linux report, so that each kind of machine is decided here,
whatever this one is; nothing touches a real GPU.
"""

import importlib.util
import io
import json
import os
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, script, tiny

import configs
import train
from configs import UserError, load_config
from model.checkpoint import load_checkpoint
from model.gpt import GPT, GPTConfig
from training import runtime
from training.runtime import Runtime, check_fits, peak_flops, setup, step_memory

# The real functions, as imported before conftest's CPU_BF16 fixture can stand in for them.
cpu_has_bf16, idle_cores = configs.cpu_has_bf16, runtime.idle_cores


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: the test sets what torch and the CPU report; setup() records what it asks."""
    m = SimpleNamespace(
        cuda=False,
        capability=(8, 0),
        asked=[],  # the GPUs whose capability was asked
        cxx=True,
        mps=False,
        triton=True,
        cpu_bf16=False,
        idle=1,
        idle_calls=0,
        devices=[],
        precision=[],
    )
    find_spec = importlib.util.find_spec

    def find(name, *args):
        return (object() if m.triton else None) if name == "triton" else find_spec(name, *args)

    def idle():
        m.idle_calls += 1
        return m.idle

    monkeypatch.setattr(torch.cuda, "is_available", lambda: m.cuda)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda *a: m.asked.append(a) or m.capability
    )
    monkeypatch.setattr(runtime.shutil, "which", lambda name: name if m.cxx else None)
    monkeypatch.setattr(torch.cuda, "set_device", m.devices.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.mps, "is_available", lambda: m.mps)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", m.precision.append)
    monkeypatch.setattr(importlib.util, "find_spec", find)
    monkeypatch.setattr(configs, "cpu_has_bf16", lambda: m.cpu_bf16)
    monkeypatch.setattr(runtime, "idle_cores", idle)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return m


def cfg(**fields):
    return replace(load_config("tiny"), **fields)


@pytest.mark.parametrize(
    "cuda, mps, device",
    [(True, True, "cuda:0"), (True, False, "cuda:0"), (False, True, "mps"), (False, False, "cpu")],
)
def test_auto_picks_cuda_then_mps_then_cpu(machine, cuda, mps, device):
    machine.cuda, machine.mps = cuda, mps
    assert setup(cfg()).device == device
    assert machine.devices == (["cuda:0"] if cuda else [])
    assert machine.precision == (["high"] if cuda else [])  # TF32 matmuls on a GPU


def test_a_gpu_is_the_local_ranks(machine, monkeypatch):
    machine.cuda = True
    monkeypatch.setenv("LOCAL_RANK", "1")
    rt = setup(cfg())
    assert (rt.device, rt.local_rank, rt.rank, rt.world_size) == ("cuda:1", 1, 0, 1)
    assert machine.devices == ["cuda:1"]


@pytest.mark.parametrize(
    "where, capability, cpu_bf16, dtype",
    [
        ("cuda", (8, 0), False, torch.bfloat16),  # Ampere on: bfloat16 in hardware
        ("cuda", (7, 5), True, torch.float16),  # a T4 (a V100 is 7.0): float16 and a loss scaler
        ("cpu", (9, 0), True, torch.bfloat16),
        ("cpu", (9, 0), False, torch.float32),
        ("mps", (9, 0), True, torch.float32),
    ],
)
def test_auto_dtype_is_bfloat16_where_the_hardware_has_it(
    machine, monkeypatch, where, capability, cpu_bf16, dtype
):
    machine.cuda, machine.mps = where == "cuda", where == "mps"
    machine.capability, machine.cpu_bf16 = capability, cpu_bf16
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert setup(cfg()).dtype == dtype
    assert machine.asked[:1] == ([(3,)] if where == "cuda" else [])  # the process's own GPU


@pytest.mark.parametrize("where", ["cuda", "cpu", "mps"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtype_overrides_what_auto_would_pick(machine, where, dtype):
    machine.cuda, machine.mps = where == "cuda", where == "mps"
    machine.cpu_bf16 = True
    assert setup(cfg(device=where, dtype=dtype)).dtype == getattr(torch, dtype)


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_a_device_torch_cannot_use_is_one_line(machine, device):
    with pytest.raises(UserError) as e:
        setup(cfg(device=device))
    assert str(e.value) == f"--device {device}, but torch cannot use one here; use --device auto"
    assert machine.devices == []


def test_device_cpu_is_taken_on_a_gpu_machine(machine):
    machine.cuda = True
    rt = setup(cfg(device="cpu"))
    assert (rt.device, rt.dtype) == ("cpu", torch.float32) and machine.devices == []


@pytest.mark.parametrize(
    "where, capability, triton, compiles",
    [
        ("cpu", (8, 0), False, True),  # a C++ compiler makes a CPU's kernels
        ("cpu", None, False, False),  # and none is installed
        ("cuda", (7, 0), True, True),
        ("cuda", (9, 0), True, True),
        ("cuda", (6, 1), True, False),  # older than Volta: Triton does not compile for it
        ("cuda", (8, 0), False, False),  # no Triton installed
        ("mps", (8, 0), True, False),
    ],
)
def test_compile_is_kept_only_where_it_can_compile(machine, where, capability, triton, compiles):
    machine.cuda, machine.mps = where == "cuda", where == "mps"
    machine.capability, machine.triton, machine.cxx = capability, triton, capability is not None
    assert setup(cfg(compile=True)).compile is compiles
    assert setup(cfg(compile=False)).compile is False


def test_the_seed_is_the_configs_plus_the_rank(machine, monkeypatch):
    setup(cfg(seed=5))
    first = torch.rand(3)
    monkeypatch.setenv("RANK", "2")  # one process without torchrun's others: no group to join
    rt = setup(cfg(seed=3))
    assert rt.rank == 2 and rt.world_size == 1
    assert torch.equal(torch.rand(3), first)


def test_threads_are_the_idle_cores(machine):
    machine.idle = 2
    setup(cfg())
    assert torch.get_num_threads() == 2 and machine.idle_calls == 1
    machine.idle = 1
    setup(cfg())
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("idle, processes, threads", [(4, "2", 2), (5, "2", 2), (1, "2", 1)])
def test_threads_share_the_idle_cores_among_a_nodes_processes(
    machine, monkeypatch, idle, processes, threads
):
    machine.idle = idle
    monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
    setup(cfg())
    assert torch.get_num_threads() == threads


def test_threads_flag_wins_over_the_idle_cores(machine):
    machine.idle = 2
    setup(cfg(threads=3))
    assert torch.get_num_threads() == 3


def test_omp_num_threads_keeps_torchs_count(machine, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch read from it at start-up
    machine.idle = 1
    setup(cfg())
    assert torch.get_num_threads() == 3 and machine.idle_calls == 0
    setup(cfg(threads=2))  # --threads still wins
    assert torch.get_num_threads() == 2


def test_threads_are_left_alone_on_a_gpu(machine):
    machine.cuda, machine.idle = True, 2
    torch.set_num_threads(1)
    setup(cfg(threads=2))
    assert torch.get_num_threads() == 1 and machine.idle_calls == 0


def test_autocast_is_off_for_float32_and_on_otherwise():
    x = torch.ones(2, 2)
    with warnings.catch_warnings():  # enabled for float32, torch would warn and disable it
        warnings.simplefilter("error")
        with Runtime("cpu", torch.float32).autocast():
            assert not torch.is_autocast_enabled("cpu") and (x @ x).dtype == torch.float32
    with Runtime("cpu", torch.bfloat16).autocast():
        assert torch.is_autocast_enabled("cpu") and (x @ x).dtype == torch.bfloat16
    with warnings.catch_warnings():  # without a GPU, torch warns and disables it
        warnings.simplefilter("ignore")
        context = Runtime("cuda:1", torch.float16).autocast()
    assert (context.device, context.fast_dtype) == ("cuda", torch.float16)  # cuda:1 is a cuda


def fake_files(monkeypatch, files: dict):
    """open() in runtime and configs reads these texts (a list: one per read) and nothing else."""
    reads = []

    def fake_open(path, *args, **kwargs):
        reads.append(path)
        text = files.get(path)
        if text is None:
            raise FileNotFoundError(path)
        return io.StringIO(text.pop(0) if isinstance(text, list) else text)

    for module in runtime, configs:
        monkeypatch.setattr(module, "open", fake_open, raising=False)
    return reads


@pytest.mark.parametrize(
    "flags, has",
    [
        ("fpu sse2 avx512f avx512_bf16 amx_tile", True),
        ("fpu sse2 avx512f amx_bf16 amx_tile", True),
        ("fpu sse2 avx512f avx2", False),
        ("fpu sse2 avx512_bf16x", False),  # a flag's whole name, not a part
    ],
)
def test_cpu_has_bf16_reads_the_flags_of_proc_cpuinfo(monkeypatch, flags, has):
    text = f"processor\t: 0\nmodel name\t: x avx512_bf16 in its name\nflags\t\t: {flags}\n"
    reads = fake_files(monkeypatch, {"/proc/cpuinfo": text})
    assert cpu_has_bf16() is has and reads == ["/proc/cpuinfo"]


def test_cpu_has_bf16_is_false_without_proc_cpuinfo_or_its_flags(monkeypatch):
    fake_files(monkeypatch, {})
    assert cpu_has_bf16() is False
    fake_files(monkeypatch, {"/proc/cpuinfo": "processor\t: 0\nbugs\t: avx512_bf16\n"})
    assert cpu_has_bf16() is False


def stat(cpu0, cpu1, cpu2) -> str:
    """A /proc/stat of three cores; each row: user nice system idle iowait irq softirq steal guest
    guest_nice, in clock ticks since boot."""
    rows = [f"cpu{n} " + " ".join(map(str, row)) for n, row in enumerate((cpu0, cpu1, cpu2))]
    total = [sum(col) for col in zip(cpu0, cpu1, cpu2)]
    return "\n".join(["cpu  " + " ".join(map(str, total)), *rows, "intr 5 6 7", "ctxt 99\n"])


START = ([100, 1, 50, 900, 9, 1, 2, 3, 0, 0],) * 3


def later(*busy: float) -> str:
    """/proc/stat 0.2 s after START, where each core was busy for that share of the time, spread
    over user, nice, system, irq, softirq and steal; idle, iowait and guest ticks pile up anyway."""
    ticks = os.sysconf("SC_CLK_TCK") * 0.2
    rows = []
    for row, share in zip(START, busy):
        work = round(share * ticks)
        split = [work // 2, 0, work // 4, 0, 0, 0, 0, work - work // 2 - work // 4]
        extra = [*split[:3], 1000, 1000, *split[5:], 1000, 1000]
        rows.append([a + b for a, b in zip(row, extra)])
    return stat(*rows)


@pytest.fixture
def two_cores(monkeypatch):
    """idle_cores on a machine where this process may use cores 0 and 1 (core 2 is another's)."""
    sleeps = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(runtime.time, "sleep", sleeps.append)
    torch.set_num_threads(2)  # the autouse fixture puts its own back

    def count(*busy: float) -> int:
        fake_files(monkeypatch, {"/proc/stat": [stat(*START), later(*busy)]})
        n = idle_cores()
        assert sleeps.pop() == 0.2 and not sleeps
        return n

    return count


@pytest.mark.parametrize(
    "busy, idle",
    [
        ((0, 0, 1), 2),  # core 2 is busy, but not this process's
        ((1, 0, 0), 1),
        ((0, 1, 1), 1),
        ((0.2, 0.2, 1), 2),  # 0.4 of a core: 1.6 idle rounds to 2
        ((0.3, 0.3, 0), 1),  # 0.6 of a core: 1.4 idle rounds to 1
        ((1, 1, 0), 1),  # at least one
    ],
)
def test_idle_cores_counts_the_cores_others_leave_idle(two_cores, busy, idle):
    assert two_cores(*busy) == idle


def test_idle_cores_never_exceeds_torchs_threads(two_cores):
    torch.set_num_threads(1)
    assert two_cores(0, 0, 0) == 1


def test_idle_cores_without_proc_stat_is_torchs_count(monkeypatch):
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    fake_files(monkeypatch, {})
    torch.set_num_threads(2)
    assert idle_cores() == 2


MEASURE_A_STEP = """
import sys, torch
torch.set_num_threads(1)  # the memory of one thread's allocations: the same on a busy machine
from model.gpt import GPT, GPTConfig
from training.runtime import step_memory
config = GPTConfig(**eval(sys.argv[1]))
batch, dtype = int(sys.argv[2]), getattr(torch, sys.argv[3])
x = torch.randint(0, config.vocab_size, (batch, config.block_size))

def status(key):  # kB
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))



def step(model, x):  # AdamW makes its moments while the gradients are there
    with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
        model(x, x)[1].backward()
    torch.optim.AdamW(model.parameters(), fused=True).step()


step(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=16)), x[:1, :8] % 16)  # the kernels
with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: VmHWM = VmRSS
    f.write("5")
before = status("VmRSS:")
step(GPT(config), x)
peak = (status("VmHWM:") - before) * 1024
print(peak, step_memory(config, batch, dtype))
"""


@pytest.mark.parametrize(
    "shape, batch, dtype",
    [
        (dict(n_layer=1, n_head=1, n_embd=64), 8, "float32"),  # GPT-2's vocabulary, 8 x 1024
        (dict(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=50304), 16, "bfloat16"),
    ],
)
def test_a_step_holds_at_most_twice_its_logits_and_step_memory_is_within_a_quarter(
    tmp_path, shape, batch, dtype
):
    """Measured in a process of its own: the memory a step adds (its peak resident set), against the
    estimate check_fits refuses a run by; the loss never holds the whole logits."""
    proc = script(
        "-c", MEASURE_A_STEP, repr(shape), batch, dtype, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak, estimate = map(int, proc.stdout.split())
    if "vocab_size" not in shape:  # GPT-2's: the logits outweigh the model
        assert peak <= 2 * batch * 1024 * 50257 * 4
    assert 0.75 * peak <= estimate <= 1.25 * peak, (peak, estimate)


CONFIG = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=16)


def test_check_fits_on_a_cpu_reads_memavailable(monkeypatch):
    rt = Runtime("cpu", torch.float32)
    meminfo = "MemTotal:  {} kB\nMemFree:  1 kB\nMemAvailable:  {} kB\n"
    kb = -(-step_memory(CONFIG, 4, rt.dtype) // 1024)  # the fewest kB that hold it
    fake_files(monkeypatch, {"/proc/meminfo": meminfo.format(kb, kb)})
    check_fits(CONFIG, 4, rt)
    fake_files(monkeypatch, {"/proc/meminfo": meminfo.format(10**9, kb - 1)})
    with pytest.raises(UserError, match=r"needs at least 0\.0 GiB, and 0\.0 GiB of cpu memory"):
        check_fits(CONFIG, 4, rt)
    fake_files(monkeypatch, {})  # no /proc/meminfo: nothing to check against
    check_fits(CONFIG, 10**6, rt)
    fake_files(monkeypatch, {"/proc/meminfo": "MemTotal:  5 kB\n"})  # no MemAvailable line
    check_fits(CONFIG, 10**6, rt)


def test_check_fits_names_the_gibibytes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (3 * 2**30, 0))
    huge = replace(CONFIG, vocab_size=2**20, n_embd=2**10, n_head=2)  # 16 GiB of embedding alone
    with pytest.raises(UserError, match=r"needs at least 16\.\d GiB, and 3\.0 GiB of cuda:0"):
        check_fits(huge, 1, Runtime("cuda:0", torch.float32))


def test_the_first_line_names_the_device_dtype_threads_and_compile(tmp_path, data_root, capsys):
    train.train(tiny(tmp_path, data_root, max_iters=1, threads=1, dtype="float32"))
    assert capsys.readouterr().out.splitlines()[0] == "cpu, 1 thread, float32, compile off"


def test_the_first_line_names_the_dtype_auto_picked(tmp_path, data_root, capsys, monkeypatch):
    monkeypatch.setattr(configs, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(runtime, "idle_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    result = train.train(tiny(tmp_path, data_root, max_iters=1))
    assert capsys.readouterr().out.splitlines()[0] == "cpu, 2 threads, bfloat16, compile off"
    assert result["step"] == 1


def test_the_first_line_names_deterministic_and_a_compile_that_cannot_be(
    tmp_path, data_root, capsys, monkeypatch
):
    monkeypatch.setenv("CXX", "no-such-compiler")
    train.train(
        tiny(
            tmp_path,
            data_root,
            max_iters=1,
            threads=1,
            dtype="float32",
            compile=True,
            deterministic=True,
        )
    )
    assert capsys.readouterr().out.splitlines()[0] == (
        "cpu, 1 thread, float32, compile off (this machine cannot compile: docs/devices.md), "
        "deterministic"
    )


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA A10G", 70e12),
        ("Tesla T4", 65e12),
        ("NVIDIA GeForce GTX 1080", 0.0),  # not in the table: no MFU
    ],
)
def test_peak_flops_reads_the_gpus_name(monkeypatch, name, flops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
    assert peak_flops("cuda:0") == flops and peak_flops("cpu") == 0.0


def test_metrics_carry_mfu_where_the_peak_is_known(tmp_path, data_root, monkeypatch):
    monkeypatch.setattr(train, "peak_flops", lambda device: 1e9)
    train.train(tiny(tmp_path, data_root, max_iters=2))
    model = GPT(GPTConfig(**load_checkpoint(tmp_path / "run")["model_config"]))
    token_flops = 6 * model.num_params() + 12 * 2 * 16 * 32  # as nanoGPT counts them
    lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in lines if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * token_flops / 1e9, rel=1e-3, abs=1e-4)
