"""On a CUDA GPU (`pytest -m cuda`; deselected elsewhere): bf16 attention and decoding against
float32 references, and train.py and sample.py as a GPU user runs them: bf16 and float16, compiled,
deterministic and resumed, under torchrun (NCCL), and a step's memory against check_fits."""

import math
from signal import SIGUSR1

import pytest
import torch
from conftest import script, tiny, tiny_args
from test_generate import reference_generate, run
from test_train import signal_at

import train
from data.loader import Batches
from model.checkpoint import load_checkpoint
from model.gpt import GPT, GPTConfig
from training.runtime import step_memory

pytestmark = pytest.mark.cuda


def tiny_model(**fields):
    torch.manual_seed(0)
    return GPT(GPTConfig(97, 128, 2, 4, 64, **fields)).cuda().eval()


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_bf16_sdpa_matches_float32_explicit_attention_and_cached_decoding_a_fresh_forward(pos_emb):
    model = tiny_model(pos_emb=pos_emb)
    reference = tiny_model(pos_emb=pos_emb, attention="explicit")  # the same seed: weights
    x = torch.randint(0, 97, (4, 128), device="cuda")
    with torch.no_grad():
        exact, _ = reference(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fast, _ = model(x)
    assert (fast.float() - exact).abs().max() < 0.05
    # greedy, float32: the tokens of nanoGPT's uncached loop
    prompt = x[:2, :5]
    assert torch.equal(run(model, prompt, 24, 0), reference_generate(model, prompt, (0,)))


@pytest.mark.parametrize(
    "dtype, compile", [("bfloat16", False), ("bfloat16", True), ("float16", False)]
)
def test_tiny_trains_on_the_gpu(tmp_path, data_root, capsys, dtype, compile):
    result = train.train(tiny(tmp_path, data_root, device="cuda", dtype=dtype, compile=compile))
    assert capsys.readouterr().out.startswith("cuda:0, ") and result["step"] == 20
    assert result["val_loss"] < math.log(65)  # below a uniform guess
    # float16 trains with a loss scaler
    assert bool(load_checkpoint(tmp_path / "run")["scaler"]) is (dtype == "float16")


def test_deterministic_runs_repeat_and_resume_bit_for_bit(tmp_path, data_root, monkeypatch):
    """Two --deterministic runs, and one stopped at step 10 and resumed: the same weights."""
    for name in "a", "b", "resumed":
        monkeypatch.setattr(
            train, "Batches", signal_at(SIGUSR1, 10) if name == "resumed" else Batches
        )
        result = train.train(tiny(tmp_path / name, data_root, device="cuda", deterministic=True))
    assert result["stop_signal"] == SIGUSR1 and result["step"] < 20
    monkeypatch.setattr(train, "Batches", Batches)
    # on the GPU: tiny_args would type --device cpu, which a resume takes
    train.train(
        tiny(tmp_path / "resumed", data_root, device="cuda", deterministic=True, resume=True)
    )
    a, *others = (load_checkpoint(tmp_path / n / "run")["model"] for n in ("a", "b", "resumed"))
    assert all(torch.equal(a[k], other[k]) for other in others for k in a)


def test_torchrun_trains_on_nccl_and_sample_decodes_eager_and_compiled(tmp_path, data_root):
    torchrun = "-m torch.distributed.run --standalone --nproc_per_node=1 train.py"
    trained = script(*torchrun.split(), *tiny_args(tmp_path, data_root, "--device", "cuda"))
    assert trained.returncode == 0 and trained.stdout.startswith("cuda:0, "), trained.stderr[-3000:]
    more = "--device cuda --dtype float32 --temperature 0 --max-new-tokens 50 --prompt KING:"
    flags = ["--out-dir", tmp_path / "run", *more.split()]
    eager, compiled = script("sample.py", *flags), script("sample.py", *flags, "--compile")
    assert eager.returncode == compiled.returncode == 0, compiled.stderr[-3000:]
    assert eager.stdout == compiled.stdout and len(eager.stdout) > 50


def test_a_gpt2_shaped_steps_peak_is_within_a_quarter_of_step_memory():
    """One layer of GPT-2 small's width and its vocabulary, 8 x 1024 tokens, bf16."""
    config = GPTConfig(n_layer=1, vocab_size=50304)
    x = torch.randint(0, 50304, (8, 1024), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = GPT(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    for _ in range(2):
        with torch.autocast("cuda", torch.bfloat16):
            model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    peak = torch.cuda.max_memory_allocated() - before
    assert 0.75 * peak <= step_memory(config, 8, torch.bfloat16) <= 1.25 * peak, peak
