"""Pretrained weights in and out: our runs, Hugging Face GPT-2 directories and hub ids; run export.

    python -m model.hf export out/tiny exported/tiny     # then AutoModelForCausalLM / AutoTokenizer
"""

from configs.errors import start_script

start_script(__name__)  # first: Ctrl-C during the imports below (torch: seconds) is one line

import glob
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from configs.errors import UserError, entry_point, first_line
from configs.model import GPTConfig
from data.files import atomic_write, swap_dir, write_errors, write_json
from data.manifest import check_manifest, differences, read_manifest

from .checkpoint import (BEST_NAME, CKPT_NAME, find_checkpoint, is_checkpoint, load_checkpoint, load_model,
                         model_from_checkpoint)
from .gpt import GPT

# Our parameter names are GPT-2's. Only HF's Conv1D weights differ: stored (in, out), where nn.Linear keeps (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_ARCH = dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True, qk_norm=False)
_ARCH_FLAGS = {"pos_emb": "--pos-emb learned", "norm": "--norm layernorm", "activation": "--activation gelu",
               "bias": "--bias", "qk_norm": "--no-qk-norm"}
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_HUB_FILES = ["*.json", "*.safetensors"]  # a hub repo's configs, tokenizer and weights, not its TF/Flax/ONNX copies
GPT2_MANIFEST = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256}  # for a HF directory we did not write
# What an export writes. Anything else in an earlier export is the user's, so exporting again refuses.
_EXPORT_FILES = {"config.json", "generation_config.json", "manifest.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "vocab.json", "merges.txt"}


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        shards = ["model.safetensors"]
    elif (index := path / "model.safetensors.index.json").exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{path}: no model.safetensors or pytorch_model.bin; point --init-from at a directory "
                        "written by save_pretrained")
    from safetensors.torch import load_file

    return {key: tensor for shard in shards for key, tensor in load_file(str(path / shard)).items()}


