"""runtime.choose's decision table on faked machines, the CPU threads, and the first line that states them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs import load_config
from configs.errors import UserError
from training.runtime import CpuThreads, Machine, Runtime, attention_kernel, choose, cpu_times, probe

ROOT = Path(__file__).resolve().parent.parent

A100 = Machine(gpu="NVIDIA A100-SXM4-80GB", capability=(8, 0), gpu_bf16=True, triton=True)
T4 = Machine(gpu="Tesla T4", capability=(7, 5), triton=True)  # bf16 only emulated
P100 = Machine(gpu="Tesla P100-PCIE-16GB", capability=(6, 0), triton=True)
MAC = Machine(mps=True)
ZEN4 = Machine(cpu_bf16=True)
OLD_CPU = Machine()


def line(machine: Machine, **options) -> str:
    p = choose(machine, compile=True, **options)
    return Runtime(p, torch.amp.GradScaler("cpu", enabled=False)).describe()


@pytest.mark.parametrize("machine, device, dtype, scaling, fused, compiled", [
    (A100, "cuda:0", torch.bfloat16, False, True, True),
    (T4, "cuda:0", torch.float16, True, True, True),
    (P100, "cuda:0", torch.float32, False, True, False),
    (MAC, "mps", torch.float32, False, False, False),
    (ZEN4, "cpu", torch.bfloat16, False, True, True),
    (OLD_CPU, "cpu", torch.float32, False, True, True),
])
def test_each_kind_of_machine_gets_its_row(machine, device, dtype, scaling, fused, compiled):
    p = choose(machine, compile=True)
    assert (p.device, p.dtype, p.loss_scaling, p.fused_adamw, p.compile) == (device, dtype, scaling, fused, compiled)
    assert choose(machine).compile is False and choose(machine).compile_off == ""  # not asked: nothing to explain


def test_the_first_line_states_the_decisions_and_why_compile_is_off():
    assert line(T4) == "cuda:0 Tesla T4 (capability 7.5), float16 + loss scaling, fused AdamW, compile on"
    assert line(P100) == ("cuda:0 Tesla P100-PCIE-16GB (capability 6.0), float32, fused AdamW, "
                          "compile off: capability 6.0 < 7.0, the oldest Triton compiles for")
    assert line(MAC) == "mps, float32, AdamW (not fused), compile off: torch.compile's Metal backend is a prototype"
    no_triton = Machine(gpu="NVIDIA GeForce RTX 4090", capability=(8, 9), gpu_bf16=True)  # e.g. Windows
    assert line(no_triton).endswith("bfloat16, fused AdamW, compile off: Triton is not installed "
                                    "(pip install triton; triton-windows on Windows)")
    assert line(ZEN4, device="cpu") == "cpu with bf16 instructions, bfloat16, fused AdamW, compile on"


def test_options_override_the_table_within_what_the_machine_can_do():
    assert choose(A100, device="cpu").device == "cpu" and choose(A100, device="cpu").dtype == torch.float32
    assert choose(A100, dtype="float16").loss_scaling and choose(T4, dtype="float32").dtype == torch.float32
    assert choose(ZEN4, training=False).dtype == torch.float32  # one-token decode steps are faster in fp32
    assert choose(T4, local_rank=3).device == "cuda:3"
    for machine, options, needle in [(T4, {"dtype": "bfloat16"}, "no native bfloat16"),
                                     (OLD_CPU, {"device": "cuda"}, "no CUDA GPU"),
                                     (OLD_CPU, {"device": "mps"}, "MPS is not available"),
                                     (OLD_CPU, {"dtype": "half"}, "unknown dtype")]:
        with pytest.raises(UserError, match=needle):
            choose(machine, **options)


def test_attention_kernel_is_the_one_torch_picks():
    rt = Runtime(choose(OLD_CPU), torch.amp.GradScaler("cpu", enabled=False))
    cfg = load_config("tiny")
    # torch's CPU flash kernel has no dropout; with dropout it runs the math kernel
    assert attention_kernel(cfg, rt) == "SDPA flash"
    assert attention_kernel(load_config("tiny", ["--dropout", "0.1"]), rt) == "SDPA math"
    assert attention_kernel(load_config("tiny", ["--attention", "explicit"]), rt) == "explicit attention"


@pytest.mark.parametrize("forced, device, dtype", [("0", "cpu", "float32"), ("1", "cpu with bf16 instructions", "bfloat16")])
def test_each_cpu_row_trains_end_to_end_whatever_this_cpu_has(tmp_path, data_root, forced, device, dtype):
    """GPT_CPU_BF16 stands in for the probe's answer, so both CPU rows run here (and .ci/run runs the
    whole suite again as the other kind of CPU)."""
    cmd = [sys.executable, "train.py", "--config", "tiny", "--max-iters", "2", "--eval-interval", "2",
           "--sample-tokens", "0", "--device", "cpu", "--data-root", str(data_root), "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "GPT_CPU_BF16": forced}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0].split(", ")
    assert (first[0], first[2], first[3]) == (device, dtype, "fused AdamW") and "thread" in first[1]
    assert (tmp_path / "ckpt.pt").is_file() and '"threads": ' in (tmp_path / "metrics.jsonl").read_text()


def test_the_probe_answer_can_be_forced_and_a_bad_value_is_one_line(monkeypatch):
    for forced, has in (("0", False), ("1", True)):
        monkeypatch.setenv("GPT_CPU_BF16", forced)
        assert probe().cpu_bf16 is has
    monkeypatch.setenv("GPT_CPU_BF16", "yes")
    with pytest.raises(UserError, match="GPT_CPU_BF16='yes': use 0"):
        probe()


class Machine2Cores:
    """CpuThreads' clock and cpu_times for a 2-core machine where `others` cores' worth of CPU goes to
    other processes and the rest to this one: a second passes between looks."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = self.others = 0.0

    def clock(self) -> float:
        self.now += 1.0
        self.busy += min(2.0, self.others + torch.get_num_threads())
        self.own += min(torch.get_num_threads(), 2.0 - self.others)
        return self.now

    def read(self, cpus):
        assert cpus == {0, 1}
        return self.busy, self.own


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)  # torch's default here; the autouse fixture puts its own back
    return Machine2Cores()


