"""HellaSwag-style evaluation: our log-likelihoods and accuracies against transformers' GPT-2, bad items, and the
commands that score it (--eval-only --hellaswag, and --hellaswag-interval during training)."""

import json
from unittest import mock

import pytest
import torch

import train
from configs.errors import UserError
from configs.model import GPTConfig
from data.tokenizer import CharTokenizer, GPT2Tokenizer
from model.gpt import GPT
from model.hf import save_hf_gpt2
from training import hellaswag
from training.runtime import setup

GPT2_SHAPE = dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True, qk_norm=False, tie_weights=True)
ITEMS = [  # the last context is longer than the test model's block, so its left is cut
    {"ind": 4, "ctx": "A man is sitting on a roof. He", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
    {"ind": 9, "ctx": "The woman pours water into the kettle and", "label": "0",
     "endings": ["switches it on.", "throws it out of the window.", "eats the kettle.", "sings to the water."]},
    {"ind": 11, "ctx": "Two dogs run across the field " * 6 + "and then", "label": 2,
     "endings": ["they stop.", "they fly to the moon on a bicycle made of cheese.", "they play.", "a b c d"]},
]


def write_items(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def reference_loglik(hf, ctx, end, block):
    """transformers' GPT-2 alone: the ending's summed log-probability, with the context cut on the left to fit."""
    ids = (ctx + end)[-(block + 1):]
    n = min(len(end), len(ids) - 1)
    logp = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0].double(), -1)  # (T, V)
    return sum(logp[t, ids[t + 1]].item() for t in range(len(ids) - 1 - n, len(ids) - 1)), n


def test_log_likelihoods_and_accuracies_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # a padded vocabulary, as the gpt2 preset's: its extra logits must not count, and the export drops them
    ours = GPT(GPTConfig(vocab_size=50304, block_size=24, n_layer=2, n_head=2, n_embd=16, dropout=0.0,
                         **GPT2_SHAPE)).eval()
    save_hf_gpt2(ours, tmp_path / "hf", vocab_size=50257)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tok = GPT2Tokenizer()
    items = hellaswag.load_items(str(write_items(tmp_path / "items.jsonl", ITEMS)), tok)
    assert any(len(ctx) + max(map(len, ends)) > 25 for ctx, ends, _ in items)  # the left cut is exercised
    assert items[0][:2] == (tok.encode(ITEMS[0]["ctx"]), [tok.encode(" " + e) for e in ITEMS[0]["endings"]])

    pairs = [(ctx, end) for ctx, ends, _ in items for end in ends]
    rt = setup(device="cpu", dtype="float32", seed=None)
    rt.threads = mock.Mock()  # scoring adjusts the CPU threads once per batch, as evaluate() does
    total, count = hellaswag.ending_loglik(ours, pairs, 50257, rt)
    with torch.no_grad():
        expected = [reference_loglik(hf, ctx, end, 24) for ctx, end in pairs]
    assert count.tolist() == [n for _, n in expected]
    torch.testing.assert_close(total.double(), torch.tensor([s for s, _ in expected], dtype=torch.double),
                               atol=1e-4, rtol=0)

    sums = torch.tensor([s for s, _ in expected]).view(-1, 4)
    per_token = sums / torch.tensor([n for _, n in expected]).view(-1, 4)
    labels = torch.tensor([label for *_, label in items])
    for batch_rows in (4, 8):  # one item a batch, and two
        assert hellaswag.score(ours, items, 50257, rt, batch_rows) == {
            "hellaswag_acc": (sums.argmax(1) == labels).float().mean().item(),
            "hellaswag_acc_norm": (per_token.argmax(1) == labels).float().mean().item(), "hellaswag_items": 3}
    assert rt.threads.update.call_count == 1 + 3 + 2


@pytest.mark.parametrize("change, message", [
    ({"endings": ["a", "b", "c"]}, "needs four non-empty endings"),
    ({"endings": ["a", "", "c", "d"]}, "needs four non-empty endings"),
    ({"ctx": ""}, "needs a non-empty ctx, has ''"),
    ({"ctx": None}, "needs a non-empty ctx, has None"),
    ({"label": 4}, "label 4 is not 0, 1, 2 or 3"),
    ({"label": None}, "label None is not 0, 1, 2 or 3"),
])
def test_a_bad_item_is_one_line_naming_it(tmp_path, change, message):
    path = write_items(tmp_path / "items.jsonl", [ITEMS[0], ITEMS[1] | change])
    with pytest.raises(UserError, match=f"^HellaSwag item 1 \\(ind 9\\): {message}"):
        hellaswag.load_items(str(path), GPT2Tokenizer())


