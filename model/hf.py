"""GPT-2 weights to and from a Hugging Face checkpoint directory (config.json + model.safetensors).

Works on local directories only: `save_pretrained` output, or a hub snapshot already on disk.
Our parameter names are GPT-2's, so the mapping is one to one; the only difference is that
HF stores its linear layers as Conv1D, (in, out), where nn.Linear keeps (out, in).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from errors import UserError

from .config import GPTConfig
from .gpt import GPT

# HF Conv1D weights are transposed relative to nn.Linear.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GPT2_ARCH = dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True, qk_norm=False)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(path / shard)))
        return state
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{path}: no model.safetensors or pytorch_model.bin; point --init-from at a directory written by save_pretrained")


def load_hf_gpt2(path: str | Path, **overrides) -> GPT:
    """Build a GPT from a local HF GPT-2 directory. overrides (e.g. dropout) go into GPTConfig."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json here; expected a Hugging Face GPT-2 directory (save_pretrained output)")
    hf = json.loads((path / "config.json").read_text())
    if hf.get("model_type", "gpt2") != "gpt2":
        raise UserError(f"{path}: model_type is {hf.get('model_type')!r}; only GPT-2 checkpoints can be loaded")
    config = GPTConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        mlp_ratio=(hf.get("n_inner") or 4 * hf["n_embd"]) // hf["n_embd"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_weights=hf.get("tie_word_embeddings", True),
        **{**_GPT2_ARCH, **overrides},
    )
    model = GPT(config)
    ours = model.state_dict()
    theirs = {}
    for key, tensor in _read_state_dict(path).items():
        key = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # old HF versions saved their causal mask; ours is derived, not stored
        theirs[key] = tensor.t() if key.endswith(_CONV1D) else tensor
    if config.tie_weights:
        theirs.setdefault("lm_head.weight", theirs["transformer.wte.weight"])
    missing, unexpected = set(ours) - set(theirs), set(theirs) - set(ours)
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match GPT-2 (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    for key, tensor in theirs.items():
        if tensor.shape != ours[key].shape:
            raise UserError(f"{path}: {key} has shape {tuple(tensor.shape)}, config.json implies {tuple(ours[key].shape)}")
    model.load_state_dict(theirs)
    return model


def save_hf_gpt2(model: GPT, path: str | Path) -> Path:
    """Write model as a HF GPT-2 directory that `GPT2LMHeadModel.from_pretrained` loads."""
    from safetensors.torch import save_file

    c = model.config
    arch = {k: getattr(c, k) for k in _GPT2_ARCH}
    if arch != _GPT2_ARCH:
        raise UserError(f"only the GPT-2 architecture exports to Hugging Face GPT-2; this model has {arch}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_weights:
            continue  # shared with wte; safetensors refuses aliased tensors and HF re-ties on load
        tensor = tensor.t() if key.endswith(_CONV1D) else tensor
        state[key] = tensor.detach().to("cpu").contiguous()
    hf_config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": None if c.mlp_ratio == 4 else c.mlp_ratio * c.n_embd,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": c.norm_eps,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "initializer_range": 0.02,
        "tie_word_embeddings": c.tie_weights,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    }
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return path
