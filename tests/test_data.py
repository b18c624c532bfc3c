"""Data: token files, prepare (presets, text, folders, --files, --hf, its refusals), the batches."""

import csv
import gzip
import json
import os
import re
import struct
import threading

import numpy as np
import pytest
import torch
from conftest import ROOT, one_error_line, script
from filelock import FileLock

import data.loader as loader
from configs import UserError
from data.loader import Batches, eval_batches, read_tokens, windows, write_tokens
from data.prepare import dataset_dir, prepare
from data.tokenizer import CharTokenizer, GPT2Tokenizer, tokenizer

CORPUS = ROOT / "data" / "corpora" / "tinyshakespeare" / "input.txt"
DOCS = ["First document.\nIt has two lines.", "Second: café, naïve — ünïcödé!", "third"]
FIX = "prepare the dataset again, with --force"


def split_ids(folder, split: str) -> list[int]:
    return read_tokens(folder / f"{split}.bin").tolist()


def manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def decoded(folder) -> str:
    """A prepared dataset's text: its train tokens, then its val tokens, decoded."""
    return tokenizer(m := manifest(folder), m["vocab_size"]).decode(
        split_ids(folder, "train") + split_ids(folder, "val")
    )


def tree(folder) -> dict:
    """Every file under folder, by relative path: its bytes, inode and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# --- token files ------------------------------------------------------------------------------


def test_token_file_is_a_32_byte_header_then_uint16_ids_written_in_chunks(tmp_path):
    path = tmp_path / "t.bin"
    chunks = [np.array([0, 65535]), [], np.arange(5), (7, 8)]
    assert write_tokens(path, iter(chunks), vocab_size=2**16) == 9
    raw = path.read_bytes()
    header = b"GPTTOK\0\0" + struct.pack("<IIQ", 1, 2, 9) + bytes(8)
    assert raw == header + np.array([0, 65535, 0, 1, 2, 3, 4, 7, 8], "<u2").tobytes()
    tokens = read_tokens(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert tokens.tolist() == [0, 65535, 0, 1, 2, 3, 4, 7, 8]


def test_a_vocabulary_past_65536_ids_is_written_as_uint32(tmp_path):
    path = tmp_path / "t.bin"
    ids = [70000, 0, 2**32 - 1, 65536]
    assert write_tokens(path, (np.array([i]) for i in ids), vocab_size=2**16 + 1) == 4
    assert path.read_bytes()[8:24] == struct.pack("<IIQ", 1, 4, 4)
    assert len(path.read_bytes()) == 32 + 4 * 4
    tokens = read_tokens(path)
    assert tokens.dtype == np.uint32 and tokens.tolist() == ids


def test_a_token_file_is_read_only(tmp_path):
    write_tokens(tmp_path / "t.bin", [np.arange(10)], vocab_size=65)
    tokens = read_tokens(tmp_path / "t.bin")
    assert not tokens.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        tokens[0] = 1


def test_a_write_that_dies_midway_leaves_a_file_that_is_refused(tmp_path):
    def chunks():
        yield np.array([7])
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_tokens(tmp_path / "t.bin", chunks(), vocab_size=65)
    assert (tmp_path / "t.bin").stat().st_size == 32 + 2  # its header still counts no ids
    with pytest.raises(UserError, match="is not a whole token file"):
        read_tokens(tmp_path / "t.bin")


def test_an_empty_token_file_reads_as_no_tokens(tmp_path):
    assert write_tokens(tmp_path / "t.bin", [], vocab_size=65) == 0
    assert (tmp_path / "t.bin").stat().st_size == 32 and read_tokens(tmp_path / "t.bin").size == 0


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b"GPTTOK\0\1" + b[8:],  # another magic
        lambda b: b[:8] + struct.pack("<I", 2) + b[12:],  # another version
        lambda b: b[:12] + struct.pack("<I", 4) + b[16:],  # ids of 4 bytes: the size disagrees
        lambda b: b[:16] + struct.pack("<Q", 99) + b[24:],  # a count the file does not hold
        lambda b: b[:-1],  # cut short in the ids
        lambda b: b[:-20],
        lambda b: b + b"\0\0",  # ids past the count
        lambda b: b[:10],  # cut short in the header
        lambda b: b"",
    ],
    ids=["magic", "version", "itemsize", "count", "-1", "-20", "+2", "header", "empty"],
)
def test_a_damaged_token_file_is_a_user_error(tmp_path, damage):
    path = tmp_path / "val.bin"
    write_tokens(path, [np.arange(100)], vocab_size=100)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError) as e:
        read_tokens(path)
    assert str(e.value) == f"{path} is not a whole token file of this version; {FIX}"


# --- prepare: the presets and one text --------------------------------------------------------


def test_shakespeare_char_is_prepared_once_and_again_with_force(tmp_path):
    folder = prepare("shakespeare_char", root=str(tmp_path), quiet=True)
    assert folder == tmp_path / "shakespeare_char"
    m = manifest(folder)
    assert (m["train_tokens"], m["val_tokens"], m["vocab_size"]) == (1_003_854, 111_540, 65)
    assert (m["tokenizer"], m["name"], m["val_fraction"], m["version"]) == (
        "char",
        "shakespeare_char",
        0.1,
        1,
    )
    text = CORPUS.read_text()
    assert m["chars"] == "".join(sorted(set(text)))
    assert m["sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    tok = CharTokenizer(m["chars"])
    assert np.array_equal(read_tokens(folder / "train.bin"), tok.encode_array(text[:1_003_854]))
    assert np.array_equal(read_tokens(folder / "val.bin"), tok.encode_array(text[1_003_854:]))
    assert sorted(os.listdir(folder)) == ["manifest.json", "train.bin", "val.bin"]

    before = tree(folder)
    assert prepare("shakespeare_char", root=str(tmp_path), quiet=True) == folder
    assert tree(folder) == before  # reused: the same files, not written again
    prepare("shakespeare_char", root=str(tmp_path), quiet=True, force=True)
    after = tree(folder)
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}
    assert all(after[k][1:] != before[k][1:] for k in before)  # rebuilt, and swapped in
    prepare("shakespeare_char", root=str(tmp_path), quiet=True, val_fraction=0.2)
    assert manifest(folder)["val_tokens"] == 223_079  # another split is another dataset
    assert sorted(os.listdir(tmp_path)) == [".shakespeare_char.lock", "shakespeare_char"]


def test_shakespeare_is_the_corpus_in_gpt2_tokens_split_by_characters(tmp_path, capsys):
    folder = prepare("shakespeare", root=str(tmp_path))
    m = manifest(folder)
    assert (m["train_tokens"], m["val_tokens"], m["vocab_size"]) == (301_966, 36_059, 50257)
    assert (m["tokenizer"], m["chars"]) == ("gpt2", None)
    text, tok = CORPUS.read_text(), GPT2Tokenizer()
    assert split_ids(folder, "train") == tok.encode(text[:1_003_854])
    assert split_ids(folder, "val") == tok.encode(text[1_003_854:])
    assert capsys.readouterr().out == (
        "shakespeare: gpt2 tokenizer, 50,257 tokens in its vocabulary; "
        f"301,966 train and 36,059 val tokens in {folder}\n"
    )


def test_a_text_file_is_named_by_its_stem_and_split_by_characters(tmp_path):
    text = "ROMEO: O, café naïve!\nJULIET: Ay me.\n" * 20  # 740 characters
    (tmp_path / "book.v2.txt").write_text(text)
    folder = prepare(
        text=str(tmp_path / "book.v2.txt"), tokenizer="char", root=str(tmp_path), quiet=True
    )
    assert folder == tmp_path / "book"
    m = manifest(folder)
    assert m["chars"] == "".join(sorted(set(text))) and m["source"] == {
        "text": str(tmp_path / "book.v2.txt")
    }
    assert (m["train_tokens"], m["val_tokens"]) == (666, 74)
    assert decoded(folder) == text
    assert CharTokenizer(m["chars"]).decode(split_ids(folder, "val")) == text[666:]

    (tmp_path / "book.v2.txt").write_text(text.upper())  # an edit, other bytes: prepared again
    prepare(text=str(tmp_path / "book.v2.txt"), tokenizer="char", root=str(tmp_path), quiet=True)
    assert decoded(folder) == text.upper()


def test_a_utf8_byte_order_mark_is_dropped(tmp_path):
    text = "Ünïcode text,\nwith a mark before it.\n" * 5
    (tmp_path / "marked.txt").write_bytes(text.encode("utf-8-sig"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_bytes(text.encode("utf-8-sig"))
    for source in "marked.txt", "docs":
        folder = prepare(text=str(tmp_path / source), tokenizer="char", root=str(tmp_path / "out"))
        assert "\ufeff" not in manifest(folder)["chars"]
        assert decoded(folder) == text + ("\n\n" if source == "docs" else "")


@pytest.mark.parametrize(
    "data, likely",
    [
        ("Café crème\n".encode("latin-1"), "Latin-1 or Windows-1252"),
        ("Plain text\n".encode("utf-16"), "UTF-16 or UTF-32"),  # with a byte-order mark
        ("Plain text\n".encode("utf-16-le"), "UTF-16 or UTF-32"),  # without: valid UTF-8 bytes
        ("Plain text\n".encode("utf-32"), "UTF-16 or UTF-32"),
    ],
    ids=["latin-1", "utf-16", "utf-16-le", "utf-32"],
)
@pytest.mark.parametrize("where", ["file.md", "file", "folder"])
def test_a_file_that_is_not_utf8_is_refused_whatever_its_name(tmp_path, data, likely, where):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("this one is fine\n")
    bad = tmp_path / "docs" / {"file.md": "b.md", "file": "b"}.get(where, "b.txt")
    bad.write_bytes(data * 10)
    source = bad if where != "folder" else tmp_path / "docs"
    with pytest.raises(UserError) as e:
        prepare(text=str(source), tokenizer="char", root=str(tmp_path / "out"), quiet=True)
    assert str(e.value) == f"{bad} is not UTF-8 (likely {likely}); save it as UTF-8"


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16-le"])
def test_files_that_are_not_utf8_are_refused_in_one_line(tmp_path, encoding):
    (tmp_path / "b.txt").write_bytes("Café crème\n".encode(encoding) * 10)
    with pytest.raises(UserError) as e:
        prepare(files=[str(tmp_path / "b.txt")], tokenizer="char", root=str(tmp_path / "out"))
    assert str(e.value) == f"{tmp_path / 'b.txt'} is not UTF-8 (UTF-16? Latin-1?); save it as UTF-8"


# --- prepare: documents -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_a_folder_of_txt_files_is_documents_split_by_tokens(tmp_path, kind):
    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    corpus.mkdir()
    elsewhere.mkdir()
    (corpus / "sub").symlink_to(elsewhere)  # a symlinked folder is read as any other
    for path, doc in zip(["a.txt", "b.txt", "sub/c.txt"], DOCS):
        (corpus / path).write_text(doc)
    (corpus / "notes.md").write_text("not a .txt file")
    folder = prepare(
        text=str(corpus), tokenizer=kind, root=str(tmp_path / "out"), val_fraction=0.25, quiet=True
    )
    assert folder == tmp_path / "out" / "corpus"
    m = manifest(folder)
    if kind == "char":
        tok = CharTokenizer("".join(sorted(set("".join(DOCS) + "\n"))))
        stream = tok.encode("".join(doc + "\n\n" for doc in DOCS))
        assert m["chars"] == tok.chars and m["vocab_size"] == len(tok.chars)
    else:
        tok = GPT2Tokenizer()
        stream = [i for doc in DOCS for i in tok.encode(doc) + [50256]]
        assert m["vocab_size"] == 50257
    cut = int(len(stream) * 0.75)
    assert split_ids(folder, "train") == stream[:cut] and split_ids(folder, "val") == stream[cut:]
    assert (m["train_tokens"], m["val_tokens"]) == (cut, len(stream) - cut)
    assert m["source"] == {"folder": str(corpus)} and m["tokenizer"] == kind
    before = tree(folder)
    prepare(text=str(corpus), tokenizer=kind, root=str(tmp_path / "out"), val_fraction=0.25)
    assert tree(folder) == before  # the same bytes: reused
    (corpus / "sub" / "d.txt").write_text("a fourth")
    prepare(text=str(corpus), tokenizer=kind, root=str(tmp_path / "out"), val_fraction=0.25)
    assert decoded(folder).endswith("a fourth" + ("\n\n" if kind == "char" else "<|endoftext|>"))


def write_docs(folder, fmt: str) -> list[str]:
    """DOCS in a file of format fmt (their column "body", beside another), or a .txt file each."""
    rows = [{"id": i, "body": doc} for i, doc in enumerate(DOCS)]
    if fmt == "txt":
        for i, doc in enumerate(DOCS):
            (folder / f"d{i}.txt").write_text(doc)
        return [str(folder / f"d{i}.txt") for i in range(len(DOCS))]
    path = folder / f"docs.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([["id", "body"], *([r["id"], r["body"]] for r in rows)])
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:  # jsonl, maybe compressed
        lines = "".join(json.dumps(r) + "\n" for r in rows)
        if fmt == "jsonl.gz":
            path.write_bytes(gzip.compress(lines.encode()))
        else:
            path.write_text(lines)
    return [str(path)]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "txt", "jsonl.gz"])
def test_files_of_each_format_are_documents(tmp_path, fmt, network_calls):
    files = write_docs(tmp_path, fmt)
    column = {} if fmt == "txt" else {"text_column": "body"}
    folder = prepare(
        files=files, tokenizer="char", root=str(tmp_path / "out"), quiet=True, **column
    )
    assert folder == tmp_path / "out" / ("d0" if fmt == "txt" else "docs")
    assert decoded(folder) == "".join(doc + "\n\n" for doc in DOCS)
    assert manifest(folder)["source"] == {
        "files": files,
        "text_column": column.get("text_column", "text"),
    }
    assert network_calls == []


def test_files_of_several_formats_are_refused(tmp_path):
    files = write_docs(tmp_path, "jsonl") + write_docs(tmp_path, "csv")
    with pytest.raises(UserError) as e:
        prepare(files=files, text_column="body", root=str(tmp_path / "out"), quiet=True)
    assert str(e.value) == (
        "--files takes files of one format: .txt, .parquet, .jsonl, .json, .csv, maybe compressed"
    )
    (tmp_path / "docs.xml").write_text("<doc/>")
    with pytest.raises(UserError, match="^--files takes files of one format"):
        prepare(files=[str(tmp_path / "docs.xml")], root=str(tmp_path / "out"), quiet=True)
    assert not (tmp_path / "out").exists()


def test_a_missing_column_is_one_line_naming_the_columns(tmp_path):
    files = write_docs(tmp_path, "jsonl")
    with pytest.raises(UserError) as e:
        prepare(files=files, tokenizer="char", root=str(tmp_path / "out"), quiet=True)
    assert (
        str(e.value) == f"{files[0]} has no column 'text' (id, body); pick one with --text-column"
    )
    assert not (tmp_path / "out" / "docs").exists()


def test_hf_reads_a_saved_dataset_and_a_split_of_a_saved_dataset_dict(tmp_path, network_calls):
    import datasets

    datasets.Dataset.from_dict({"body": DOCS, "n": [1, 2, 3]}).save_to_disk(tmp_path / "one")
    folder = prepare(
        hf=str(tmp_path / "one"), text_column="body", tokenizer="char", root=str(tmp_path / "out")
    )
    assert folder == tmp_path / "out" / "one"
    assert decoded(folder) == "".join(doc + "\n\n" for doc in DOCS)
    with pytest.raises(UserError) as e:
        prepare("other", hf=str(tmp_path / "one"), tokenizer="char", root=str(tmp_path / "out"))
    assert str(e.value) == (
        f"{tmp_path / 'one'} has no column 'text' (body, n); pick one with --text-column"
    )

    splits = {"train": DOCS, "test": ["held out", "", "and more"]}  # an empty text is no document
    datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
    ).save_to_disk(tmp_path / "dict")
    every = "".join(doc + "\n\n" for doc in DOCS)
    for split, want in ("test", "held out\n\nand more\n\n"), ("train", every):
        folder = prepare(
            f"dict_{split}",
            hf=str(tmp_path / "dict"),
            split=split,
            tokenizer="char",
            root=str(tmp_path / "out"),
            quiet=True,
        )
        assert decoded(folder) == want
        assert manifest(folder)["source"] == {
            "hf": str(tmp_path / "dict"),
            "subset": None,
            "split": split,
            "text_column": "text",
        }
    no_split = (
        f"--hf {tmp_path / 'dict'} has no split 'validation' (train, test); pick one with --split"
    )
    with pytest.raises(UserError, match=f"^{re.escape(no_split)}$"):
        prepare(hf=str(tmp_path / "dict"), split="validation", root=str(tmp_path / "out"))
    one_split = f"--hf {tmp_path / 'one'} is a dataset of one split: leave --split out"
    with pytest.raises(UserError, match=f"^{re.escape(one_split)}$"):
        prepare("x", hf=str(tmp_path / "one"), split="nonsense", root=str(tmp_path / "out"))
    assert network_calls == []


def test_too_little_text_for_two_splits_is_refused(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(UserError) as e:
        prepare(text=str(tmp_path / "x.txt"), tokenizer="char", root=str(tmp_path), quiet=True)
    assert (
        str(e.value)
        == f"{tmp_path / 'x.txt'}: too little text for a train and a val split; give more"
    )
    assert not (tmp_path / "x").exists()
    with pytest.raises(
        UserError, match=r"^--text \S+missing.txt: no such file or folder; give a text"
    ):
        prepare(text=str(tmp_path / "missing.txt"), root=str(tmp_path), quiet=True)


# --- prepare: what it refuses, and what it leaves ---------------------------------------------


@pytest.mark.parametrize("source", ["file", "folder"])
def test_a_prepare_that_dies_midway_leaves_the_old_dataset_whole(tmp_path, monkeypatch, source):
    for version, text in ("old", "the old text\n" * 50), ("new", "something new, longer\n" * 300):
        (tmp_path / version).mkdir()
        (tmp_path / version / "t.txt").write_text(text)
    where = {"file": "t.txt", "folder": ""}[source]
    root = tmp_path / "out"
    folder = prepare("d", text=str(tmp_path / "old" / where), tokenizer="char", root=str(root))
    old = decoded(folder)
    before = tree(root)

    real = loader.write_tokens

    def dies_at_val(path, chunks, vocab_size):  # as a process killed after train.bin is written
        if path.name == "val.bin":
            raise OSError(28, "No space left on device")
        return real(path, chunks, vocab_size)

    monkeypatch.setattr("data.prepare.write_tokens", dies_at_val)
    with pytest.raises(OSError, match="No space left"):
        prepare(
            "d", text=str(tmp_path / "new" / where), tokenizer="char", root=str(root), force=True
        )
    assert not (root / ".d.tmp").exists()  # what it built, beside the dataset, went with it
    assert {k: v for k, v in tree(root).items() if k.startswith("d/")} == {
        k: v for k, v in before.items() if k.startswith("d/")
    }
    assert decoded(folder) == old

    monkeypatch.undo()
    prepare("d", text=str(tmp_path / "new" / where), tokenizer="char", root=str(root), force=True)
    assert decoded(folder) == (tmp_path / "new" / "t.txt").read_text() + (
        "\n\n" if where == "" else ""
    )
    assert sorted(os.listdir(root)) == [".d.lock", "d"]  # the half-built one is gone


def test_a_second_prepare_waits_for_the_one_that_holds_the_lock(tmp_path):
    (tmp_path / "t.txt").write_text("some text to prepare\n" * 30)
    folder = prepare(text=str(tmp_path / "t.txt"), tokenizer="char", root=str(tmp_path))
    before = tree(folder)
    with FileLock(tmp_path / ".t.lock"):  # as another prepare holds it
        second = threading.Thread(
            target=prepare,
            args=(None,),
            kwargs=dict(
                text=str(tmp_path / "t.txt"), tokenizer="char", root=str(tmp_path), force=True
            ),
        )
        second.start()
        second.join(timeout=1)
        assert second.is_alive() and tree(folder) == before
    second.join(timeout=60)
    assert not second.is_alive() and tree(folder) != before
    assert decoded(folder) == "some text to prepare\n" * 30


@pytest.mark.parametrize(
    "files",
    [
        {"ckpt.pt": b"weights", "config.json": b"{}"},  # a run
        {"manifest.json": b"{}", "train.bin": b"", "val.bin": b"", "notes.txt": b"mine"},
        None,  # a file where the dataset's folder would go
    ],
    ids=["run", "dataset-and-notes", "file"],
)
def test_a_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path, files):
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    victim = tmp_path / "out" / "t"
    victim.parent.mkdir()
    if files is None:
        victim.write_bytes(b"mine")
    else:
        victim.mkdir()
        for name, content in files.items():
            (victim / name).write_bytes(content)
    before = tree(tmp_path / "out")
    for force in False, True:
        with pytest.raises(UserError) as e:
            prepare(
                text=str(tmp_path / "t.txt"),
                tokenizer="char",
                root=str(tmp_path / "out"),
                force=force,
            )
        assert (
            str(e.value)
            == f"{victim} is not a dataset's folder; give another name, or another folder"
        )
    assert tree(tmp_path / "out") == before and os.listdir(tmp_path / "out") == ["t"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"name": "shakespeare", "text": "t.txt"},  # a preset's name for another source
        {"name": "shakespeare_char", "files": ["t.txt"]},
    ],
)
def test_prepare_needs_a_preset_or_a_source_and_another_name(tmp_path, kwargs):
    with pytest.raises(UserError) as e:
        prepare(root=str(tmp_path), **kwargs)
    assert str(e.value) == (
        "name a preset (shakespeare_char, shakespeare), or give --text, --files or --hf "
        "and a name that is not a preset's"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b"])
def test_a_name_that_cannot_be_a_folder_is_refused(tmp_path, name):
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    with pytest.raises(UserError) as e:
        prepare(name, text=str(tmp_path / "t.txt"), root=str(tmp_path / "out"))
    assert str(e.value) == f"{name!r} cannot name a dataset's folder; give a name such as mycorpus"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5])
def test_val_fraction_is_a_share_between_0_and_1(tmp_path, fraction):
    with pytest.raises(UserError) as e:
        prepare("shakespeare_char", root=str(tmp_path), val_fraction=fraction)
    assert str(e.value) == f"--val-fraction {fraction}: give a share between 0 and 1"


def test_dataset_dir_prepares_a_preset_and_names_the_command_for_another(tmp_path):
    with pytest.raises(UserError) as e:
        dataset_dir("mine", str(tmp_path))
    assert str(e.value) == (
        f"no dataset 'mine' in {tmp_path}; prepare it (python -m data.prepare mine --text FILE "
        "(or --files, --hf)), give the --data-root that holds it, or use a preset: "
        "shakespeare_char, shakespeare"
    )
    with pytest.raises(UserError, match="^no dataset 'shakespeare-char' in .*; did you mean "):
        dataset_dir("shakespeare-char", str(tmp_path))
    assert (
        dataset_dir("shakespeare_char", str(tmp_path), quiet=True) == tmp_path / "shakespeare_char"
    )
    (tmp_path / "mine.txt").write_text("hello world\n" * 50)
    prepare(text=str(tmp_path / "mine.txt"), tokenizer="char", root=str(tmp_path), quiet=True)
    assert dataset_dir("mine", str(tmp_path)) == tmp_path / "mine"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "name a preset (shakespeare_char, shakespeare), or give --text, --files or --hf"),
        (
            ["--text", "T", "--text-column", "body"],
            "--text-column is for --files and --hf; drop it",
        ),
        (["--text", "T", "--split", "test"], "--subset, --split and --streaming are for --hf"),
        (
            ["--text", "T", "--val-fraction", "1.5"],
            "--val-fraction 1.5: give a share between 0 and 1",
        ),
    ],
    ids=["no-source", "text-column", "split", "val-fraction"],
)
def test_the_cli_says_a_mistake_in_one_line(tmp_path, argv, message):
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    argv = [str(tmp_path / "t.txt") if a == "T" else a for a in argv]
    proc = script("-m", "data.prepare", *argv, "--out-root", tmp_path / "out")
    assert one_error_line(proc).startswith(f"error: {message}") and proc.stdout == ""
    assert not (tmp_path / "out").exists()


# --- the batches ------------------------------------------------------------------------------


@pytest.fixture
def random_tokens(tmp_path):
    """5,000 random GPT-2 ids: any window of 17 is found at one place only."""
    path = tmp_path / "train.bin"
    write_tokens(path, [np.random.default_rng(0).integers(0, 50257, 5000)], vocab_size=50257)
    return path


def test_a_batch_row_is_a_window_x_its_first_block_y_its_last(random_tokens):
    tokens = np.asarray(read_tokens(random_tokens)).astype(np.int64)
    batches = Batches(random_tokens, 16, 4, 2, 0, 1, seed=3, device="cpu")
    starts = np.random.default_rng([3, 0, 7]).integers(0, 5000 - 16, 8)
    micro = batches(7)
    assert len(micro) == 2
    for m, (x, y) in enumerate(micro):
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        for row, s in enumerate(starts[4 * m : 4 * m + 4]):
            assert x[row].tolist() == tokens[s : s + 16].tolist()
            assert y[row].tolist() == tokens[s + 1 : s + 17].tolist()


@pytest.mark.parametrize("seed, block_size, rows", [(0, 8, 1), (7, 16, 64), (1234, 1, 3)])
def test_a_steps_rows_are_numpys_draw_from_seed_0_step(tmp_path, seed, block_size, rows):
    """The draw of earlier versions, pinned: default_rng([seed, 0, step]) over every window."""
    path = tmp_path / "t.bin"
    write_tokens(path, [np.arange(3000)], vocab_size=3000)  # a token's id is its place
    batches = Batches(path, block_size, rows, 1, 0, 1, seed, "cpu")
    for step in 0, 1, 5000:
        x, y = batches(step)[0]
        want = np.random.default_rng([seed, 0, step]).integers(0, 3000 - block_size, rows)
        assert x[:, 0].tolist() == want.tolist()
        assert torch.equal(y, x + 1) and torch.equal(
            x[:, 1:], x[:, :1] + torch.arange(1, block_size)
        )


def test_a_steps_batches_are_a_function_of_seed_and_step_alone(random_tokens):
    def draw(seed, steps):
        batches = Batches(random_tokens, 16, 4, 2, 0, 1, seed, "cpu")
        return [torch.cat([x for x, _ in batches(step)]) for step in steps]

    run = draw(5, range(6))
    assert all(torch.equal(a, b) for a, b in zip(run, draw(5, range(6))))
    resumed = draw(5, [4, 5, 4])  # a run resumed at step 4, in a new process
    assert torch.equal(resumed[0], run[4]) and torch.equal(resumed[1], run[5])
    assert torch.equal(resumed[2], run[4])  # the same step twice: the same rows
    assert not torch.equal(run[4], run[5])
    assert not torch.equal(draw(6, [4])[0], run[4])


@pytest.mark.parametrize("grad_accum, world_size", [(4, 1), (2, 2), (1, 4), (1, 1)])
def test_a_steps_rows_do_not_depend_on_processes_and_accumulation(
    random_tokens, grad_accum, world_size
):
    """Micro-step m of process r holds rows [m, r] of the step's one draw of 8 rows."""
    per = 8 // (grad_accum * world_size)
    whole = Batches(random_tokens, 16, 8, 1, 0, 1, seed=9, device="cpu")
    ranks = [
        Batches(random_tokens, 16, per, grad_accum, r, world_size, seed=9, device="cpu")
        for r in range(world_size)
    ]
    for step in 0, 3:
        ((x_all, y_all),) = whole(step)
        mine = [rank(step) for rank in ranks]
        assert all(len(m) == grad_accum for m in mine)
        assert all(x.shape == y.shape == (per, 16) for m in mine for x, y in m)
        order = [(m, r) for m in range(grad_accum) for r in range(world_size)]
        assert torch.equal(torch.cat([mine[r][m][0] for m, r in order]), x_all)
        assert torch.equal(torch.cat([mine[r][m][1] for m, r in order]), y_all)