def test_text_a_char_model_cannot_encode_names_the_item(tmp_path):
    with pytest.raises(UserError, match="^HellaSwag item 0 \\(ind 4\\): text has .* not in this char vocabulary"):
        hellaswag.load_items(str(write_items(tmp_path / "items.jsonl", ITEMS)), CharTokenizer(list(" abc")))


@pytest.mark.parametrize("name", ["nope.jsonl", "nope.json"])
def test_a_missing_file_names_the_command_that_fetches_it(tmp_path, name):
    with pytest.raises(UserError, match=f"no file {tmp_path}/{name}; fetch .* with `curl -LO https://"):
        hellaswag.load_items(str(tmp_path / name), GPT2Tokenizer())


@pytest.mark.parametrize("text", ["not json\n", ""])
def test_a_file_that_is_not_json_lines_is_one_line_naming_it(tmp_path, text):
    (tmp_path / "items.jsonl").write_text(text)
    with pytest.raises(UserError, match=f"HellaSwag file {tmp_path}/items.jsonl: .*; check that it is JSON Lines$"):
        hellaswag.load_items(str(tmp_path / "items.jsonl"), GPT2Tokenizer())


def char_items(tmp_path):
    """Items in tinyshakespeare's characters, for the char-level tiny model."""
    items = [{"ind": i, "ctx": "ROMEO: I will", "label": i % 4,
              "endings": ["go.", "stay here.", "love thee.", "speak, my lord."]} for i in range(5)]
    return write_items(tmp_path / "items.jsonl", items)


def run_args(out_dir, data_root, *extra):
    return ["--config", "tiny", "--device", "cpu", "--sample-tokens", "0", "--max-iters", "4", "--eval-interval", "2",
            "--out-dir", str(out_dir), "--data-root", str(data_root), *extra]


def test_eval_only_prints_both_accuracies_and_the_item_count(tmp_path, data_root, capsys):
    assert train.main(run_args(tmp_path / "run", data_root)) == 0
    capsys.readouterr()
    items = char_items(tmp_path)
    assert train.main(run_args(tmp_path / "run", data_root, "--eval-only", "--hellaswag", str(items))) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out
    line = next(line for line in out.splitlines() if line.startswith("hellaswag"))
    words = line.split()
    acc, acc_norm = float(words[words.index("acc") + 1]), float(words[words.index("acc_norm") + 1])
    assert 0 <= acc <= 1 and 0 <= acc_norm <= 1 and line.endswith("items 5")


@pytest.mark.parametrize("interval, steps", [([], [0, 2, 4]), (["--hellaswag-interval", "4"], [0, 4])])
def test_training_scores_it_at_every_eval_or_every_interval_into_the_metrics(tmp_path, data_root, capsys, interval,
                                                                               steps):
    items = char_items(tmp_path)
    assert train.main(run_args(tmp_path / "run", data_root, "--hellaswag", str(items), *interval)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scored = [r["step"] for r in records if "hellaswag_acc_norm" in r]
    assert scored == steps and all(r["hellaswag_items"] == 5 for r in records if "hellaswag_acc" in r)
    assert "hellaswag acc_norm" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--hellaswag-interval", "3"], ["--hellaswag-interval", "2"]])
def test_an_interval_off_the_eval_steps_or_without_items_is_refused(tmp_path, data_root, capsys, extra):
    assert train.main(run_args(tmp_path / "run", data_root, *extra)) == 2
    assert "--hellaswag-interval scores --hellaswag SOURCE at eval steps" in capsys.readouterr().err


def test_a_hub_id_offline_names_the_command_that_fetches_it_and_a_cached_one_is_read(monkeypatch, network_calls):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as without HF_HUB_OFFLINE=1
    with pytest.raises(UserError, match=r"hub dataset 'Rowan/hellaswag'.*offline, fetch .* with `curl -LO https://"):
        hellaswag.load_items("Rowan/hellaswag", GPT2Tokenizer())
    asked = []  # when the hub is away, datasets is asked for its cached copy of the validation split

    def cached(name, subset, **kwargs):
        asked.append((name, kwargs["split"]))
        return datasets.Dataset.from_list([item | {"label": str(item["label"])} for item in ITEMS[:2]])

    monkeypatch.setattr(datasets, "load_dataset", cached)
    assert [label for *_, label in hellaswag.load_items("Rowan/hellaswag", GPT2Tokenizer())] == [3, 0]
    assert asked == [("Rowan/hellaswag", "validation")]
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: datasets.Dataset.from_list([]))
    with pytest.raises(UserError, match="^--hellaswag Rowan/hellaswag holds no items; fetch"):
        hellaswag.load_items("Rowan/hellaswag", GPT2Tokenizer())
