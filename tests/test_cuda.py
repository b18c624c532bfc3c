"""On a CUDA GPU (`pytest -m cuda`; deselected elsewhere): bf16 attention and decoding against
float32 references, and train.py and sample.py as a GPU user runs them: bf16 and float16, compiled,
deterministic and resumed, under torchrun (NCCL), and a step's memory against check_fits."""

import dataclasses
import math
import signal

import pytest
import torch
from conftest import script, tiny, tiny_args
from test_train import signal_at

import train
from configs import parse_args
from data.loader import Batches
from model.checkpoint import load_checkpoint
from model.gpt import GPT, GPTConfig, generate
from training.runtime import step_memory

pytestmark = pytest.mark.cuda


def tiny_model(**fields) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, block_size=128, n_layer=2, n_head=4, n_embd=64, **fields)
    return GPT(config).cuda().eval()


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_bf16_sdpa_on_the_gpu_matches_float32_explicit_attention(pos_emb):
    model = tiny_model(pos_emb=pos_emb)
    reference = GPT(dataclasses.replace(model.config, attention="explicit")).cuda().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randint(0, 97, (4, 128), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fast, _ = model(x)
    with torch.no_grad():
        exact, _ = reference(x)
    assert (fast.float() - exact).abs().max() < 0.05


def test_cached_decoding_on_the_gpu_draws_the_tokens_of_a_fresh_forward():
    model = tiny_model()
    prompt = torch.randint(0, 97, (2, 5), device="cuda")
    tokens = torch.stack(list(generate(model, prompt, 20, temperature=0)), dim=1)
    context = prompt
    with torch.no_grad():
        for _ in range(20):
            logits, _ = model(context)
            context = torch.cat([context, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, context[:, 5:])


@pytest.mark.parametrize(
    "dtype, compile", [("bfloat16", False), ("bfloat16", True), ("float16", False)]
)
def test_tiny_trains_on_the_gpu(tmp_path, data_root, capsys, dtype, compile):
    cfg = tiny(tmp_path, data_root, device="cuda", dtype=dtype, compile=compile)
    result = train.train(cfg)
    assert capsys.readouterr().out.startswith("cuda:0, ")
    assert result["step"] == 20 and result["val_loss"] < math.log(65)  # below a uniform guess
    scaler = load_checkpoint(tmp_path / "run")["scaler"]
    assert bool(scaler) is (dtype == "float16")  # float16 trains with a loss scaler


def test_deterministic_runs_repeat_and_resume_bit_for_bit(tmp_path, data_root, monkeypatch):
    """Two --deterministic runs, and one stopped at step 10 and resumed: the same weights."""
    runs = {}
    for name in "a", "b", "resumed":
        hook = signal_at(signal.SIGUSR1, 10) if name == "resumed" else Batches
        monkeypatch.setattr(train, "Batches", hook)
        result = train.train(tiny(tmp_path / name, data_root, device="cuda", deterministic=True))
        runs[name] = load_checkpoint(tmp_path / name / "run")["model"]
    assert result["stop_signal"] == signal.SIGUSR1 and result["step"] < 20
    monkeypatch.setattr(train, "Batches", Batches)
    train.train(parse_args(tiny_args(tmp_path / "resumed", data_root, "--resume")))
    runs["resumed"] = load_checkpoint(tmp_path / "resumed" / "run")["model"]
    for name in "b", "resumed":
        diff = max((runs["a"][k] - runs[name][k]).abs().max().item() for k in runs["a"])
        assert diff == 0.0, name


def test_torchrun_trains_on_nccl_and_sample_decodes_eager_and_compiled(tmp_path, data_root):
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    trained = script(*cmd, *tiny_args(tmp_path, data_root, "--device", "cuda"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert trained.stdout.startswith("cuda:0, ")
    flags = ["--out-dir", tmp_path / "run", "--device", "cuda", "--dtype", "float32"]
    flags += ["--temperature", "0", "--max-new-tokens", "50", "--prompt", "KING:"]
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
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() - before
    estimate = step_memory(config, 8, torch.bfloat16)
    assert 0.75 * peak <= estimate <= 1.25 * peak, (peak, estimate)
