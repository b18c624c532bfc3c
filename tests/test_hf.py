"""model/hf.py: Hugging Face GPT-2 folders and hub ids into our GPT, and runs out to transformers.

Each way is checked against transformers itself: the same logits, the same token ids, the same
greedy text, the same loss.
"""

import json
import re
import runpy
import sys

import pytest
import tokenizers
import torch
from conftest import hf_tiny, in_process, one_error_line, rows, tiny
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_config import refused  # the one line of a UserError
from test_sample import CHAR, char_run, sample_py, saved  # noqa: F401  # char_run: the fixture run
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

import sample
import train
from data.loader import read_tokens
from data.prepare import read_manifest
from data.tokenizer import tokenizer
from model.checkpoint import load_checkpoint, model_from
from model.gpt import GPTConfig
from model.hf import GPT2_MANIFEST, export, load_gpt2, main

EXPORTED = (
    "config.json manifest.json model.safetensors tokenizer.json tokenizer_config.json".split()
)


def assert_same_logits(ours, hf):
    torch.manual_seed(0)
    x = torch.randint(hf.config.vocab_size, (2, ours.config.block_size))
    with torch.no_grad():  # the same sums in float32, in another order
        torch.testing.assert_close(
            ours.eval()(x)[0][..., : hf.config.vocab_size],
            hf.eval()(x).logits,
            atol=1e-4,
            rtol=1e-5,
        )


@pytest.mark.parametrize("case", "tied untied bin bare-keys bare-config gelu hub".split())
def test_load_gpt2_of_a_folder_or_a_cached_hub_id_gives_transformers_logits(
    case, tmp_path, hub_cache, network_calls
):
    tie = case != "untied"
    hf = hf_tiny(tie, activation_function="gelu" if case == "gelu" else "gelu_new")  # gelu: exact
    bare = '{"vocab_size": 37, "n_layer": 2, "n_head": 2, "n_embd": 16}'  # no positions, tying
    if case == "bare-config":  # a config.json without n_positions or tying: GPT-2's
        hf = GPT2LMHeadModel(GPT2Config(**json.loads(bare)))
    hf.save_pretrained(tmp_path)
    hub_cache("tiny-org/tiny-gpt2", hf)
    state = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in state) != tie  # transformers leaves a tied head out
    if case == "bin":  # what older transformers wrote
        (tmp_path / "model.safetensors").unlink()
        torch.save(state, tmp_path / "pytorch_model.bin")
    if case == "bare-keys":  # as the hub's gpt2 has them: no "transformer.", old mask buffers
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        state |= {"h.0.attn.bias": torch.ones(1, 1, 24, 24), "h.1.attn.masked_bias": torch.ones(())}
        save_file(state, tmp_path / "model.safetensors")
    if case == "bare-config":
        (tmp_path / "config.json").write_text(bare)
    ours, manifest = load_gpt2("tiny-org/tiny-gpt2" if case == "hub" else tmp_path, 0.25)
    assert manifest == GPT2_MANIFEST  # GPT-2's tokenizer: the (50257) below, and the export's text
    assert ours.config == GPTConfig(  # n_positions: 1024 for the bare config
        37,
        hf.config.n_positions,
        2,
        2,
        16,
        0.25,
        activation="gelu_exact" if case == "gelu" else "gelu",
        tie_weights=tie,
    )
    assert (ours.lm_head.weight is ours.transformer.wte.weight) == tie
    assert_same_logits(ours, hf)
    assert network_calls == []
    # GPT-2's tokenizer has 50257 tokens: sample.py cannot draw with these 37 rows
    assert refused(f"--init-from {tmp_path}".split(), sample.main) == (
        "the model's vocabulary (37) is smaller than its tokenizer's (50257); "
        "train one with --vocab-size 50257 or more"
    )
    if case == "hub":  # an id the cache lacks, offline: one line naming hf download
        assert re.fullmatch(
            "--init-from tiny-org/absent: no such folder, and the hub did not .*; where there is "
            r"internet, `hf download tiny-org/absent --include '\*\.json' --include "
            r"'\*\.safetensors' --local-dir models/tiny-org/absent`, then --init-from "
            "models/tiny-org/absent",
            refused("tiny-org/absent", load_gpt2),
        )
        assert network_calls  # the hub was asked, and refused


