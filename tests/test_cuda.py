"""CUDA-only checks: bf16 attention and decoding on a GPU agree with float32 references."""

import dataclasses

import pytest
import torch

from model.gpt import GPT, GPTConfig, generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny(**fields) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, block_size=128, n_layer=2, n_head=4, n_embd=64, **fields)
    return GPT(config).cuda().eval()


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_bf16_sdpa_on_the_gpu_matches_float32_explicit_attention(pos_emb):
    model = tiny(pos_emb=pos_emb)
    reference = GPT(dataclasses.replace(model.config, attention="explicit")).cuda().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randint(0, 97, (4, 128), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fast, _ = model(x)
    with torch.no_grad():
        exact, _ = reference(x)
    assert (fast.float() - exact).abs().max() < 0.05


def test_cached_decoding_on_the_gpu_draws_the_tokens_of_a_fresh_forward():
    model = tiny()
    prompt = torch.randint(0, 97, (2, 5), device="cuda")
    tokens = torch.stack(list(generate(model, prompt, 20, temperature=0)), dim=1)
    context = prompt
    with torch.no_grad():
        for _ in range(20):
            logits, _ = model(context)
            context = torch.cat([context, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, context[:, 5:])


def test_a_compiled_training_step_matches_the_eager_one():
    model = tiny()
    compiled = torch.compile(model)
    x = torch.randint(0, 97, (4, 128), device="cuda")
    _, eager = model(x, x)
    _, fast = compiled(x, x)
    assert abs(eager.item() - fast.item()) < 1e-4