def load_hf_gpt2(path: str | Path, **overrides) -> GPT:
    """Build a GPT from a local HF GPT-2 directory. overrides (e.g. dropout) go into GPTConfig."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json here; expected a Hugging Face GPT-2 directory "
                        "(save_pretrained output)")
    hf = json.loads((path / "config.json").read_text())
    if hf.get("model_type", "gpt2") != "gpt2":
        raise UserError(f"{path}: model_type is {hf.get('model_type')!r}; only GPT-2 checkpoints can be loaded")
    model = GPT(GPTConfig(
        vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
        block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
        mlp_ratio=(hf.get("n_inner") or 4 * hf["n_embd"]) // hf["n_embd"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_weights=hf.get("tie_word_embeddings", True),
        **{**GPT2_ARCH, **overrides},
    ))
    ours = model.state_dict()
    theirs = {}
    for key, tensor in _read_state_dict(path).items():
        key = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if not key.endswith((".attn.bias", ".attn.masked_bias")):  # old HF versions saved their causal mask
            theirs[key] = tensor.t() if key.endswith(_CONV1D) else tensor
    if model.config.tie_weights:
        theirs.setdefault("lm_head.weight", theirs["transformer.wte.weight"])
    missing, unexpected = set(ours) - set(theirs), set(theirs) - set(ours)
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match GPT-2 (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    for key, tensor in theirs.items():
        if tensor.shape != ours[key].shape:
            raise UserError(f"{path}: {key} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {tuple(ours[key].shape)}")
    model.load_state_dict(theirs)
    return model


def _complete(folder: str | Path) -> bool:
    return (Path(folder) / "config.json").is_file() and any((Path(folder) / w).is_file() for w in _WEIGHTS)


def resolve_init_from(name: str) -> Path:
    """--init-from NAME as a local path: a run directory, .pt file or HF GPT-2 directory as given, else hub
    model NAME (gpt2, user/repo) from the Hugging Face cache, else downloaded into that cache."""
    path = Path(name)
    if path.exists():
        if is_checkpoint(path) or (path / "config.json").is_file():
            return path
        raise UserError(f"--init-from {name}: not a run directory (no ckpt.pt) nor a Hugging Face GPT-2 "
                        "directory (no config.json)")
    # A hub id is NAME or ORG/NAME. A path, or one whose first folder is here, was meant as a directory.
    local = len(path.parts) > 1 and Path(path.parts[0]).is_dir()
    if name.startswith((".", "~", "/")) or name.count("/") > 1 or local:
        raise UserError(f"--init-from {name}: no such directory: {name}; check the path, or give a hub model id (gpt2)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:  # the cache first: a cached model needs no network at all
        folder = snapshot_download(name, allow_patterns=_HUB_FILES, local_files_only=True)
        if _complete(folder):
            return Path(folder)
    except HFValidationError:
        raise UserError(f"--init-from {name}: no such file or directory (and not a hub model id)") from None
    except LocalEntryNotFoundError:
        pass
    get = f"`hf download {name} {' '.join(f'--include {p!r}' for p in _HUB_FILES)} --local-dir models/{name}`"
    try:
        folder = snapshot_download(name, allow_patterns=_HUB_FILES)
        if not _complete(folder):  # an older repo with only PyTorch pickles
            folder = snapshot_download(name, allow_patterns=["pytorch_model.bin"])
    except LocalEntryNotFoundError:  # offline, or the hub is unreachable
        raise UserError(f"--init-from {name}: no such directory, and hub model {name!r} is not in the Hugging "
                        f"Face cache and the hub is unreachable; where there is internet run {get} and pass "
                        f"--init-from models/{name}") from None
    except HfHubHTTPError as e:  # not found, private, gated, bad revision
        raise UserError(f"--init-from {name}: no such directory, and the hub answered: {first_line(e)}") from None
    return Path(folder)


def load_pretrained(name: str | Path, **overrides) -> tuple[GPT, dict | None, Path]:
    """(model in training mode, its checkpoint dict or None, where it came from) for --init-from NAME.
    A run directory gives its best.pt; overrides (e.g. dropout) go into GPTConfig."""
    path = resolve_init_from(str(name))
    if not is_checkpoint(path):
        return load_hf_gpt2(path, **overrides), None, path
    path = find_checkpoint(path, best=True)
    ckpt = load_checkpoint(path)
    return model_from_checkpoint(ckpt, path, **overrides), ckpt, path


def pretrained_manifest(path: Path, ckpt: dict[str, Any] | None) -> dict[str, Any]:
    """The data manifest (the tokenizer) of what load_pretrained loaded. A checkpoint's own copy must match
    the manifest.json beside it; a HF directory without one has GPT-2's."""
    if ckpt is None:
        return read_manifest(path / "manifest.json") if (path / "manifest.json").is_file() else GPT2_MANIFEST
    file, saved = path.parent / "manifest.json", ckpt.get("manifest")
    if saved is None:
        if not file.is_file():
            raise UserError(f"{path.parent} has no manifest.json, so the tokenizer is unknown; copy "
                            "data/prepared/<dataset>/manifest.json into the run dir")
        return read_manifest(file, "copy data/prepared/<dataset>/manifest.json there again")
    saved = check_manifest(saved, f"the manifest inside {path}", "the checkpoint is damaged")
    if file.is_file():
        on_disk = read_manifest(file, f"delete it: {path.name} carries its own copy")
        if changes := differences(saved, on_disk):
            raise UserError(f"{file} is not the data {path.name} was trained on ({', '.join(changes)}): the run "
                            f"dir mixes two runs; delete that manifest.json to sample {path.name} with its own copy")
    return saved