def test_batches_are_on_the_device_asked_for(random_tokens):
    for x, y in Batches(random_tokens, 16, 4, 2, 0, 1, seed=3, device="meta")(0):
        assert x.device.type == y.device.type == "meta" and x.shape == y.shape == (4, 16)
    for x, y in eval_batches(random_tokens, 16, 4, "meta", limit=2):
        assert x.device.type == y.device.type == "meta" and x.shape == y.shape == (4, 16)


@pytest.mark.cuda
def test_batches_on_a_gpu_are_the_cpu_ones(random_tokens):
    cpu = Batches(random_tokens, 16, 4, 2, 0, 1, seed=3, device="cpu")(5)
    gpu = Batches(random_tokens, 16, 4, 2, 0, 1, seed=3, device="cuda")(5)
    for (x, y), (gpu_x, gpu_y) in zip(cpu, gpu, strict=True):
        assert gpu_x.device.type == gpu_y.device.type == "cuda"
        assert torch.equal(gpu_x.cpu(), x) and torch.equal(gpu_y.cpu(), y)


@pytest.fixture
def counting(tmp_path):
    """1,000 tokens whose ids are their places: a window is named by its first token."""
    path = tmp_path / "val.bin"
    write_tokens(path, [np.arange(1000)], vocab_size=1000)
    return path


