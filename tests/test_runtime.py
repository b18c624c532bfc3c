"""runtime.choose's decision table on faked machines, and the first line that states it."""

import pytest
import torch

from configs import load_config
from configs.errors import UserError
from training.runtime import Machine, Runtime, attention_kernel, choose

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
