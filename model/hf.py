"""GPT-2 in and out: Hugging Face GPT-2 weights into our GPT, and a run out to transformers.

python -m model.hf export out/small_learned exported/small   # AutoModelForCausalLM, AutoTokenizer
"""

import json
import os
from pathlib import Path

import torch

from configs import ArgumentParser, UserError, replacing, run

from .checkpoint import checkpoint_file, load_checkpoint, model_from
from .gpt import GPT, GPTConfig

# Our parameter names are GPT-2's; only its Conv1D weights are stored (in, out), where Linear's are
# (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_MANIFEST = {
    "tokenizer": "gpt2",
    "vocab_size": 50257,
    "chars": None,
}  # a folder we did not write
FILES = [
    "*.json",
    "*.safetensors",
]  # a hub model's configs, tokenizer and weights, not other formats


def load_gpt2(name: str, dropout: float = 0.0) -> tuple[GPT, dict]:
    """(our GPT, the manifest of its tokenizer) from a Hugging Face GPT-2 folder, or from a hub id:
    from the Hugging Face cache without the network, else downloaded into it."""
    path = Path(name)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(name, allow_patterns=FILES, local_files_only=True))
        except Exception:  # not in the cache: ask the hub
            try:
                path = Path(snapshot_download(name, allow_patterns=FILES))
            except Exception as e:
                why = str(e).splitlines()[0][:150]
                files = " ".join(f"--include '{pattern}'" for pattern in FILES)
                raise UserError(
                    f"--init-from {name}: no such folder, and the hub did not give it "
                    f"({why}); where there is internet, `hf download {name} {files} "
                    f"--local-dir models/{name}`, then --init-from models/{name}"
                ) from None
    try:
        from safetensors.torch import load_file

        hf = json.loads((path / "config.json").read_text())
        state = {}
        for file in sorted(path.glob("*.safetensors")) or [path / "pytorch_model.bin"]:
            if file.suffix == ".safetensors":
                state |= load_file(file)
            else:
                state |= torch.load(file, map_location="cpu", weights_only=True)
        model = GPT(
            GPTConfig(
                hf["vocab_size"],
                hf.get("n_positions", 1024),
                hf["n_layer"],
                hf["n_head"],
                hf["n_embd"],
                dropout,
                tie_weights=hf.get("tie_word_embeddings", True),
                # another activation would load and give other logits: a KeyError names it
                activation={"gelu_new": "gelu", "gelu": "gelu_exact"}[
                    hf.get("activation_function", "gelu_new")
                ],
            )
        )
        # GPT-2's transformer keys come with or without "transformer."; old ones with its masks.
        ours = {}
        for key, tensor in state.items():
            if not key.endswith((".attn.bias", ".attn.masked_bias")):
                name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
                ours[name] = tensor.t() if key.endswith(CONV1D) else tensor
        ours.setdefault("lm_head.weight", ours["transformer.wte.weight"])
        model.load_state_dict(ours)
    except Exception as e:  # a folder's files of any kind: SafetensorError, UnpicklingError...
        # in one line: load_state_dict's first line does not name the keys
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        raise UserError(f"{path} is not a Hugging Face GPT-2 folder ({why})") from None
    if (path / "manifest.json").is_file():  # an export of ours names its tokenizer
        return model, json.loads((path / "manifest.json").read_text())
    return model, GPT2_MANIFEST


def load_weights(name: str, dropout: float = 0.0) -> tuple[GPT, dict]:
    """--init-from NAME: (the model, the manifest of its data) of a run folder or .pt file of ours,
    else of a Hugging Face GPT-2 folder or hub id."""
    path = Path(name)
    if path.suffix == ".pt" or checkpoint_file(path).is_file():
        checkpoint = load_checkpoint(path)
        return model_from(checkpoint, dropout), checkpoint["manifest"]
    if name.startswith(("/", ".", "~")) and not path.exists():  # a path, not a hub id
        raise UserError(f"--init-from {name}: no such file or folder")
    return load_gpt2(name, dropout)


def export(run_dir: str, out: str) -> Path:
    """A run (its best.pt, else ckpt.pt) as a folder that transformers loads, its tokenizer
    included; written beside `out`, then swapped in whole."""
    from safetensors.torch import save
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from data.tokenizer import gpt2_files

    checkpoint = load_checkpoint(run_dir)
    model, manifest = model_from(checkpoint), checkpoint["manifest"]
    c, vocab = model.config, manifest["vocab_size"]
    if c.pos_emb != "learned" or c.activation != "gelu" or not c.bias:
        raise UserError(
            f"{run_dir} lacks GPT-2's learned positions, tanh GELU or biases; train with "
            "--pos-emb learned --activation gelu --bias for a run that exports"
        )
    out = Path(out)
    exported = {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "manifest.json",
    }  # what an export writes: an earlier one is replaced whole
    if out.is_file() or out.is_dir() and set(os.listdir(out)) - exported:
        raise UserError(f"{out} holds something else than an export; export into a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:  # an earlier export is replaced whole, or not at all
        tmp.mkdir()
        # The tied lm_head is left out (transformers ties it again), and so are a padded embedding's
        # extra rows.
        state = {
            k: (
                v.t().contiguous()
                if k.endswith(CONV1D)
                else v[:vocab]
                if "wte" in k or "lm_head" in k
                else v
            )
            for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and c.tie_weights)
        }
        (tmp / "model.safetensors").write_bytes(save(state, metadata={"format": "pt"}))
        eot = 50256 if manifest["tokenizer"] == "gpt2" else None
        config = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab,
            "n_positions": c.block_size,
            "n_embd": c.n_embd,
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "activation_function": "gelu_new",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": c.tie_weights,
            "bos_token_id": eot,
            "eos_token_id": eot,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": c.block_size,
            "clean_up_tokenization_spaces": False,
        }
        if eot is None:  # a token per character, joined back without spaces
            # A character outside the vocabulary is refused, as ours refuses it: "[UNK]" is none.
            chars = manifest["chars"]
            tok = Tokenizer(
                models.WordLevel({ch: i for i, ch in enumerate(chars)}, unk_token="[UNK]")
            )
            tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
            tok.decoder = decoders.Fuse()
        else:  # GPT-2's byte-level BPE, from the files that our tokenizer is built from
            vocab_bpe, encoder_json = map(str, gpt2_files())
            tok = Tokenizer(models.BPE.from_file(encoder_json, vocab_bpe))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            tok.add_special_tokens(["<|endoftext|>"])
            specials = ("bos_token", "eos_token", "unk_token")
            tokenizer_config |= dict.fromkeys(specials, "<|endoftext|>")  # all three: end-of-text
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    return out


def main(argv=None) -> None:
    p = ArgumentParser(
        prog="python -m model.hf",
        description=__doc__,
    )
    p.add_argument("command", choices=["export"])
    p.add_argument("run", help="a run folder (its best.pt, else ckpt.pt) or a .pt file")
    p.add_argument("out", help="the folder to write")
    args = p.parse_args(argv)
    out = export(args.run, args.out)
    print(f"wrote {out}: {', '.join(sorted(f.name for f in out.iterdir()))}")
    print(
        f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}), "
        f"AutoTokenizer.from_pretrained({str(out)!r})"
    )


if __name__ == "__main__":
    run(main)
