"""Parity with Hugging Face transformers' GPT-2 on random weights, both directions."""

import json

import pytest
import torch

from errors import UserError
from model import GPT, GPTConfig
from model.hf import load_hf_gpt2, save_hf_gpt2

transformers = pytest.importorskip("transformers")


def hf_tiny(tie: bool = True):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=37, n_positions=24, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF zero-inits biases and ones norms; randomise all so every weight is tested
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_ours_loads_a_transformers_checkpoint_and_matches_its_logits(tmp_path, tie):
    hf = hf_tiny(tie)
    hf.save_pretrained(tmp_path)
    ours = load_hf_gpt2(tmp_path).eval()
    x = torch.randint(0, 37, (2, 24))
    torch.testing.assert_close(ours(x)[0], hf(x).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_transformers_loads_our_export_and_matches_our_logits(tmp_path, tie):
    torch.manual_seed(1)
    ours = GPT(GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=2, n_embd=16, tie_weights=tie)).eval()
    save_hf_gpt2(ours, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 37, (2, 24))
    torch.testing.assert_close(hf(x).logits, ours(x)[0], atol=1e-4, rtol=0)
    again = load_hf_gpt2(tmp_path)  # and back: the round trip is exact
    for (k, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_modern_variant_refuses_to_export(tmp_path):
    ours = GPT(GPTConfig(vocab_size=37, block_size=24, n_layer=1, n_head=2, n_embd=16, pos_emb="rope"))
    with pytest.raises(UserError, match="GPT-2 architecture"):
        save_hf_gpt2(ours, tmp_path)


def test_not_a_checkpoint_directory_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        load_hf_gpt2(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="only GPT-2"):
        load_hf_gpt2(tmp_path)
