"""Data: token files, prepare (presets, text, folders, --files, --hf, its refusals), the batches.

Each test runs in a temporary folder of its own: the paths it gives are relative to it."""

import os
import struct
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import in_process, one_error_line, rows
from filelock import FileLock
from test_config import elsewhere, write  # noqa: F401  elsewhere: each test in a folder of its own

from configs import UserError
from data.loader import Batches, eval_batches, read_tokens, write_tokens
from data.prepare import CORPUS, dataset_dir, main, prepare, read_manifest
from data.tokenizer import CharTokenizer, GPT2Tokenizer, tokenizer

DOCS = ["First document.\nIt has two lines.", "Second: café, naïve — ünïcödé!", "third"]
TEXT = "".join(f"{doc}\n\n" for doc in DOCS)  # as the char tokenizer's stream holds them
char = partial(prepare, tokenizer="char", root="out", quiet=True)


def refused(message, *args, call=char, **kwargs):
    """call(*args, **kwargs) is a UserError that says message."""
    with pytest.raises(UserError) as e:
        call(*args, **kwargs)
    assert str(e.value) == message


def read(folder):
    """A prepared dataset's manifest, and its train and val ids, which the manifest counts."""
    m = read_manifest(folder)
    train, val = (read_tokens(f"{folder}/{split}.bin").tolist() for split in ("train", "val"))
    assert (m["train_tokens"], m["val_tokens"]) == (len(train), len(val))
    return m, train, val


def decoded(folder):
    m, train, val = read(folder)
    return tokenizer(m, m["vocab_size"]).decode(train + val)


