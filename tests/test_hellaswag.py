"""training/hellaswag.py: its items, its scores against sums by hand, and train.py's --hellaswag.

Items are read from a .jsonl file, a bad line named by its number; the scores equal those summed
by hand, on one process or two; train.py scores at eval-only and during training.
"""

import json
import math
import os
import re
import time
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, rows, script, tiny, tiny_args
from test_sample import BPE, TOK  # GPT-2's tokenizer; shakespeare's characters
from test_train import read  # metrics.jsonl's records

import train
from configs import UserError
from model.checkpoint import load_checkpoint, model_from
from model.gpt import GPT, GPTConfig
from training import hellaswag
from training.runtime import Runtime

CPU = Runtime("cpu", torch.float32)
LINE = (
    '{"ind": 4, "ctx": "A man is sitting on a roof. He", "endings": ["is using wrap to wrap a pair '
    'of skis.", "is ripping level tiles off.", "is holding a rubik\'s cube.", "starts pulling '
    'up roofing on a roof."], "label": 3}'
)
ITEM = json.loads(LINE)


def score(model, path):
    return hellaswag.score(model, hellaswag.load_items(path, TOK), CPU, 4, 65)


# Five items of the shakespeare characters: four alike, labelled 0 to 3, so that one of them is
# right whatever the model; and one with a context longer than the block, its left cut.
CHAR_ITEMS = """\
{"ctx": "ROMEO: I will", "endings": ["go.", "stay here.", "love thee.", "speak."], "label": 0}
{"ctx": "ROMEO: I will", "endings": ["go.", "stay here.", "love thee.", "speak."], "label": 1}
{"ctx": "ROMEO: I will", "endings": ["go.", "stay here.", "love thee.", "speak."], "label": 2}
{"ctx": "ROMEO: I will", "endings": ["go.", "stay here.", "love thee.", "speak."], "label": 3}
{"ctx": "JULIET: JULIET: JULIET: JULIET: JULIET: O", \
"endings": ["go.", "stay here.", "love thee.", "speak."], "label": 0}
"""


def char_items(tmp_path, copies=1):
    """A file of CHAR_ITEMS, copies times over."""
    (path := tmp_path / "items.jsonl").write_text(CHAR_ITEMS * copies)
    return str(path)


