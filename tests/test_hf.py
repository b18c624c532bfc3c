"""model/hf.py: Hugging Face GPT-2 folders and hub ids into our GPT, and runs out to transformers.

Each way is checked against transformers itself: the same logits, the same token ids, the same
greedy text, the same loss.
"""

import json
import os
from dataclasses import asdict

import numpy as np
import pytest
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from conftest import hf_tiny, one_error_line, script, tiny
from safetensors.torch import load_file, save_file

import sample
import train
from configs import UserError
from data.loader import read_tokens
from data.prepare import prepare
from data.tokenizer import CharTokenizer, GPT2Tokenizer
from model.checkpoint import load_checkpoint, model_from, save_checkpoint
from model.gpt import GPT, GPTConfig
from model.hf import GPT2_MANIFEST, export, load_gpt2, main

EXPORTED = ["config.json", "manifest.json", "model.safetensors", "tokenizer.json"]
EXPORTED.append("tokenizer_config.json")


def sharpen(run) -> None:
    """Give a run's best.pt sharp random weights, so that greedy text varies from token to
    token."""
    checkpoint = load_checkpoint(run)
    model = model_from(checkpoint)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    checkpoint["model"] = model.state_dict()
    save_checkpoint(checkpoint, run / "best.pt")


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, data_root):
    """A tiny char run of GPT-2's shape (trained, then sharpened)."""
    folder = tmp_path_factory.mktemp("char")
    fields = dict(pos_emb="learned", activation="gelu", bias=True, threads=1)
    train.train(tiny(folder, data_root, **fields))
    sharpen(folder / "run")
    return folder / "run"


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A tiny run on shakespeare in GPT-2's tokens (trained, then sharpened)."""
    folder = tmp_path_factory.mktemp("gpt2")
    prepare("shakespeare", root=str(folder), quiet=True)
    cfg = tiny(folder, folder, dataset="shakespeare", n_layer=1, n_embd=16, threads=1)
    train.train(cfg)
    sharpen(folder / "run")
    return folder / "run"


def sample_greedy(capsys, *argv, n: int) -> str:
    """sample.py's output at temperature 0, n new tokens."""
    sample.main([*map(str, argv), "--temperature", "0", "--max-new-tokens", str(n)])
    return capsys.readouterr().out


def assert_same_logits(ours: GPT, hf, vocab: int) -> None:
    x = torch.randint(
        0, vocab, (2, ours.config.block_size), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():  # the same sums in float32, in another order
        expected = hf(x).logits
        got = ours.eval()(x)[0][..., : expected.size(-1)]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------ load_gpt2


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("form", ["safetensors", "pytorch_model.bin", "bare keys"])
def test_load_gpt2_of_a_transformers_folder_gives_its_logits(tmp_path, tie, form):
    hf = hf_tiny(tie)
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in state) == (not tie)  # transformers leaves a tied head out
    if form == "pytorch_model.bin":  # what older transformers wrote
        (tmp_path / "model.safetensors").unlink()
        torch.save(state, tmp_path / "pytorch_model.bin")
    if form == "bare keys":  # as the hub's gpt2 has them: no "transformer.", old mask buffers
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        for i in range(2):
            state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 24, 24)
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        save_file(state, tmp_path / "model.safetensors")
    ours, manifest = load_gpt2(str(tmp_path), dropout=0.25)
    assert manifest == GPT2_MANIFEST == {"tokenizer": "gpt2", "vocab_size": 50257, "chars": None}
    assert asdict(ours.config) == asdict(GPTConfig(37, 24, 2, 2, 16, dropout=0.25, tie_weights=tie))
    assert (ours.lm_head.weight is ours.transformer.wte.weight) == tie
    assert_same_logits(ours, hf, 37)