def test_threads_start_at_one_and_follow_the_cores_others_leave_idle(two_cores):
    threads = CpuThreads(read=two_cores.read, clock=two_cores.clock)
    assert torch.get_num_threads() == 1 and threads.describe() == "1-2 threads as cores are idle"
    seen = []
    for others in (0, 0, 1, 1, 0.4, 0.6, 2, 0):  # an idle machine, a busy process, a light and a heavy load
        two_cores.others = others
        threads.update()
        seen.append(torch.get_num_threads())
    assert seen == [2, 2, 1, 1, 2, 1, 1, 2]


def test_a_look_waits_for_enough_clock_ticks(two_cores):
    threads = CpuThreads(read=lambda cpus: (0.0, 0.0), clock=lambda: two_cores.now)
    two_cores.now = CpuThreads.LOOK_S / 2
    threads.update()
    assert torch.get_num_threads() == 1  # too soon to tell
    two_cores.now = CpuThreads.LOOK_S
    threads.update()
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("requested, env, deterministic, line", [
    (1, {}, False, "1 thread"), (0, {"OMP_NUM_THREADS": "2"}, False, "2 threads"), (0, {}, True, "2 threads")])
def test_a_count_asked_for_or_a_deterministic_run_stays_fixed(two_cores, monkeypatch, requested, env, deterministic,
                                                             line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if requested:
        torch.set_num_threads(requested)  # what setup() does with --threads first
    threads = CpuThreads(requested, fixed=deterministic, read=two_cores.read, clock=two_cores.clock)
    two_cores.others = 2
    threads.update()
    assert threads.describe() == line and torch.get_num_threads() == int(line[0])


def test_without_proc_stat_the_count_is_torchs_default(two_cores):
    def no_proc(cpus):
        raise FileNotFoundError("/proc/stat")

    assert CpuThreads(read=no_proc, clock=two_cores.clock).describe() == "2 threads" and torch.get_num_threads() == 2


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux: /proc/stat")
def test_cpu_times_reads_this_machines_counters():
    cpus = os.sched_getaffinity(0)
    (busy0, own0), _ = cpu_times(cpus), sum(i * i for i in range(300_000))
    busy1, own1 = cpu_times(cpus)
    assert busy1 >= busy0 > 0 and own1 > own0


def test_the_first_line_names_the_threads():
    rt = Runtime(choose(OLD_CPU), torch.amp.GradScaler("cpu", enabled=False))
    rt.threads = CpuThreads()
    assert rt.describe() == "cpu, 1 thread, float32, fused AdamW, compile off"  # the autouse fixture's one thread