SHAPE = '"vocab_size": 37, "n_positions": 24, "n_layer": 2, "n_head": 2'
# a file of a GPT-2 folder | its change: "-" removes it, text replaces it, -KEY or +KEY leaves
# out or adds a weight | what the one line says in its parentheses
BROKEN = f"""model.safetensors | - | pytorch_model.bin
model.safetensors | not safetensors | (SafetensorError:
model.safetensors | -transformer.h.1.mlp.c_fc.weight | \
Missing key(s) in state_dict: "transformer.h.1.mlp.c_fc.weight"
model.safetensors | +transformer.h.0.attn.q_norm.weight | \
Unexpected key(s) in state_dict: "transformer.h.0.attn.q_norm.weight"
config.json | - | (FileNotFoundError:
config.json | {{{SHAPE} | (JSONDecodeError:
config.json | {{{SHAPE}, "n_embd": 32}} | (RuntimeError: Error(s) in loading
config.json | {{{SHAPE}, "n_embd": 16, "activation_function": "relu"}} | (KeyError: 'relu')"""


@pytest.mark.parametrize("file, change, says", rows(BROKEN))
def test_a_folder_that_is_not_gpt2_is_one_line(tmp_path, file, change, says):
    hf_tiny().save_pretrained(tmp_path)
    path = tmp_path / file
    if change == "-":
        path.unlink()
    elif change[0] in "-+":
        state = load_file(path) | {change[1:]: torch.ones(8)}
        save_file({k: v for k, v in state.items() if change != "-" + k}, path)
    else:
        path.write_text(change)
    message = refused(tmp_path, load_gpt2)
    assert (
        message.startswith(f"{tmp_path} is not a Hugging Face GPT-2 folder (") and says in message
    )


@pytest.mark.parametrize("kind", ["char", "gpt2", "padded"])  # padded: 80 rows, 65 ids; untied
def test_an_export_loads_in_transformers_with_our_logits_tokens_and_text(
    kind, tmp_path, network_calls
):
    manifest = GPT2_MANIFEST if kind == "gpt2" else CHAR
    padded = kind == "padded"
    run = saved(
        tmp_path / "run.pt", manifest, **dict(vocab_size=80, tie_weights=False) if padded else {}
    )
    (out := tmp_path / "hf").mkdir()  # an empty folder is as good as a new one
    assert in_process(main, "export", run, out).stdout == (
        f"wrote {out}: {', '.join(EXPORTED)}\n"
        f"load it with transformers: AutoModelForCausalLM.from_pretrained('{out}'), "
        f"AutoTokenizer.from_pretrained('{out}')\n"
    )
    assert json.loads((out / "manifest.json").read_text()) == manifest
    vocab, eot = manifest["vocab_size"], 50256 if kind == "gpt2" else None
    # what transformers and the hub read: the shape, GPT-2's tanh GELU, no dropout, end-of-text
    # (the vocabulary, the tying, the shape: from_pretrained and the logits below hold them)
    fields = {"bos_token_id": eot, "eos_token_id": eot} | json.loads(
        '{"architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new", "n_layer": 2, '
        '"n_positions": 32, "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0}'
    )
    assert json.loads((out / "config.json").read_text()).items() >= fields.items()
    assert safe_open(out / "model.safetensors", "pt").metadata() == {"format": "pt"}
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert_same_logits(model_from(load_checkpoint(run)), hf)

    tok = AutoTokenizer.from_pretrained(out)
    assert (len(tok), tok.eos_token_id, tok.model_max_length) == (vocab, eot, 32)
    text = (
        "ROMEO: I'll say it's 2024 —  naïve 日本 🤗!\n\n\tend  \n  "
        if eot
        else "ROMEO:\nO, speak  again, bright angel!\n\n  What's 3?"
    )
    ids = tok(text).input_ids
    assert ids == tokenizer(manifest, vocab).encode(text) and tok.decode(ids) == text
    if eot:  # end-of-text is special, to transformers and to tokenizers alone
        alone = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
        assert (
            tok("a<|endoftext|>b").input_ids == alone.encode("a<|endoftext|>b").ids == [64, eot, 65]
        )
        assert tok.eos_token == tok.bos_token == "<|endoftext|>"
        (out / "manifest.json").unlink()  # as in a GPT-2 folder transformers wrote
    else:
        with pytest.raises(Exception, match="UNK"):  # a character it lacks: refused, as ours does
            tok("ROMEO: ☃")

    ids = tok("ROMEO:", return_tensors="pt").input_ids
    greedy = hf.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0]
    assert len(set(greedy[ids.size(1) :].tolist())) > 4  # varied text, or equality proves little
    expected = tok.decode(greedy, skip_special_tokens=True)
    for weights in f"--out-dir {run}", f"--init-from {out}":  # and back: the export samples alike
        text = sample_py(weights + " --prompt ROMEO: --temperature 0 --max-new-tokens 16")
        assert text == expected + "\n" * (not expected.endswith("\n"))
    assert network_calls == []