def test_a_config_without_positions_or_tying_takes_gpt2s(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=37, n_positions=1024, n_embd=16, n_layer=1, n_head=2
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    keep = {k: saved[k] for k in ("vocab_size", "n_layer", "n_head", "n_embd")}
    (tmp_path / "config.json").write_text(json.dumps(keep))
    ours, _ = load_gpt2(str(tmp_path))
    assert ours.config.block_size == 1024 and ours.config.tie_weights
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert_same_logits(ours, hf, 37)


def test_a_folder_of_exact_gelu_loads_as_gelu_exact(tmp_path):
    hf = hf_tiny(activation_function="gelu")  # transformers' "gelu" is the exact one
    hf.save_pretrained(tmp_path)
    ours, _ = load_gpt2(str(tmp_path))
    assert ours.config.activation == "gelu_exact"
    assert_same_logits(ours, hf, 37)


def test_a_cached_hub_id_loads_without_the_network(hub_cache, network_calls):
    hf = hf_tiny(False)
    hub_cache("tiny-org/tiny-gpt2", hf)
    ours, manifest = load_gpt2("tiny-org/tiny-gpt2")
    assert manifest == GPT2_MANIFEST and network_calls == []
    assert_same_logits(ours, hf, 37)


def test_a_hub_id_not_cached_offline_is_one_line_naming_hf_download(hub_cache, network_calls):
    hub_cache("tiny-org/other", hf_tiny())  # the cache holds another model only
    with pytest.raises(UserError) as e:
        load_gpt2("tiny-org/absent")
    message = str(e.value)
    assert "\n" not in message and network_calls  # the hub was asked, and refused
    assert message.startswith("--init-from tiny-org/absent: no such folder, and the hub did not ")
    assert message.endswith(
        "; where there is internet, `hf download tiny-org/absent --include '*.json' --include "
        "'*.safetensors' --local-dir models/tiny-org/absent`, then --init-from "
        "models/tiny-org/absent"
    )


def break_config(folder):
    (folder / "config.json").write_text('{"vocab_size": 37,')


def other_shape(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"n_embd": 32}))


def missing_weight(folder):
    state = load_file(folder / "model.safetensors")
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, folder / "model.safetensors")


def other_model(folder):
    state = load_file(folder / "model.safetensors")
    save_file(
        state | {"transformer.h.0.attn.q_norm.weight": torch.ones(8)}, folder / "model.safetensors"
    )


def relu(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"activation_function": "relu"}))


def truncated(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "spoil, says",
    [
        (lambda folder: (folder / "config.json").unlink(), "(FileNotFoundError: "),
        (break_config, "(JSONDecodeError: "),
        (lambda folder: (folder / "model.safetensors").unlink(), "pytorch_model.bin"),
        (other_shape, "(RuntimeError: Error(s) in loading state_dict for GPT"),
        (missing_weight, 'Missing key(s) in state_dict: "transformer.h.1.mlp.c_fc.weight"'),
        (other_model, 'Unexpected key(s) in state_dict: "transformer.h.0.attn.q_norm.weight"'),
        (truncated, "(SafetensorError: "),
        (relu, "(KeyError: 'relu')"),
    ],
    ids=[
        "no config.json",
        "bad config.json",
        "no weights",
        "other shape",
        "missing weight",
        "other model",
        "truncated",
        "relu",
    ],
)
def test_a_folder_that_is_not_gpt2_is_one_line(tmp_path, spoil, says):
    hf_tiny().save_pretrained(tmp_path)
    spoil(tmp_path)
    with pytest.raises(UserError) as e:
        load_gpt2(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"{tmp_path} is not a Hugging Face GPT-2 folder (")
    assert "\n" not in message and says in message


# ------------------------------------------------------------------ export


