"""training/hellaswag.py: its items, its scores against transformers, and train.py's --hellaswag.

Items are read from a .jsonl file, a bad line named by its number; the scores equal those of
transformers' logits, on one process or two; train.py scores at eval-only and during training.
"""

import json
import math
import os
import re
import time
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, hf_tiny, script, tiny

import train
from configs import UserError
from data.tokenizer import CharTokenizer, GPT2Tokenizer
from model.checkpoint import load_checkpoint, model_from
from model.gpt import GPT, GPTConfig
from model.hf import load_gpt2
from training import hellaswag
from training.runtime import Runtime

CHARS = "".join(sorted(set((ROOT / "data/corpora/tinyshakespeare/input.txt").read_text())))
TOK = CharTokenizer(CHARS)
CPU = Runtime("cpu", torch.float32)
ITEM = {
    "ind": 4,
    "ctx": "A man is sitting on a roof. He",
    "endings": [
        "is using wrap to wrap a pair of skis.",
        "is ripping level tiles off.",
        "is holding a rubik's cube.",
        "starts pulling up roofing on a roof.",
    ],
    "label": 3,
}


def write_lines(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def write_items(path, items):
    return write_lines(path, *map(json.dumps, items))


# ------------------------------------------------------------------ load_items


@pytest.mark.parametrize("tok", [TOK, GPT2Tokenizer()], ids=["char", "gpt2"])
def test_load_items_reads_each_line_with_its_endings_after_a_space(tmp_path, tok):
    second = {"ctx": "ROMEO: I will", "endings": ["go.", "stay.", "love.", "speak."], "label": "1"}
    path = write_items(tmp_path / "items.jsonl", [ITEM, second])
    assert hellaswag.load_items(path, tok) == [
        (tok.encode(ITEM["ctx"]), [tok.encode(" " + e) for e in ITEM["endings"]], 3),
        (tok.encode("ROMEO: I will"), [tok.encode(" " + e) for e in second["endings"]], 1),
    ]


@pytest.mark.parametrize(
    "line, says",
    [
        ("{not json", "not a HellaSwag item (Expecting property name enclosed in double quotes"),
        (json.dumps({k: v for k, v in ITEM.items() if k != "ctx"}), "not a HellaSwag item ('ctx')"),
        (json.dumps(ITEM | {"label": "x"}), "not a HellaSwag item (invalid literal for int()"),
        (json.dumps(ITEM | {"label": None}), "not a HellaSwag item (invalid literal for int()"),
        (json.dumps(ITEM | {"label": 1.7}), "not a HellaSwag item (invalid literal for int()"),
        (json.dumps(ITEM | {"ctx": "Señor"}), "not a HellaSwag item ('ñ': not in this model's"),
        ("", "not a HellaSwag item (Expecting value: line 1 column 1 (char 0))"),
        (json.dumps(ITEM | {"endings": ITEM["endings"][:3]}), "a HellaSwag item has four endings"),
        (json.dumps(ITEM | {"endings": ITEM["endings"] * 2}), "a HellaSwag item has four endings"),
        (json.dumps(ITEM | {"label": 7}), "four endings and a label from 0 to 3"),
        (json.dumps(ITEM | {"label": 4}), "four endings and a label from 0 to 3"),
        (json.dumps(ITEM | {"label": -1}), "four endings and a label from 0 to 3"),
    ],
    ids=[
        "bad json",
        "no ctx",
        "label x",
        "label null",
        "label 1.7",
        "unknown char",
        "blank",
        "three endings",
        "eight endings",
        "label 7",
        "label 4",
        "label -1",
    ],
)
def test_a_bad_line_is_one_line_naming_its_number(tmp_path, line, says):
    path = write_lines(tmp_path / "items.jsonl", json.dumps(ITEM), json.dumps(ITEM), line)
    with pytest.raises(UserError) as e:
        hellaswag.load_items(path, TOK)
    assert str(e.value).startswith(f"--hellaswag {path}, line 3: ")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_labels_from_0_to_3_are_taken(tmp_path):
    path = write_items(tmp_path / "items.jsonl", [ITEM | {"label": k} for k in range(4)])
    assert [label for *_, label in hellaswag.load_items(path, TOK)] == [0, 1, 2, 3]


def test_an_empty_file_is_one_line(tmp_path):
    path = write_lines(tmp_path / "items.jsonl")
    with pytest.raises(UserError) as e:
        hellaswag.load_items(path, TOK)
    assert str(e.value) == f"--hellaswag {path} holds no items"


@pytest.mark.parametrize("kind", ["missing", "folder", "not utf-8"])
def test_a_missing_or_unreadable_file_is_one_line_saying_where_to_get_one(tmp_path, kind):
    path = tmp_path / "items.jsonl"
    if kind == "folder":
        path.mkdir()
    if kind == "not utf-8":
        path.write_bytes(b'{"ctx": "\xff"}\n')
    with pytest.raises(UserError) as e:
        hellaswag.load_items(str(path), TOK)
    message = str(e.value)
    assert message.startswith(f"--hellaswag {path}: ") and "\n" not in message
    assert message.endswith(
        "; give a HellaSwag .jsonl file (training/hellaswag.py says where to get one), "
        "or --hellaswag '' to go on without"
    )


# ------------------------------------------------------------------ score


def random_items(n: int, seed: int = 0):
    """n items of random ids below 37; contexts of 1 to 40 tokens (block_size is 24), endings of
    1 to 8; one context of 26 or more, and one ending of 30 tokens, longer than the block itself."""
    g = torch.Generator().manual_seed(seed)

    def ids(low, high):
        return torch.randint(
            0, 37, (int(torch.randint(low, high + 1, (), generator=g)),), generator=g
        ).tolist()

    items = [(ids(1, 40), [ids(1, 8) for _ in range(4)], k % 4) for k in range(n)]
    items[1][1][2] = ids(30, 30)
    items[2][0].extend(ids(25, 25))  # a context longer than the block
    return items


@torch.no_grad()
def reference(hf, items, block: int, vocab: int):
    """Each ending's summed log-likelihood and its token count, by transformers' logits of the
    last block_size + 1 tokens of the context and the ending."""
    sums, counts = [], []
    for ctx, ends, _ in items:
        for end in ends:
            row = (ctx + end)[-(block + 1) :]
            n = min(len(end), len(row) - 1)
            logp = hf(torch.tensor([row[:-1]])).logits[0, :, :vocab].log_softmax(-1)
            sums.append(
                sum(logp[t, row[t + 1]].item() for t in range(len(row) - 1 - n, len(row) - 1))
            )
            counts.append(n)
    return torch.tensor(sums).view(-1, 4), torch.tensor(counts).view(-1, 4)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random transformers GPT-2 of 40 ids, of which the items' tokenizer has 37."""
    folder = tmp_path_factory.mktemp("hf")
    hf = hf_tiny(vocab=40)
    with torch.no_grad():  # sharper; and ids 37 to 39, which no item holds, likelier than any
        for p in hf.parameters():
            p.mul_(3 if p.dim() == 2 else 1)
        hf.transformer.wte.weight[37:] *= 10  # tied: the head's rows
    hf.save_pretrained(folder)
    return folder


def scores(picks: torch.Tensor, labels: list[int]) -> float:
    return sum(int(p) == label for p, label in zip(picks, labels)) / len(labels)


def test_score_equals_transformers_log_likelihoods_by_hand(hf_folder):
    hf = transformers_model(hf_folder)
    items = random_items(24)
    assert sum(len(ctx) + len(max(ends, key=len)) > 25 for ctx, ends, _ in items) >= 8  # cut
    sums, counts = reference(hf, items, 24, 37)
    by_sum, by_token = sums.argmax(1), (sums / counts).argmax(1)
    assert (by_sum != by_token).sum() >= 2  # the two scores disagree somewhere
    top2 = torch.cat([sums, sums / counts]).topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # no near ties to turn on rounding
    # dropout 0.5: scoring must be in eval mode, or the picks would be noise
    ours, _ = load_gpt2(str(hf_folder), dropout=0.5)
    for labels in by_sum.tolist(), by_token.tolist(), [k % 4 for k in range(24)]:
        labelled = [(ctx, ends, label) for (ctx, ends, _), label in zip(items, labels)]
        assert hellaswag.score(ours, labelled, CPU, 8, 37) == {
            "hellaswag_acc": scores(by_sum, labels),
            "hellaswag_acc_norm": scores(by_token, labels),
            "hellaswag_items": 24,
        }
        assert ours.training  # the model goes back to training
    assert scores(by_sum, by_token.tolist()) < 1


def transformers_model(folder):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(folder).eval()


def test_the_batch_size_does_not_change_the_scores(hf_folder):
    ours, _ = load_gpt2(str(hf_folder))
    items = random_items(9, seed=1)
    results = [hellaswag.score(ours, items, CPU, size, 37) for size in (1, 4, 7, 8, 12, 100)]
    assert results[0]["hellaswag_items"] == 9
    assert all(result == results[0] for result in results)


DDP_SCRIPT = """
import json, sys
import torch
from model.hf import load_gpt2
from training import hellaswag
from training.runtime import Runtime

torch.distributed.init_process_group("gloo")
rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
model, _ = load_gpt2(sys.argv[1])
items = [tuple(item) for item in json.loads(open(sys.argv[2]).read())]
result = hellaswag.score(model, items, Runtime("cpu", torch.float32, False, rank, rank, world_size),
                         8, 37)
with open(f"{sys.argv[2]}.{rank}", "w") as f:  # a file each: two processes' prints can interleave
    f.write(json.dumps([rank, world_size, result]))
torch.distributed.destroy_process_group()
"""


def test_two_ddp_processes_give_the_counts_of_one(hf_folder, tmp_path):
    items = random_items(9, seed=2)  # the ranks take 5 and 4
    ours, _ = load_gpt2(str(hf_folder))
    alone = hellaswag.score(ours, items, CPU, 8, 37)
    (tmp_path / "items.json").write_text(json.dumps(items))
    (tmp_path / "score.py").write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = script(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        2,
        tmp_path / "score.py",
        hf_folder,
        tmp_path / "items.json",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [json.loads((tmp_path / f"items.json.{rank}").read_text()) for rank in (0, 1)]
    assert printed == [[0, 2, alone], [1, 2, alone]]  # each process has the sum of both
    assert alone["hellaswag_items"] == 9 and 0 < alone["hellaswag_acc"] < 1


# ------------------------------------------------------------------ train.py --hellaswag


def char_items(tmp_path):
    items = [
        {
            "ctx": "ROMEO: I will",
            "endings": ["go.", "stay here.", "love thee.", "speak."],
            "label": k % 4,
        }
        for k in range(5)
    ]
    items[1]["ctx"] = "JULIET: " * 5 + "O"  # longer than the block: its left is cut
    return write_items(tmp_path / "items.jsonl", items)


def test_eval_only_prints_hellaswag_acc_acc_norm_and_items(tmp_path, data_root, capsys):
    path = char_items(tmp_path)
    train.train(tiny(tmp_path, data_root, max_iters=2, threads=1))
    capsys.readouterr()
    result = train.train(
        tiny(tmp_path, data_root, eval_only=True, hellaswag=path, threads=1, dtype="float32")
    )
    model = model_from(load_checkpoint(tmp_path / "run"))
    expected = hellaswag.score(model, hellaswag.load_items(path, TOK), CPU, 4, 65)
    assert expected["hellaswag_items"] == 5
    assert {k: result[k] for k in expected} == expected
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "hellaswag" in line] == [
        f"  hellaswag_acc {expected['hellaswag_acc']:.4f}",
        f"  hellaswag_acc_norm {expected['hellaswag_acc_norm']:.4f}",
        "  hellaswag_items 5",
    ]


@pytest.mark.parametrize("interval, scored", [(0, [2, 4, 6]), (4, [4, 6]), (4, [4, 8, 9])])
def test_training_scores_hellaswag_at_each_eval_or_at_its_interval_and_at_the_end(
    tmp_path, data_root, interval, scored
):
    path = char_items(tmp_path)
    cfg = tiny(
        tmp_path,
        data_root,
        max_iters=scored[-1],
        eval_interval=2,
        hellaswag=path,
        hellaswag_interval=interval,
        threads=1,
    )
    train.train(cfg)
    records = [
        json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [*range(2, scored[-1], 2), scored[-1]]  # none at step 0
    assert [r["step"] for r in evals if "hellaswag_acc" in r] == scored
    assert all(
        r["hellaswag_items"] == 5 and "hellaswag_acc_norm" in r
        for r in evals
        if r["step"] in scored
    )
    assert not any("hellaswag_acc" in r for r in records if "val_loss" not in r)


def test_training_reads_the_items_again_at_each_eval(tmp_path, data_root, monkeypatch):
    path = char_items(tmp_path)
    reads = []
    load = hellaswag.load_items
    monkeypatch.setattr(hellaswag, "load_items", lambda *a: reads.append(a[0]) or load(*a))
    train.train(tiny(tmp_path, data_root, max_iters=4, eval_interval=2, hellaswag=path, threads=1))
    assert reads == [path] * 3  # at the start (its size), and at steps 2 and 4


def test_a_file_rewritten_in_place_with_its_size_and_mtime_is_read_afresh(tmp_path):
    """cp -p, rsync -t and tar x keep a file's size and mtime: the new labels are the ones read."""
    item = {"ctx": "ROMEO: I", "endings": ["a", "b", "c", "d"], "label": 0}
    path = write_items(tmp_path / "items.jsonl", [item])
    stat = os.stat(path)
    assert hellaswag.load_items(path, TOK)[0][2] == 0
    write_items(tmp_path / "items.jsonl", [item | {"label": 3}])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime == stat.st_mtime
    assert hellaswag.load_items(path, TOK)[0][2] == 3


def test_a_path_with_a_tilde_is_in_the_home_folder(tmp_path, monkeypatch):
    """--hellaswag=~/x.jsonl reaches the program with its ~: it is the user's home."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_items(tmp_path / "x.jsonl", [{"ctx": "A", "endings": list("abcd"), "label": 2}])
    assert hellaswag.load_items("~/x.jsonl", TOK)[0][2] == 2


def test_a_tilde_of_no_user_is_a_missing_file_in_one_line(tmp_path):
    with pytest.raises(UserError, match="^--hellaswag ~nosuchuser/x.jsonl: .*No such file"):
        hellaswag.load_items("~nosuchuser/x.jsonl", TOK)


def test_a_resume_whose_file_is_gone_is_told_how_to_go_on_without(tmp_path, data_root, capsys):
    path = char_items(tmp_path)
    cfg = tiny(tmp_path, data_root, max_iters=2, eval_interval=2, hellaswag=path, threads=1)
    train.train(cfg)
    os.remove(path)
    with pytest.raises(UserError, match=r"or --hellaswag '' to go on without$"):
        train.train(replace(cfg, max_iters=4, resume=True))
    train.train(replace(cfg, max_iters=4, resume=True, hellaswag=""))  # and it does


def test_with_max_time_the_final_eval_scores_too_and_the_run_ends_in_time(
    tmp_path, data_root, monkeypatch
):
    """Scoring 4,000 rows takes seconds: the estimate of the final eval must count them, else the
    run ends late."""
    path = write_items(
        tmp_path / "many.jsonl", [json.loads(line) for line in open(char_items(tmp_path))] * 200
    )
    cfg = tiny(tmp_path, data_root, max_iters=10**6, eval_interval=10**6, max_time=10.0)
    started = time.time()
    result = train.train(replace(cfg, hellaswag=path, threads=1))
    assert time.time() - started <= cfg.max_time
    assert "hellaswag_acc" in result and result["stop_signal"] == 0


TRAIN = "import sys, train; sys.argv[0] = 'train.py'; from configs import run; run(train.main)"


def test_under_torchrun_the_ranks_share_the_scoring_so_none_waits_past_a_short_timeout(
    tmp_path, data_root
):
    """A file that one process scores in 8 s, more than --ddp-timeout 5: two processes each
    score half, so neither waits on the other for it (test_two_ddp_processes_give_the_counts_of_one
    shows the shared counts equal one process's)."""
    cfg = tiny(tmp_path, data_root, threads=1)
    path = char_items(tmp_path)
    model = GPT(GPTConfig(vocab_size=len(CHARS), block_size=32, n_layer=2, n_head=2, n_embd=16))
    items = hellaswag.load_items(path, TOK) * 200  # 1,000 items
    started = time.time()
    hellaswag.score(model, items, CPU, cfg.batch_size, len(CHARS))
    copies = math.ceil(8.0 / (time.time() - started)) * 200
    lines = (tmp_path / "items.jsonl").read_text() * copies
    (tmp_path / "items.jsonl").write_text(lines)
    (tmp_path / "train_main.py").write_text(TRAIN)
    flags = ["--config", "tiny", "--device", "cpu", "--data-root", data_root, "--threads", "1"]
    flags += ["--max-iters", "1", "--eval-interval", "1", "--sample-tokens", "0"]
    flags += ["--hellaswag", path, "--ddp-timeout", "5"]
    run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    two = script(*run, tmp_path / "train_main.py", *flags, "--out-dir", tmp_path / "two", env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    evals = [json.loads(line) for line in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "val_loss" in r]
    assert [r["step"] for r in evals] == [1]
    assert [r["hellaswag_items"] for r in evals] == [5 * copies]  # each counted once


def test_the_eval_line_prints_the_item_count_as_a_count(tmp_path, data_root, capsys):
    train.train(
        tiny(tmp_path, data_root, max_iters=2, eval_interval=2, hellaswag=char_items(tmp_path))
    )
    assert re.search(r"step 2: val_loss .*, hellaswag_items 5 \(best\)\n", capsys.readouterr().out)