def test_eval_batches_cover_the_windows_at_each_block_once(counting):
    batches = list(eval_batches(counting, 16, 5, "cpu"))
    starts = list(range(0, 1000 - 16, 16))  # 62 windows, the last at 976 ending at token 992
    assert len(starts) == 62 and len(batches) == 13
    assert [len(x) for x, _ in batches] == [5] * 12 + [2]  # the last batch is short
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (62, 16)
    assert x[:, 0].tolist() == starts
    assert torch.equal(x.reshape(-1), torch.arange(62 * 16)) and torch.equal(y, x + 1)
    again = list(eval_batches(counting, 16, 5, "cpu"))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))


def test_eval_batches_limit_keeps_the_first_batches(counting):
    every = [x[:, 0].tolist() for x, _ in eval_batches(counting, 16, 5, "cpu")]
    for limit, want in (0, every), (1, every[:1]), (3, every[:3]), (13, every), (99, every):
        assert [x[:, 0].tolist() for x, _ in eval_batches(counting, 16, 5, "cpu", limit)] == want


@pytest.mark.parametrize("world_size, limit", [(2, 0), (3, 0), (4, 0), (3, 7), (13, 0), (20, 0)])
def test_eval_batches_are_shared_between_processes_without_overlap_or_gaps(
    counting, world_size, limit
):
    every = [x[:, 0].tolist() for x, _ in eval_batches(counting, 16, 5, "cpu", limit)]
    shares = [
        [x[:, 0].tolist() for x, _ in eval_batches(counting, 16, 5, "cpu", limit, r, world_size)]
        for r in range(world_size)
    ]
    assert shares == [every[r::world_size] for r in range(world_size)]


