"""manifest.json, what a prepared dataset is: read, checked and compared where a model meets data.

Its fields are name, tokenizer ("char" or "gpt2"), vocab_size, chars (char only: the vocabulary as one string,
a token id being an index into it), eot_id (50256 for gpt2, null for char), train_tokens, val_tokens, dtype,
source (what was read), sha256 (of the local files' bytes, or of a hub dataset's documents as read), version
(of the token-file format), val_fraction, split_by and doc_separator. A token id means something only under
its own vocabulary, so --resume, --init-from and sampling refuse every mismatch.
"""

import json
from pathlib import Path
from typing import Any

from configs.errors import UserError, first_line

from .tokenfile import read_header

VOCABULARY = ("tokenizer", "vocab_size", "chars", "eot_id")  # what each token id means
REPREPARE = "re-run the `python -m data.prepare` command that made it"


def check_manifest(manifest: Any, where: str, fix: str = REPREPARE) -> dict[str, Any]:
    """The manifest itself if it names a tokenizer and its vocabulary; else a UserError."""
    if not isinstance(manifest, dict):
        problem = f"a JSON {type(manifest).__name__}, not an object"
    else:
        wants = {"tokenizer": str, "vocab_size": int} | ({"chars": str} if manifest.get("tokenizer") == "char" else {})
        bad = [k for k, kind in wants.items() if not isinstance(manifest.get(k), kind)]
        problem = f"no valid {', '.join(bad)}" if bad else None
    if problem:
        raise UserError(f"{where} is not a data manifest ({problem}); {fix}")
    return manifest


def read_manifest(path: str | Path, fix: str = REPREPARE) -> dict[str, Any]:
    """A manifest.json, checked. A missing, truncated, binary or wrong-shaped file is one UserError."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # a ValueError is bad JSON, or bytes that are not UTF-8
        reason = e.strerror if isinstance(e, OSError) else first_line(e, 120)
        raise UserError(f"cannot read {path} ({reason}); {fix}") from None
    return check_manifest(manifest, str(path), fix)


def read_dataset_manifest(ds_dir: str | Path) -> dict[str, Any]:
    """A prepared dataset's manifest, checked against the headers of its token files."""
    ds_dir = Path(ds_dir)
    manifest = read_manifest(ds_dir / "manifest.json")
    for split in ("train", "val"):
        dtype, count = read_header(ds_dir / f"{split}.bin")
        if (count, dtype.name) != (manifest.get(f"{split}_tokens"), manifest.get("dtype")):
            raise UserError(f"{ds_dir / f'{split}.bin'} ({count:,} {dtype.name} tokens) does not match its "
                            f"manifest.json ({manifest.get(f'{split}_tokens')} {manifest.get('dtype')}): the files "
                            f"come from different preparations; {REPREPARE}")
    return manifest


def differences(old: dict[str, Any], new: dict[str, Any],
                keys: tuple[str, ...] = (*VOCABULARY, "train_tokens", "val_tokens")) -> list[str]:
    """How new differs from old in keys, e.g. ["vocab_size 65 -> 58", "chars -'XZ' +'\\t'"]."""
    changes = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if a != b and key == "chars" and isinstance(a, str) and isinstance(b, str):
            gone, added = "".join(sorted(set(a) - set(b))), "".join(sorted(set(b) - set(a)))
            changes.append("chars" + (f" -{gone!r}" if gone else "") + (f" +{added!r}" if added else ""))
        elif a != b:
            changes.append(f"{key} {a!r} -> {b!r}")
    return changes