def tree(folder):
    """Every file and folder under folder, by path: a file's bytes, inode and mtime."""
    return {
        str(p): p.is_file() and (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(Path(folder).rglob("*"))
    }


def write_tokens_but_val(path, *rest):
    """write_tokens, but for val.bin: Ctrl-C, once train.bin is written."""
    if path.name == "val.bin":
        raise KeyboardInterrupt
    return write_tokens(path, *rest)


def test_a_token_file_is_a_header_then_uint16_or_uint32_ids_and_a_damaged_one_is_refused():
    for vocab, ids, size in (
        (65, [], 2),  # no ids: the header alone
        (2**16 + 1, [70000, 0, 2**32 - 1, 65536], 4),
        (2**16, [0, 65535, *range(5)], 2),
    ):
        assert write_tokens("t.bin", iter([np.array(ids[:2]), [], ids[2:]]), vocab) == len(ids)
        raw = Path("t.bin").read_bytes()  # version 1, 8 spare bytes
        assert (
            raw
            == struct.pack("<8sIIQ8x", b"GPTTOK", 1, size, len(ids))
            + np.array(ids, f"<u{size}").tobytes()
        )
        tokens = read_tokens("t.bin")
        assert isinstance(tokens, np.memmap) and tokens.tolist() == ids  # of size bytes each
    with pytest.raises(ValueError, match="read-only"):
        tokens[0] = 1
    with pytest.raises(TypeError):  # a write that dies midway leaves no header: refused below
        write_tokens("t.bin", [[7], None], 65)
    assert os.path.getsize("t.bin") == 34
    for damaged in [
        Path("t.bin").read_bytes(),
        b"GPTTOK\0\1" + raw[8:],  # another magic
        raw[:8] + b"\2" + raw[9:],  # another version
        raw[:12] + b"\4" + raw[13:],  # ids of 4 bytes: the size disagrees
        raw[:16] + b"\x63" + raw[17:],  # a count the file does not hold
        raw[:-1],  # cut short in the ids
        raw[:-2],
        raw + b"\0\0",  # ids past the count
        raw[:10],  # cut short in the header
        b"",
    ]:
        refused(
            "t.bin is not a whole token file of this version; prepare the dataset again, "
            "with --force",
            write("t.bin", damaged),
            call=read_tokens,
        )


def test_the_presets_are_the_corpus_split_by_characters_prepared_once_or_with_force(capsys):
    for name, hint in ("mine", ""), ("shakespeare-char", " did you mean shakespeare_char?"):
        refused(
            f"no dataset '{name}' in out;{hint} prepare it (python -m data.prepare {name} "
            "--text FILE (or --files, --hf)), give the --data-root that holds it, or use a "
            "preset: shakespeare_char, shakespeare",
            name,
            "out",
            call=dataset_dir,
        )
    text, cut = CORPUS.read_text(), 1_003_854
    letters = "".join(sorted(set(text)))
    # the ids are those of CharTokenizer(letters) (65) and of GPT-2's: 1,003,854 and 111,540 char
    # ids; 301,966 and 36,059 BPE ids
    for name, tok, chars in (
        ("shakespeare_char", CharTokenizer(letters), letters),
        ("shakespeare", GPT2Tokenizer(), None),
    ):
        m, train, val = read(dataset_dir(name, "out"))  # prepared on first use
        assert [train, val] == [tok.encode(text[:cut]), tok.encode(text[cut:])]
        assert m == {
            "version": 1,
            "tokenizer": tok.name,
            "val_fraction": 0.1,
            "source": {"text": str(CORPUS)},
            "sha256": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
            "name": name,
            "vocab_size": tok.vocab_size,
            "chars": chars,
            "train_tokens": len(train),
            "val_tokens": len(val),
        }
        assert capsys.readouterr().out == (
            f"{name}: {tok.name} tokenizer, {tok.vocab_size:,} tokens in its vocabulary; "
            f"{len(train):,} train and {len(val):,} val tokens in out/{name}\n"
        )
    before = tree(folder := Path("out/shakespeare_char"))
    assert sorted(os.listdir(folder)) == "manifest.json train.bin val.bin".split()
    assert char("shakespeare_char") == folder and tree(folder) == before  # reused
    after = tree(char("shakespeare_char", force=True))  # rebuilt, the same bytes, swapped in
    assert [(v[0], v[1:] != before[k][1:]) for k, v in after.items()] == [
        (v[0], True) for v in before.values()
    ]
    char("shakespeare_char", val_fraction=0.2)
    assert read(folder)[0]["val_tokens"] == 223_079  # another split is another dataset
    assert sorted(os.listdir("out")) == (
        ".shakespeare.lock .shakespeare_char.lock shakespeare shakespeare_char".split()
    )


def test_a_text_file_is_named_by_its_stem_split_by_characters_and_replaced_only_with_force(
    capsys,
):
    text = "ROMEO: O, café naïve!\nJULIET: Ay me.\n" * 20  # 740 characters
    folder = char(text=write("book.v2.txt", text.encode("utf-8-sig")))  # the mark is dropped
    assert folder == dataset_dir("book", "out") == Path("out/book")
    m, train, val = read(folder)
    assert (m["chars"], m["source"], len(train), decoded(folder)) == (
        "".join(sorted(set(text))),
        {"text": "book.v2.txt"},
        666,  # characters, the rest val's
        text,
    )
    char(text="book.v2.txt", quiet=False)
    assert capsys.readouterr().out == "book: up to date in out/book\n"
    before = tree(folder)
    for other in {"text": write("other/book.txt", b"other words\n" * 40)}, {"tokenizer": "gpt2"}:
        refused(
            "out/book holds dataset book of other text or another tokenizer; give --force to "
            "replace it (its runs can then not resume), or another name",
            **{"text": "book.v2.txt"} | other,
        )
        assert tree(folder) == before
    write("book.v2.txt", text.upper())  # an edit, other bytes: prepared again
    assert decoded(char(text="book.v2.txt")) == text.upper()

    before, other = tree(folder), partial(char, text="other/book.txt", force=True)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):  # killed
        mp.setattr("data.prepare.write_tokens", write_tokens_but_val)
        other()
    assert tree(folder) == before and sorted(os.listdir("out")) == [".book.lock", "book"]
    with FileLock("out/.book.lock"):  # as another prepare holds it: a second one waits for it
        second = threading.Thread(target=other)
        second.start()
        second.join(timeout=0.5)
        assert second.is_alive() and tree(folder) == before
    second.join(timeout=60)
    assert not second.is_alive() and decoded(folder) == "other words\n" * 40
    assert sorted(os.listdir("out")) == [".book.lock", "book"]  # nothing half-built is left

    refused(
        "x.txt: too little text for a train and a val split; give more", text=write("x.txt", b"x")
    )
    assert not Path("out/x").exists()
    # a dataset's folder and more, a run's, a file where the dataset's folder would go
    for path in "out/book/notes.txt", "out/run/ckpt.pt", "out/file":
        write(path, b"mine")
    before = tree("out")
    for name in "book", "run", "file":
        for force in False, True:
            refused(
                f"out/{name} is not a dataset's folder; give another name, or another folder",
                name,
                text="book.v2.txt",
                force=force,
            )
    assert tree("out") == before