def save_hf_gpt2(model: GPT, path: str | Path, eot_id: int | None = None, vocab_size: int | None = None) -> None:
    """Write model as a HF GPT-2 directory that `GPT2LMHeadModel.from_pretrained` loads. eot_id is the
    tokenizer's end-of-text, if any; vocab_size (the tokenizer's) drops the rows of a padded embedding."""
    from safetensors.torch import save

    c = model.config
    if differ := [k for k, v in GPT2_ARCH.items() if getattr(c, k) != v]:  # learned positions, LayerNorm, GELU, ...
        has = ", ".join(f"{k}={getattr(c, k)}" for k in differ)
        raise UserError(f"Hugging Face GPT-2 cannot express this model ({has}); train with "
                        f"{' '.join(_ARCH_FLAGS[k] for k in differ)} for a run that exports")
    vocab = vocab_size or c.vocab_size
    path = Path(path)
    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_weights:
            continue  # shared with wte; safetensors refuses aliased tensors and HF re-ties on load
        tensor = tensor.t() if key.endswith(_CONV1D) else tensor
        tensor = tensor[:vocab] if key in ("transformer.wte.weight", "lm_head.weight") else tensor
        state[key] = tensor.detach().to("cpu").contiguous()
    write_json(path / "config.json", {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
        "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
        "n_head": c.n_head, "n_inner": None if c.mlp_ratio == 4 else c.mlp_ratio * c.n_embd,
        "activation_function": "gelu_new", "layer_norm_epsilon": c.norm_eps, "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout, "attn_pdrop": c.dropout, "initializer_range": 0.02,
        "tie_word_embeddings": c.tie_weights,
        "bos_token_id": eot_id, "eos_token_id": eot_id,  # explicit nulls: GPT2Config would assume 50256
    })
    # Bytes through atomic_write: safetensors' own save_file leaves the file 0600 whatever the umask.
    atomic_write(path / "model.safetensors", lambda f: f.write(save(state, metadata={"format": "pt"})))
    write_json(path / "generation_config.json", {"bos_token_id": eot_id, "eos_token_id": eot_id})


def export_run(run: str | Path, out: str | Path) -> Path:
    """A run directory (its best.pt, else ckpt.pt) or a .pt file as a HF directory: weights, configs, the
    tokenizer and our manifest.json. out is new, empty or an earlier export of this run, and is replaced whole."""
    from data.tokenizer import save_hf_tokenizer, tokenizer_from_manifest

    ckpt_path, target = find_checkpoint(run, best=True).resolve(), Path(out).resolve()
    out = Path(out)
    source = ckpt_path.parent if ckpt_path.name in (CKPT_NAME, BEST_NAME) else ckpt_path  # a run, or a lone .pt
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; export {run} into an empty or new directory")
    try:  # an earlier export of this run names it in its manifest.json
        mine = (out / json.loads((out / "manifest.json").read_text())["exported_from"]).resolve() == source
    except (OSError, ValueError, KeyError, TypeError):  # no manifest.json, not JSON, not an export
        mine = False
    names = {p.name for p in out.iterdir()} if out.exists() else set()
    if foreign := sorted(names - _EXPORT_FILES if mine else names):
        raise UserError(f"{out} holds files that are not an earlier export of {run} ({', '.join(foreign[:4])}): "
                        f"export {run} into another directory, an empty or new one")
    model, ckpt = load_model(ckpt_path)
    manifest = pretrained_manifest(ckpt_path, ckpt)
    tok = tokenizer_from_manifest(manifest)
    # Built beside the target, then swapped in: a failed or killed export leaves the target as it was.
    for old in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):  # .NAME.PID.tmp
        try:
            os.kill(int(old.name.split(".")[-2]), 0)
        except ProcessLookupError:  # a killed export's
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, OSError):  # not a pid, or another user's running process
            pass
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with write_errors(out):
        try:
            save_hf_tokenizer(tok, tmp, model.config.block_size)
            save_hf_gpt2(model, tmp, eot_id=tok.eot_id, vocab_size=tok.vocab_size)
            write_json(tmp / "manifest.json", {**manifest, "exported_from": os.path.relpath(source, target)})
            swap_dir(tmp, target)  # the earlier export, if any, is now at tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@entry_point
def main(argv: list[str] | None = None) -> None:
    from configs.cli import ArgumentParser

    parser = ArgumentParser(prog="python -m model.hf", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a run as a Hugging Face directory")
    export.add_argument("run", help="a run directory (out/<config>: its best.pt, else ckpt.pt) or a .pt file")
    export.add_argument("out", help="the directory to write")
    args = parser.parse_args(argv)
    out = export_run(args.run, args.out)
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}\n"
          f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}), "
          f"AutoTokenizer.from_pretrained({str(out)!r})")


if __name__ == "__main__":
    sys.exit(main())