def test_an_exported_char_run_loads_in_transformers_with_our_logits_tokens_and_text(
    char_run, tmp_path, capsys, network_calls
):
    out = tmp_path / "hf"
    main(["export", str(char_run), str(out)])
    assert capsys.readouterr().out == (
        f"wrote {out}: {', '.join(EXPORTED)}\n"
        f"load it with transformers: AutoModelForCausalLM.from_pretrained('{out}'), "
        f"AutoTokenizer.from_pretrained('{out}')\n"
    )
    checkpoint = load_checkpoint(char_run)
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["n_positions"], config["n_layer"]) == (65, 32, 2)
    assert json.loads((out / "manifest.json").read_text()) == checkpoint["manifest"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.eos_token_id is None and hf.config.tie_word_embeddings
    assert_same_logits(model_from(checkpoint), hf, 65)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = CharTokenizer(checkpoint["manifest"]["chars"])
    text = "ROMEO:\nO, speak  again, bright angel!\n\n  What's 3?"
    ids = tok(text).input_ids
    assert ids == ours.encode(text) and tok.decode(ids) == text
    with pytest.raises(Exception, match="UNK"):  # a character it lacks: refused, as ours does
        tok("ROMEO: ☃")
    assert len(tok) == 65 and tok.eos_token is None and tok.model_max_length == 32

    prompt = "ROMEO:"
    greedy = hf.generate(
        tok(prompt, return_tensors="pt").input_ids,
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
    )
    expected = tok.decode(greedy[0])
    assert expected.startswith(prompt) and len(set(expected[len(prompt) :])) > 4
    assert sample_greedy(capsys, "--out-dir", char_run, "--prompt", prompt, n=16) == expected + "\n"
    # and back: the export samples as the run does
    assert sample_greedy(capsys, "--init-from", out, "--prompt", prompt, n=16) == expected + "\n"
    assert network_calls == []


def test_an_exported_gpt2_run_has_gpt2s_tokenizer_in_transformers(gpt2_run, tmp_path, capsys):
    out = export(str(gpt2_run), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    config = hf.config
    assert (config.bos_token_id, config.eos_token_id, config.vocab_size) == (50256, 50256, 50257)
    assert_same_logits(model_from(load_checkpoint(gpt2_run)), hf, 50257)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert (tok.eos_token_id, len(tok)) == (50256, 50257)
    bpe = GPT2Tokenizer()
    text = "ROMEO: I'll say it's 2024 —  naïve 日本 🤗!\n\n\tend  \n  "
    ids = tok(text).input_ids
    assert ids == bpe.encode(text) and tok.decode(ids) == text
    assert tok("a<|endoftext|>b").input_ids == [64, 50256, 65]
    alone = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))  # without transformers
    assert alone.encode("a<|endoftext|>b").ids == [64, 50256, 65]

    prompt = "ROMEO: Hello"
    greedy = hf.generate(
        tok(prompt, return_tensors="pt").input_ids, max_new_tokens=12, do_sample=False
    )
    expected = tok.decode(greedy[0], skip_special_tokens=True)
    new = greedy[0, len(bpe.encode(prompt)) :].tolist()
    assert len(set(new)) > 4  # varied text, or equality would prove little
    out = sample_greedy(capsys, "--out-dir", gpt2_run, "--prompt", prompt, n=12)
    assert out == expected + "\n" * (not expected.endswith("\n"))


@pytest.mark.parametrize(
    "shape",
    [dict(pos_emb="rope"), dict(activation="gelu_exact"), dict(bias=False)],
    ids=["rope", "gelu_exact", "no bias"],
)
def test_a_run_not_of_gpt2s_shape_is_refused_naming_the_flags(tmp_path, shape):
    config = GPTConfig(65, 8, 1, 2, 16, **shape)
    manifest = {"tokenizer": "char", "vocab_size": 65, "chars": "".join(map(chr, range(40, 105)))}
    checkpoint = {"model": GPT(config).state_dict(), "model_config": asdict(config)}
    save_checkpoint(checkpoint | {"manifest": manifest}, tmp_path / "run.pt")
    with pytest.raises(UserError) as e:
        export(str(tmp_path / "run.pt"), str(tmp_path / "hf"))
    assert str(e.value) == (
        f"{tmp_path / 'run.pt'} lacks GPT-2's learned positions, tanh GELU or biases; train with "
        "--pos-emb learned --activation gelu --bias for a run that exports"
    )
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]  # nothing written
    if "pos_emb" in shape:  # as a user runs it: one line
        proc = script("-m", "model.hf", "export", tmp_path / "run.pt", tmp_path / "hf")
        assert "--pos-emb learned --activation gelu --bias" in one_error_line(proc)