FORMATS = """folder char
folder gpt2
txt char
jsonl gpt2
json char
csv char
parquet char
jsonl.gz char
hf char"""


@pytest.mark.parametrize("fmt, kind", rows(FORMATS, " "))
def test_documents_are_each_encoded_then_a_separator_into_a_stream_split_by_tokens(
    fmt, kind, network_calls
):
    # DOCS as prepare's source: a folder of .txt files, .txt files, or a file of format fmt or a
    # saved dataset, of their column "body" beside another
    docs, path = pd.DataFrame({"id": range(3), "body": DOCS}), f"docs.{fmt}"
    source = {"files": [path], "text_column": "body"}
    if fmt == "folder":  # a symlinked folder is read as any other; a byte-order mark is dropped
        for name, doc in zip("corpus/a.txt corpus/b.txt elsewhere/c.txt".split(), DOCS):
            write(name, doc.encode("utf-8-sig"))
        os.symlink("../elsewhere", "corpus/sub")
        write("corpus/notes.md", b"not a .txt file")
        source = {"text": "corpus"}
    elif fmt == "txt":
        source = {"files": [write(f"d{i}.txt", doc) for i, doc in enumerate(DOCS)]}
    elif fmt == "hf":  # a saved dataset of splits, of which train is read unless --split says
        from datasets import Dataset, DatasetDict

        DatasetDict(
            train=(one := Dataset.from_pandas(docs)),
            test=Dataset.from_pandas(docs.assign(body=["held out", "", "and more"])),
        ).save_to_disk(path)
        one.save_to_disk("one")  # and one of one split
        source = {"hf": path, "subset": None, "split": "train", "text_column": "body"}
    elif fmt == "parquet":
        docs.to_parquet(path)
    elif fmt == "csv":
        docs.to_csv(path, index=False)
    else:  # one array, or a line each, maybe compressed (by the file's name)
        docs.to_json(path, orient="records", lines=fmt != "json")
    if "text_column" in source:  # a column by its name
        refused(
            f"docs.{fmt} has no column 'text' (id, body); pick one with --text-column",
            **source | {"text_column": "text"},
        )
    again = partial(char, tokenizer=kind, val_fraction=0.25, **source)
    m, train, val = read(folder := again())
    chars = "".join(sorted(set(TEXT))) if kind == "char" else None
    tok = CharTokenizer(chars) if chars else GPT2Tokenizer()
    separator = tok.encode("\n\n") if chars else [50256]
    stream = [i for doc in DOCS for i in tok.encode(doc) + separator]
    assert (folder.name, train + val, len(train), m["tokenizer"], m["vocab_size"], m["chars"]) == (
        {"folder": "corpus", "txt": "d0"}.get(fmt, "docs"),
        stream,
        int(len(stream) * 0.75),
        kind,
        tok.vocab_size,
        chars,
    )
    assert m["source"] == (
        {"folder": "corpus"} if fmt == "folder" else {"text_column": "text"} | source
    )
    if fmt == "hf":
        held = char("held", **source | {"split": "test"})  # an empty text is no document
        assert decoded(held) == "held out\n\nand more\n\n"
        assert read_manifest(held)["source"]["split"] == "test"
        refused(
            "--hf docs.hf has no split 'validation' (train, test); pick one with --split",
            **source | {"split": "validation"},
        )
        refused("--hf one is a dataset of one split: leave --split out", hf="one", split="test")
        assert decoded(char(hf="one", text_column="body")) == TEXT
    before = tree(folder)
    assert again() == folder and tree(folder) == before  # the same bytes: reused
    if fmt == "folder":  # another document: prepared again
        write("corpus/sub/d.txt", b"a fourth")
        assert decoded(again()).endswith("a fourth" + tok.decode(separator))
    assert network_calls == []