def test_load_items_reads_each_line_afresh_its_endings_after_a_space(tmp_path, monkeypatch):
    """~ is the home folder; a file rewritten with its size and mtime (cp -p, rsync -t, tar x)
    is read anew."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "x.jsonl"
    labelled = lambda labels: path.write_text(
        "".join(json.dumps(ITEM | {"label": k}) + "\n" for k in labels)
    )
    labelled([3, "1"])  # a label of text too
    for tok in TOK, BPE:
        item = tok.encode(ITEM["ctx"]), [tok.encode(" " + end) for end in ITEM["endings"]]
        assert hellaswag.load_items("~/x.jsonl", tok) == [(*item, 3), (*item, 1)]
    for labels in [0, 1, 2, 3], [3, 2, 1, 0]:
        labelled(labels)
        os.utime(path, ns=(0, 0))  # the same size and mtime each time
        assert [label for *_, label in hellaswag.load_items(path, TOK)] == labels


# line 3 of a file | what its one line says past "line 3: "; an empty line 3 too
BAD = """{not json | not a HellaSwag item (Expecting property name enclosed in double quotes
{"endings": ["a", "b", "c", "d"], "label": 0} | not a HellaSwag item ('ctx')
{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": "x"} | \
not a HellaSwag item (invalid literal for int()
{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": null} | \
not a HellaSwag item (invalid literal for int()
{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": 1.7} | \
not a HellaSwag item (invalid literal for int()
{"ctx": "Señor", "endings": ["a", "b", "c", "d"], "label": 0} | \
not a HellaSwag item ('ñ': not in this model's
 | not a HellaSwag item (Expecting value: line 1 column 1 (char 0))
{"ctx": "A", "endings": ["a", "b", "c"], "label": 0} | a HellaSwag item has four endings
{"ctx": "A", "endings": ["a", "b", "c", "d", "e"], "label": 0} | a HellaSwag item has four endings
{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": 4} | four endings and a label from 0 to 3
{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": -1} | four endings and a label from 0 to 3"""


@pytest.mark.parametrize("line, says", rows(BAD))
def test_a_bad_line_is_one_line_naming_its_number(tmp_path, line, says):
    (path := tmp_path / "x.jsonl").write_text(f"{LINE}\n{LINE}\n{line}\n")
    with pytest.raises(UserError, match=f"^--hellaswag {path}, line 3: .*{re.escape(says)}.*\\Z"):
        hellaswag.load_items(path, TOK)


def test_a_missing_unreadable_or_empty_file_is_one_line_saying_where_to_get_one(tmp_path):
    (tmp_path / "latin-1.jsonl").write_bytes(b'{"ctx": "\xff"}\n')
    (tmp_path / "empty.jsonl").touch()
    give = (
        "; give a HellaSwag .jsonl file \\(training/hellaswag.py says where to get one\\), or "
        "--hellaswag '' to go on without"
    )
    for path, says in (
        ("~nosuchuser/x.jsonl", f": .*No such file.*{give}"),  # a tilde of no user
        (tmp_path, f": .*Is a directory.*{give}"),
        (tmp_path / "latin-1.jsonl", f": .*can't decode.*{give}"),
        (tmp_path / "empty.jsonl", " holds no items"),
    ):
        with pytest.raises(UserError, match=f"^--hellaswag {path}{says}\\Z"):
            hellaswag.load_items(path, TOK)


def test_score_equals_log_likelihoods_summed_by_hand_whatever_the_batch():
    """A random GPT of 40 ids (its logits are transformers': test_hf.py), of which the items hold
    37; contexts of 1 to 47 ids (the block is 24: the longer are cut), endings of 1 to 8, one of 30.
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(40, 24, 2, 2, 16, dropout=0.5))  # scored in eval mode, or noise
    with torch.no_grad():  # random and sharp; and ids 37 to 39, which no item holds, likeliest
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() == 2 else 0.1)
        model.transformer.wte.weight[37:] *= 10  # tied: the head's rows
    ids = lambda n: torch.randint(37, (n,)).tolist()
    items = [[ids(2 * k + 1), [ids((k + e) % 8 + 1) for e in range(4)]] for k in range(24)]
    items[1][1][2] = ids(30)

    def summed(ctx, end):  # the ending's log-likelihood, of its ids in the last block_size + 1
        row, n = (ctx + end)[-25:], min(len(end), 24)
        logits = model.eval()(torch.tensor([row[:-1]]))[0][0, -n:, :37]
        return logits.log_softmax(-1)[torch.arange(n), row[-n:]].sum().item(), n

    sums, counts = torch.tensor([[summed(ctx, end) for end in ends] for ctx, ends in items]).unbind(
        -1
    )
    mean = sums / counts  # per token
    by_sum, by_token = sums.argmax(1), mean.argmax(1)
    assert (by_sum != by_token).sum() >= 2  # the two scores disagree somewhere
    assert torch.cat([sums, mean]).topk(2).values.diff().max() < -1e-3  # no near ties
    model.train()
    for truth in by_sum, by_token, torch.arange(24) % 4:
        acc, norm = ((picks == truth).sum().item() / 24 for picks in (by_sum, by_token))
        labelled = [(*item, label) for item, label in zip(items, truth.tolist())]
        for batch_size in 1, 4, 7, 8, 12, 100:
            assert hellaswag.score(model, labelled, CPU, batch_size, 37) == {
                "hellaswag_acc": acc,
                "hellaswag_acc_norm": norm,
                "hellaswag_items": 24,
            }
            assert model.training  # the model goes back to training


def test_training_scores_at_each_eval_or_interval_and_the_end_and_eval_only_once(
    tmp_path, data_root, monkeypatch, capsys
):
    path, load, reads = char_items(tmp_path), hellaswag.load_items, []
    monkeypatch.setattr(hellaswag, "load_items", lambda *a: reads.append(a[0]) or load(*a))
    cfg = tiny(tmp_path, data_root, max_iters=5, eval_interval=2, hellaswag=path)
    train.train(cfg)  # scores at each eval: 2, 4 and the end, 5
    assert re.search(r"step 2: val_loss .*, hellaswag_items 5 \(best\)\n", capsys.readouterr().out)
    train.train(replace(cfg, max_iters=10, hellaswag_interval=4, resume=True))  # at 8 and 10
    assert reads == [path] * 7  # at each start (its size), and afresh at each score
    records = read(tmp_path / "run")
    keys = "hellaswag_acc hellaswag_acc_norm hellaswag_items".split()
    scored = [  # at evals, and nowhere else
        (r["step"], [k for k in r if "hellaswag" in k])
        for r in records
        if "val_loss" in r or keys[0] in r
    ]
    assert scored == [(step, keys * (step != 6)) for step in (2, 4, 5, 6, 8, 10)]
    assert {r.get("hellaswag_items", 5) for r in records} == {5}
    capsys.readouterr()

    result = train.train(replace(cfg, eval_only=True, dtype="float32", eval_batch_size=1000))
    want = score(model_from(load_checkpoint(tmp_path / "run")), path)
    assert result.items() >= want.items()
    assert re.findall(".*hellaswag.*", capsys.readouterr().out) == [
        f"  hellaswag_acc {want['hellaswag_acc']:.4f}",
        f"  hellaswag_acc_norm {want['hellaswag_acc_norm']:.4f}",
        "  hellaswag_items 5",
    ]
    os.remove(path)  # a resume is told how to go on without it, and does
    with pytest.raises(UserError, match=r"or --hellaswag '' to go on without$"):
        train.train(replace(cfg, max_iters=11, resume=True))
    train.train(replace(cfg, max_iters=11, resume=True, hellaswag=""))


def test_with_max_time_the_final_eval_scores_too_and_the_run_ends_in_time(
    tmp_path, data_root, clock
):
    """Scoring the items takes as long as 80 steps: the estimate of the final eval must count them,
    else the run ends late (on the test's clock: the same on a busy machine)."""
    items = char_items(tmp_path, 100)
    result = train.train(
        tiny(
            tmp_path,
            data_root,
            max_iters=10**6,
            eval_interval=10**6,
            max_time=10.0,
            hellaswag=items,
        )
    )
    assert clock[0] <= 10 and result["step"] > 50
    assert "hellaswag_acc" in result and result["stop_signal"] == 0


TRAIN = """import json, os, sys, train
result = train.train(train.parse_args(sys.argv[1:]))
with open(f"{__file__}.{os.environ['RANK']}", "w") as f:  # main.py.0 and .1: prints interleave
    json.dump(result, f)
"""


@pytest.mark.slow
def test_under_torchrun_the_ranks_share_the_scoring_and_each_has_the_counts_of_one(
    tmp_path, data_root
):
    """A file that one process scores in 8 s, more than --ddp-timeout 5: two processes each score
    half, so neither waits on the other for it; and each has the counts of all, as one process
    counts them."""
    started = time.time()
    score(GPT(tiny(tmp_path, data_root).model_config(65)), char_items(tmp_path, 200))
    copies = math.ceil(8.0 / (time.time() - started)) * 200 + 1  # odd: the ranks' shares differ
    (tmp_path / "main.py").write_text(TRAIN)
    flags = "--max-iters 1 --eval-interval 1 --threads 1 --dtype float32 --ddp-timeout 5".split()
    proc = script(
        *"-m torch.distributed.run --standalone --nproc-per-node 2".split(),
        tmp_path / "main.py",
        *tiny_args(tmp_path, data_root, *flags, "--hellaswag", char_items(tmp_path, copies)),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = score(model_from(load_checkpoint(tmp_path / "run")), char_items(tmp_path))
    for rank in "01":
        result = json.loads((tmp_path / f"main.py.{rank}").read_text())
        assert result.items() >= (want | {"hellaswag_items": 5 * copies}).items()