def test_a_split_of_one_window_works_and_a_shorter_one_is_a_user_error(tmp_path):
    path = tmp_path / "val.bin"
    write_tokens(path, [np.arange(9)], vocab_size=16)  # a block of 8 and one more
    assert windows(path, 8).tolist() == [list(range(9))]
    ((x, y),) = Batches(path, 8, 3, 1, 0, 1, seed=0, device="cpu")(0)
    assert x.tolist() == [list(range(8))] * 3 and y.tolist() == [list(range(1, 9))] * 3
    ((x, y),) = eval_batches(path, 8, 4, "cpu")
    assert x.tolist() == [list(range(8))] and y.tolist() == [list(range(1, 9))]
    for block_size in 9, 10:
        message = f"{path} holds 9 tokens, not a block of {block_size} and one more; lower --block-"
        message += "size, or prepare more text"
        with pytest.raises(UserError) as e:
            Batches(path, block_size, 1, 1, 0, 1, seed=0, device="cpu")
        assert str(e.value) == message
        with pytest.raises(UserError) as e:
            eval_batches(path, block_size, 1, "cpu")
        assert str(e.value) == message


def test_a_dataset_of_other_text_or_tokenizer_is_replaced_only_with_force(tmp_path, capsys):
    for d, text in ("d1", "some text\n" * 40), ("d2", "other words\n" * 40):
        (tmp_path / d).mkdir()
        (tmp_path / d / "input.txt").write_text(text)
    root = str(tmp_path / "prepared")
    prepare(text=str(tmp_path / "d1" / "input.txt"), tokenizer="char", root=root)
    prepare(text=str(tmp_path / "d1" / "input.txt"), tokenizer="char", root=root)
    assert capsys.readouterr().out.splitlines()[-1] == f"input: up to date in {root}/input"
    before = tree(tmp_path / "prepared" / "input")
    for other in (
        dict(text=str(tmp_path / "d2" / "input.txt"), tokenizer="char"),
        dict(text=str(tmp_path / "d1" / "input.txt"), tokenizer="gpt2"),
    ):
        with pytest.raises(
            UserError, match="holds dataset input of other text or another tokenizer; give --force"
        ):
            prepare(root=root, **other)
        assert tree(tmp_path / "prepared" / "input") == before
    prepare(text=str(tmp_path / "d2" / "input.txt"), tokenizer="char", root=root, force=True)
    assert decoded(tmp_path / "prepared" / "input") == "other words\n" * 40


def test_files_naming_a_file_that_does_not_exist_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^--files .*nothing\.jsonl: not a file$"):
        prepare("x", files=[str(tmp_path / "nothing.jsonl")], root=str(tmp_path))