# a line | its encoding (utf-16 and utf-32 with a byte-order mark; utf-16-le without, its bytes
# valid UTF-8) | what the refusal says it likely is
NOT_UTF8 = """Café crème | latin-1 | Latin-1 or Windows-1252
Plain text | utf-16 | UTF-16 or UTF-32
Plain text | utf-16-le | UTF-16 or UTF-32
Plain text | utf-32 | UTF-16 or UTF-32"""


@pytest.mark.parametrize("line, encoding, likely", rows(NOT_UTF8))
@pytest.mark.parametrize("where", "file.md file folder --files".split())
def test_a_file_that_is_not_utf8_is_refused_whatever_its_name(line, encoding, likely, where):
    write("docs/a.txt", b"this one is fine\n")
    data = f"{line}\n".encode(encoding) * 10
    bad = write({"file.md": "docs/b.md", "file": "docs/b"}.get(where, "docs/b.txt"), data)
    source = {"folder": {"text": "docs"}, "--files": {"files": [bad]}}.get(where, {"text": bad})
    likely = "UTF-16? Latin-1?" if where == "--files" else f"likely {likely}"
    named = Path(bad).resolve() if where == "folder" else bad  # a folder's files, by their paths
    refused(f"{named} is not UTF-8 ({likely}); save it as UTF-8", **source)


# python -m data.prepare ARGV => its one line, after `error: ` (the first: no ARGV). A preset's
# name is for no other source.
MISTAKES = """ => name a preset (shakespeare_char, shakespeare), or give --text, --files or --hf \
and a name that is not a preset's
shakespeare --text t.txt => name a preset (shakespeare_char, shakespeare), or give --text, \
--files or --hf and a name that is not a preset's
shakespeare_char --files t.txt => name a preset (shakespeare_char, shakespeare), or give \
--text, --files or --hf and a name that is not a preset's
. --text t.txt => '.' cannot name a dataset's folder; give a name such as mycorpus
.. --text t.txt => '..' cannot name a dataset's folder; give a name such as mycorpus
.hidden --text t.txt => '.hidden' cannot name a dataset's folder; give a name such as mycorpus
a/b --text t.txt => 'a/b' cannot name a dataset's folder; give a name such as mycorpus
shakespeare_char --val-fraction 0 => --val-fraction 0.0: give a share between 0 and 1
shakespeare_char --val-fraction 1 => --val-fraction 1.0: give a share between 0 and 1
shakespeare_char --val-fraction -0.1 => --val-fraction -0.1: give a share between 0 and 1
--text t.txt --val-fraction 1.5 => --val-fraction 1.5: give a share between 0 and 1
--text missing.txt => --text missing.txt: no such file or folder; give a text file or a \
folder of them
--files nothing.jsonl => --files nothing.jsonl: not a file
--files docs.jsonl docs.csv --text-column body => --files takes files of one format: .txt, \
.parquet, .jsonl, .json, .csv, maybe compressed
--files docs.xml => --files takes files of one format: .txt, .parquet, .jsonl, .json, .csv, \
maybe compressed
--text t.txt --text-column body => --text-column is for --files and --hf; drop it
--text t.txt --split test => --subset, --split and --streaming are for --hf; drop them
"""


@pytest.mark.parametrize("argv, message", rows(MISTAKES, " => "))
def test_a_mistake_is_one_error_line_before_anything_is_written(argv, message):
    for name in "t.txt docs.jsonl docs.csv docs.xml".split():
        write(name, b"hello world\n" * 50)
    proc = in_process(main, *argv.split(), "--out-root", "out")
    assert one_error_line(proc) == f"error: {message}" and proc.stdout == ""
    assert not Path("out").exists()