def test_an_export_of_other_shape_or_over_other_files_is_refused_and_replaces_one_whole(
    run, tmp_path, monkeypatch
):
    files = lambda *folders: {  # each file and folder under them, by its path in its folder
        str(p.relative_to(f)): p.is_file() and p.read_bytes() for f in folders for p in f.rglob("*")
    }
    for shape in {"pos_emb": "rope"}, {"activation": "gelu_exact"}, {"bias": False}:
        bad = saved(tmp_path / "run.pt", **shape)
        assert (message := refused(bad, lambda bad: export(bad, tmp_path / "hf"))) == (
            f"{bad} lacks GPT-2's learned positions, tanh GELU or biases; train with "
            "--pos-emb learned --activation gelu --bias for a run that exports"
        )
        assert [*files(tmp_path)] == ["run.pt"]  # nothing written
    # as a user runs python -m model.hf: one line
    monkeypatch.setattr(sys, "argv", f"model/hf.py export {bad} {tmp_path / 'hf'}".split())
    monkeypatch.delitem(sys.modules, "model.hf")  # run afresh as __main__
    proc = in_process(lambda argv: runpy.run_module("model.hf", run_name="__main__"))
    assert one_error_line(proc) == f"error: {message}"

    out = export(saved(tmp_path / "gpt2.pt", GPT2_MANIFEST), tmp_path / "hf")
    assert export(run, out) == out  # an earlier export: replaced whole
    assert files(out) == files(export(run, tmp_path / "fresh")) and sorted(files(out)) == EXPORTED
    (out / "README.md").write_text("a card the user wrote beside an export: not the export's")
    before = files(tmp_path, run)
    for target in out, tmp_path, run, bad:  # bad: a file; tmp_path, run: folders of other files
        assert refused(target, lambda target: export(run, target)) == (
            f"{target} holds something else than an export; export into a new folder"
        )
    assert files(tmp_path, run) == before  # as they were, and no temporary folder left
    assert in_process(main, "--help").stdout.startswith("usage: python -m model.hf [-h] {export}")
    assert "invalid choice: 'import'" in refused(f"import {run} {out}".split(), main)


def test_init_from_an_export_trains_on_and_eval_only_equals_transformers_loss(
    run, tmp_path, data_root, capsys
):
    out = export(run, tmp_path / "hf")
    # transformers' mean loss on the windows at 0, 32, 64... of val, as evaluate() reads them
    val = torch.from_numpy(read_tokens(data_root / "shakespeare_char/val.bin").astype("int64"))
    rows = val.unfold(0, 33, 32)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out)(rows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.mT, rows[:, 1:]).item()
    kw = dict(init_from=str(out), dtype="float32", eval_batch_size=512)
    result = train.train(tiny(tmp_path, data_root, eval_only=True, **kw))
    assert result["val_loss"] == pytest.approx(expected, abs=1e-4)
    assert f"{out} on shakespeare_char, windows of 32:" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # eval-only writes nothing
    assert train.train(tiny(tmp_path, data_root, max_iters=2, eval_interval=2, **kw))["step"] == 2
    manifest = load_checkpoint(tmp_path / "run/ckpt.pt")["manifest"]
    assert manifest == read_manifest(data_root / "shakespeare_char")  # its own, not the export's