def test_exporting_into_a_folder_of_other_files_is_refused(char_run, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for target in tmp_path / "mine", char_run, tmp_path / "file":
        before = sorted(os.listdir(target)) if target.is_dir() else None
        with pytest.raises(UserError) as e:
            export(str(char_run), str(target))
        assert str(e.value) == (
            f"{target} holds something else than an export; export into a new folder"
        )
        assert (sorted(os.listdir(target)) if target.is_dir() else None) == before
    assert (tmp_path / "file").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["file", "mine"]  # no temporary folder left
    (tmp_path / "empty").mkdir()  # an empty folder is as good as a new one
    assert sorted(os.listdir(export(str(char_run), str(tmp_path / "empty")))) == EXPORTED


def test_exporting_again_replaces_an_earlier_export_whole(char_run, gpt2_run, tmp_path):
    out = export(str(gpt2_run), str(tmp_path / "hf"))
    assert export(str(char_run), str(out)) == out
    assert sorted(os.listdir(out)) == EXPORTED and sorted(os.listdir(tmp_path)) == ["hf"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 65
    assert json.loads((out / "manifest.json").read_text())["tokenizer"] == "char"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("ROMEO").input_ids == CharTokenizer(
        load_checkpoint(char_run)["manifest"]["chars"]
    ).encode("ROMEO")
    (out / "README.md").write_text("a card the user wrote beside an export")  # not the export's own
    with pytest.raises(UserError, match="holds something else than an export"):
        export(str(char_run), str(out))
    assert (out / "README.md").is_file()


def test_a_padded_vocabulary_exports_only_the_tokenizers_rows(tmp_path, data_root):
    train.train(tiny(tmp_path, data_root, vocab_size=80, tie_weights=False, max_iters=2, threads=1))
    run = tmp_path / "run"
    ours = model_from(load_checkpoint(run))
    assert ours.lm_head.weight.shape == (80, 16)
    out = export(str(run), str(tmp_path / "hf"))
    state = load_file(out / "model.safetensors")
    assert state["transformer.wte.weight"].shape == state["lm_head.weight"].shape == (65, 16)
    assert torch.equal(state["lm_head.weight"], ours.lm_head.weight[:65])
    assert torch.equal(state["transformer.wte.weight"], ours.transformer.wte.weight[:65])
    assert torch.equal(
        state["transformer.h.0.attn.c_attn.weight"], ours.transformer.h[0].attn.c_attn.weight.t()
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.vocab_size == 65 and not hf.config.tie_word_embeddings
    assert_same_logits(ours, hf, 65)  # our logits of the tokenizer's 65 ids


def hf_loss(hf, path, block: int, windows: int | None = None) -> float:
    """transformers' mean loss per token on the windows at 0, block, 2 x block... of a token
    file (the first `windows` of them), as train.py's evaluate() reads them."""
    tokens = torch.from_numpy(read_tokens(path).astype(np.int64))
    starts = list(range(0, len(tokens) - block, block))[:windows]
    rows = torch.stack([tokens[s : s + block + 1] for s in starts])
    with torch.no_grad():
        logits = torch.cat([hf(chunk[:, :-1]).logits for chunk in rows.split(512)])
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()


def test_init_from_an_export_trains_on_and_eval_only_equals_transformers_loss(
    char_run, tmp_path, data_root, capsys
):
    out = export(str(char_run), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    val = data_root / "shakespeare_char" / "val.bin"

    result = train.train(
        tiny(tmp_path, data_root, eval_only=True, init_from=str(out), dtype="float32", threads=1)
    )
    assert result["val_loss"] == pytest.approx(hf_loss(hf, val, 32), abs=1e-4)  # 871 batches
    assert f"{out} on shakespeare_char, windows of 32:" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # eval-only writes nothing

    result = train.train(
        tiny(
            tmp_path,
            data_root,
            init_from=str(out),
            dtype="float32",
            max_iters=2,
            eval_interval=2,
            threads=1,
        )
    )
    assert result["step"] == 2 and (tmp_path / "run" / "ckpt.pt").is_file()
    assert load_checkpoint(tmp_path / "run")["manifest"] == load_checkpoint(char_run)["manifest"]


def test_an_export_says_what_transformers_and_the_hub_read_and_the_cli_names_itself(
    gpt2_run, tmp_path, capsys
):
    """The fields the hub's widgets and transformers read besides the shape: the architecture,
    GPT-2's tanh GELU, no dropout, the end-of-text id, and safetensors' "pt" format."""
    from safetensors import safe_open

    out = export(str(gpt2_run), str(tmp_path / "hf"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert config["activation_function"] == "gelu_new"
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.0
    assert config["bos_token_id"] == config["eos_token_id"] == 50256
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m model.hf [-h] {export}")
    with pytest.raises(UserError, match="invalid choice: 'import'"):
        main(["import", str(gpt2_run), str(tmp_path / "x")])