# --- the batches ------------------------------------------------------------------------------


def xs(batches):
    """The batches' x, as lists: each y is its x one token on (a token's id is its place), int64."""
    pairs = [*batches]
    assert all(x.dtype == y.dtype == torch.int64 and torch.equal(y, x + 1) for x, y in pairs)
    return [x.tolist() for x, _ in pairs]


def test_a_steps_rows_are_numpys_draw_from_seed_0_step_whatever_the_processes():
    """The draw of earlier versions, pinned: default_rng([seed, 0, step]) over every window.
    Micro-step m of process r takes rows [m, r] of it."""
    write_tokens("t.bin", [range(3000)], 3000)  # a token's id is its place
    for seed, block, batch_size in (0, 8, 1), (7, 16, 64), (1234, 1, 3):
        for step in 5000, 0, 1, 0:  # in any order, and again: as a run resumed in a new process
            start = np.random.default_rng([seed, 0, step]).integers(0, 3000 - block, batch_size)
            assert xs(Batches("t.bin", block, batch_size, 1, 0, 1, seed, "cpu")(step)) == [
                (start[:, None] + np.arange(block)).tolist()
            ]  # one micro-batch
    whole = torch.tensor(xs(Batches("t.bin", 16, 8, 1, 0, 1, 9, "cpu")(3)))
    for accum, world in (4, 1), (2, 2), (1, 4):
        per = 8 // (accum * world)
        for rank in range(world):
            assert (
                xs(Batches("t.bin", 16, per, accum, rank, world, 9, "cpu")(3))
                == whole.view(accum, world, per, 16)[:, rank].tolist()
            )


@pytest.mark.cuda
def test_batches_on_a_gpu_are_the_cpu_ones():
    write_tokens("t.bin", [range(3000)], 3000)  # a token's id is its place
    cpu, gpu = (Batches("t.bin", 16, 4, 2, 0, 1, 3, device)(5) for device in ("cpu", "cuda"))
    assert {t.device.type for pair in gpu for t in pair} == {"cuda"} and xs(gpu) == xs(cpu)


def test_eval_batches_cover_the_windows_at_each_block_once_shared_between_processes():
    write_tokens("val.bin", [range(1000)], 1000)  # a window is named by its first token
    # 62 windows, the last ending at token 992, in batches of 5: the last is short
    windows = torch.arange(62 * 16).view(62, 16).split(5)
    assert xs(eval_batches("val.bin", 16, 5, "cpu")) == [w.tolist() for w in windows]
    starts = lambda *a: [x[:, 0].tolist() for x, _ in eval_batches("val.bin", 16, 5, "cpu", *a)]
    for limit in 0, 1, 3, 7, 13, 99:  # the first `limit` batches; 0: all
        for world in 1, 2, 3, 4, 13, 20:  # process r takes batches r, r + world...
            for r in range(world):
                assert starts(limit, r, world) == starts()[: limit or None][r::world]


def test_a_split_of_one_window_works_on_any_device_and_a_shorter_one_is_a_user_error():
    write_tokens("val.bin", [range(9)], 16)  # a block of 8 and one more
    for device in "meta", "cpu":
        batches = [
            *Batches("val.bin", 8, 3, 1, 0, 1, 0, device)(0),
            *eval_batches("val.bin", 8, 4, device),
        ]
        assert [(*x.shape, x.device.type, y.device.type) for x, y in batches] == [
            (3, 8, device, device),
            (1, 8, device, device),
        ]
    assert xs(batches) == [[[*range(8)]] * 3, [[*range(8)]]]
    for block_size in 9, 10:
        message = (
            f"val.bin holds 9 tokens, not a block of {block_size} and one more; lower "
            "--block-size, or prepare more text"
        )
        refused(message, "val.bin", block_size, 1, 1, 0, 1, 0, "cpu", call=Batches)
        refused(message, "val.bin", block_size, 1, "cpu", call=eval_batches)
