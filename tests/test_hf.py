"""Hugging Face round trips: transformers' GPT-2 parity both ways, hub ids from the cache,
exported runs that AutoTokenizer/AutoModelForCausalLM/pipeline use as sample.py does, eval-only."""

import errno
import json
import os
import re
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import pathspec
import pytest
import torch

import sample
import train
from configs import load_config
from configs.errors import UserError
from conftest import hf_tiny
from data.files import write_json
from data.prepare import prepare
from data.tokenfile import read_tokens
from model import GPT, GPTConfig
from model.checkpoint import save_checkpoint
from model.hf import export_run, load_hf_gpt2, main, resolve_init_from, save_hf_gpt2

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent
CHARS = "".join(sorted(set((REPO / "data/corpora/tinyshakespeare/input.txt").read_text())))


@pytest.mark.parametrize("tie", [True, False])
def test_ours_loads_a_transformers_checkpoint_and_matches_its_logits(tmp_path, tie):
    hf = hf_tiny(tie)
    hf.save_pretrained(tmp_path)
    ours = load_hf_gpt2(tmp_path).eval()
    x = torch.randint(0, 37, (2, 24))
    torch.testing.assert_close(ours(x)[0], hf(x).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("form", ["safetensors", "pytorch_model.bin", "shards", "hub names"])
def test_ours_loads_each_form_of_a_transformers_directory(tmp_path, form):
    hf = hf_tiny(False, n_inner=48, layer_norm_epsilon=1e-3, n_ctx=24)
    if form == "hub names":  # as the hub's gpt2 has it: no "transformer." prefix, old causal-mask buffers
        from safetensors.torch import save_file

        hf.config.save_pretrained(tmp_path)
        state = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items()}
        state |= {f"h.{i}.attn.{b}": torch.ones(1, 1, 24, 24) for i in range(2) for b in ("bias", "masked_bias")}
        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        hf.save_pretrained(tmp_path, max_shard_size="20KB" if form == "shards" else "5GB")
    if form == "pytorch_model.bin":  # what older transformers wrote
        (tmp_path / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert (tmp_path / "model.safetensors.index.json").is_file() == (form == "shards")
    ours = load_hf_gpt2(tmp_path, dropout=0.1).eval()
    c = ours.config
    assert (c.mlp_ratio, c.norm_eps, c.dropout, c.block_size, c.tie_weights) == (3, 1e-3, 0.1, 24, False)
    x = torch.randint(0, 37, (2, 24))
    torch.testing.assert_close(ours(x)[0], hf(x).logits, atol=1e-4, rtol=0)


def test_export_writes_gpt2s_config(tmp_path):
    model = GPT(GPTConfig(vocab_size=40, block_size=24, n_layer=2, n_head=2, n_embd=16, mlp_ratio=3,
                          norm_eps=1e-3, dropout=0.1, tie_weights=False))
    save_hf_gpt2(model, tmp_path / "deep" / "hf", eot_id=7, vocab_size=37)  # parents are made
    text = (tmp_path / "deep/hf/config.json").read_text()
    config = json.loads(text)
    assert text == json.dumps(config, indent=2) + "\n" and config == {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 37, "n_positions": 24,
                      "n_ctx": 24, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_inner": 48,
                      "activation_function": "gelu_new", "layer_norm_epsilon": 1e-3, "resid_pdrop": 0.1,
                      "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02, "tie_word_embeddings": False,
                      "bos_token_id": 7, "eos_token_id": 7}
    assert (tmp_path / "deep/hf/generation_config.json").read_text() == json.dumps(
        {"bos_token_id": 7, "eos_token_id": 7}, indent=2) + "\n"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "deep/hf/model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    save_hf_gpt2(GPT(GPTConfig(vocab_size=40, block_size=24, n_layer=1, n_head=2, n_embd=16)), tmp_path / "gpt2")
    assert json.loads((tmp_path / "gpt2/config.json").read_text())["n_inner"] is None  # GPT-2's own 4 x n_embd
    again = load_hf_gpt2(tmp_path / "deep/hf")
    assert again.lm_head.weight.shape == (37, 16) and torch.equal(again.lm_head.weight, model.lm_head.weight[:37])


@pytest.mark.parametrize("tie", [True, False])
def test_transformers_loads_our_export_and_matches_our_logits(tmp_path, tie):
    torch.manual_seed(1)
    ours = GPT(GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=2, n_embd=16, tie_weights=tie)).eval()
    save_hf_gpt2(ours, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 37, (2, 24))
    torch.testing.assert_close(hf(x).logits, ours(x)[0], atol=1e-4, rtol=0)
    again = load_hf_gpt2(tmp_path)  # and back: the round trip is exact
    for (k, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def random_run(path: Path, tokenizer: str, vocab: int, **arch) -> Path:
    """A run directory holding a random GPT (weights sharp enough that greedy text varies)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=32, **dict(n_layer=2, n_head=2, n_embd=16) | arch))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict()})
    manifest = ({"tokenizer": "char", "vocab_size": len(CHARS), "chars": CHARS, "eot_id": None} if tokenizer == "char"
                else {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256})
    write_json(path / "manifest.json", {"name": "t", **manifest})
    return path


# the BPE model's vocabulary (50304) is padded past the tokenizer's (50257): the export drops those rows
@pytest.mark.parametrize("tokenizer, vocab, tok_vocab, prompt", [("char", 65, 65, "ROMEO:\nO, "),
                                                                 ("gpt2", 50304, 50257, "ROMEO: Hello")])
def test_exported_run_generates_our_greedy_text_in_transformers(tmp_path, capsys, network_calls, tokenizer, vocab,
                                                                tok_vocab, prompt):
    run = random_run(tmp_path / "run", tokenizer, vocab)
    assert sample.main(["--ckpt", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "16",
                        "--device", "cpu", "--dtype", "float32"]) == 0
    ours = capsys.readouterr().out.removesuffix("\n")
    assert len(set(ours[len(prompt):])) > 3  # varied text, or equality would prove little

    with pytest.raises(UserError, match="into another directory"):
        export_run(run, run)  # its config.json would be overwritten
    out = export_run(run, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    eot = "<|endoftext|>" if tokenizer == "gpt2" else None
    assert (tok.bos_token, tok.eos_token, model.config.eos_token_id, model.generation_config.eos_token_id) == (
        eot, eot, tok.eos_token_id, tok.eos_token_id) and model.config.vocab_size == len(tok) == tok_vocab
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == sample.load(sample.parse_args(["--ckpt", str(run)]))[1].encode(prompt)  # our ids
    greedy = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert tok.decode(greedy[0], skip_special_tokens=True) == ours
    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    assert pipe(prompt, max_new_tokens=16, do_sample=False)[0]["generated_text"] == ours

    for back in (out, run):  # and back again, as --init-from: the export, and the run dir itself
        assert sample.main(["--init-from", str(back), "--prompt", prompt, "--temperature", "0",
                            "--max-new-tokens", "16", "--device", "cpu", "--dtype", "float32"]) == 0
        assert capsys.readouterr().out.removesuffix("\n") == ours
    assert network_calls == []


def test_modern_variant_refuses_to_export_naming_the_flags(tmp_path, capsys):
    from model.hf import main

    ours = GPT(GPTConfig(vocab_size=37, block_size=24, n_layer=1, n_head=2, n_embd=16, pos_emb="rope"))
    with pytest.raises(UserError, match="pos_emb=rope.*train with --pos-emb learned for a run that exports"):
        save_hf_gpt2(ours, tmp_path)
    run = random_run(tmp_path / "run", "char", 65, norm="rmsnorm", activation="relu2", qk_norm=True, bias=False)
    assert main(["export", str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "with --norm layernorm --activation gelu --bias --no-qk-norm for" in err
    assert "(norm=rmsnorm, activation=relu2, bias=False, qk_norm=True)" in err
    assert not (tmp_path / "hf").exists()  # refused before anything was written


def test_init_from_a_cached_hub_id_needs_no_network(hub_cache, network_calls, capsys):
    snapshot = hub_cache("tiny-org/tiny-gpt2", hf_tiny(vocab=50257))
    assert resolve_init_from("tiny-org/tiny-gpt2") == snapshot
    argv = ["--init-from", "tiny-org/tiny-gpt2", "--prompt", "Hello", "--max-new-tokens", "5", "--seed", "0"]
    assert sample.main(argv) == 0 and capsys.readouterr().out.startswith("Hello")
    assert network_calls == []


def test_init_from_an_uncached_hub_id_offline_is_one_line_naming_hf_download(hub_cache, network_calls, capsys):
    assert sample.main(["--init-from", "tiny-org/absent", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --init-from tiny-org/absent: ")
    assert "`hf download tiny-org/absent --include '*.json' --include '*.safetensors' --local-dir models/tiny-org/absent`" in err
    assert network_calls  # the hub was asked, once the cache had nothing
    assert _hf_cli_receives(re.search(r"`(hf download [^`]*)`", err)[1]) == dict(
        repo_id="tiny-org/absent", allow_patterns=["*.json", "*.safetensors"], local_dir="models/tiny-org/absent")
    with pytest.raises(UserError, match="no such directory: ./no/such/dir"):
        resolve_init_from("./no/such/dir")
    with pytest.raises(UserError, match="not a run directory .* nor a Hugging Face GPT-2 directory"):
        resolve_init_from(str(REPO / "tests"))


def _hf_cli_receives(command: str) -> dict:
    """What the installed `hf` CLI would pass to snapshot_download for command (its own parser; no network)."""
    import huggingface_hub.cli.download as download
    from huggingface_hub.cli.hf import app

    got: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        for fetch in ("snapshot_download", "hf_hub_download"):  # a pattern taken for a file name goes to the second
            mp.setattr(download, fetch, lambda fetch=fetch, **kwargs: got.update(kwargs, called=fetch) or "/nowhere")
        app.main(shlex.split(command)[1:], prog_name="hf", standalone_mode=False)
    assert got.pop("called") == "snapshot_download", got
    return {k: got[k] for k in ("repo_id", "allow_patterns", "local_dir")}


def test_a_missing_local_path_is_no_such_directory_not_a_hub_lookup(tmp_path, monkeypatch, network_calls):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for name in ["runs/mine", str(tmp_path / "gone"), "~/no/such/run", "models/org/model"]:
        with pytest.raises(UserError, match=f"--init-from {re.escape(name)}: no such directory: {re.escape(name)}"):
            resolve_init_from(name)
    assert network_calls == []


def test_eval_only_loss_equals_transformers_on_the_same_windows(tmp_path, hub_cache, network_calls, capsys):
    (tmp_path / "t.txt").write_text((REPO / "data/corpora/tinyshakespeare/input.txt").read_text()[:30000])
    ds = prepare(text=tmp_path / "t.txt", tokenizer="char", name="t", out_root=tmp_path, verbose=False)
    vocab = json.loads((ds / "manifest.json").read_text())["vocab_size"]
    hf = hf_tiny(vocab=vocab)
    hub_cache("tiny-org/tiny-gpt2", hf)
    # 124 val windows in batches of 7: the last batch is short, so the mean must weight by tokens
    cfg = load_config("tiny", ["--eval-only", "--init-from", "tiny-org/tiny-gpt2", "--device", "cpu",
                               "--dtype", "float32", "--block-size", "24", "--eval-batch-size", "7"])
    result = train.train(replace(cfg, dataset="t", data_root=str(tmp_path), out_dir=str(tmp_path / "out")))

    tokens = torch.from_numpy(read_tokens(ds / "val.bin").astype(np.int64))
    n = (len(tokens) - 1) // 24  # every whole window of 24 predictions, as evaluate() reads them
    x, y = tokens[: n * 24].view(n, 24), tokens[1 : n * 24 + 1].view(n, 24)  # (n * 24,) -> (n, 24) each
    with torch.no_grad():
        logits = hf(x).logits
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert result["val_loss"] == pytest.approx(reference, abs=1e-4)
    assert f"val   loss {reference:.4f}" in capsys.readouterr().out and network_calls == []


def test_not_a_checkpoint_directory_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        load_hf_gpt2(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="only GPT-2"):
        load_hf_gpt2(tmp_path)


def test_a_cached_hub_id_without_its_weights_is_not_taken_as_complete(hub_cache, network_calls):
    snapshot = hub_cache("tiny-org/no-weights", hf_tiny(vocab=50257))
    (snapshot / "model.safetensors").unlink()  # an interrupted download: config.json only
    with pytest.raises(UserError, match="no-weights"):
        load_hf_gpt2(resolve_init_from("tiny-org/no-weights"))
    assert network_calls  # it went to the hub for the rest instead of loading half a model


@pytest.mark.parametrize("tokenizer, vocab", [("char", 65), ("gpt2", 50304)])
def test_export_writes_these_files_from_best_pt(tmp_path, tokenizer, vocab):
    run = random_run(tmp_path / "run", tokenizer, vocab)
    best = random_run(tmp_path / "best", tokenizer, vocab, n_embd=24)
    (best / "ckpt.pt").rename(run / "best.pt")  # the run's lowest val loss: what is exported
    out = export_run(run, tmp_path / "new" / "hf")
    export_run(run, out)  # again, into the same directory: replaced
    bpe = ["merges.txt", "vocab.json"] if tokenizer == "gpt2" else []
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "generation_config.json", "manifest.json",
                                                            "model.safetensors", "tokenizer.json",
                                                            "tokenizer_config.json", *bpe])
    assert json.loads((out / "config.json").read_text())["n_embd"] == 24
    specials = dict.fromkeys(("bos_token", "eos_token", "unk_token"), "<|endoftext|>") if bpe else {}
    text = (out / "tokenizer_config.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2) + "\n"
    if bpe:  # GPT-2's own files, each under its own name
        from data.tokenizer import _bundled_gpt2_files

        vocab_bpe, encoder_json = _bundled_gpt2_files()
        assert (out / "merges.txt").read_bytes() == vocab_bpe.read_bytes()
        assert (out / "vocab.json").read_bytes() == encoder_json.read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32, "clean_up_tokenization_spaces": False,
        **specials}
    if not bpe:
        assert json.loads((out / "tokenizer.json").read_text())["model"]["unk_token"] == "[UNK]"


def test_an_old_minimal_config_json_takes_gpt2s_defaults(tmp_path):
    hf = hf_tiny(True)  # tied, as GPT-2 is
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    keep = {"vocab_size": 37, "n_ctx": 24, "n_layer": 2, "n_head": 2, "n_embd": 16}  # no model_type, n_positions...
    assert {k: config.get(k, 24) for k in keep} == keep
    (tmp_path / "config.json").write_text(json.dumps(keep))
    c = load_hf_gpt2(tmp_path).config
    assert (c.block_size, c.mlp_ratio, c.norm_eps, c.tie_weights) == (24, 4, 1e-5, True)
    del keep["n_ctx"]
    (tmp_path / "config.json").write_text(json.dumps(keep))
    with pytest.raises(UserError, match="config.json implies"):  # GPT-2's 1024 positions: not these weights
        load_hf_gpt2(tmp_path)
    long = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=37, n_positions=1024, n_embd=16, n_layer=1,
                                                                n_head=2))
    long.save_pretrained(tmp_path / "long")
    (tmp_path / "long/config.json").write_text(json.dumps({**keep, "n_layer": 1}))
    assert load_hf_gpt2(tmp_path / "long").config.block_size == 1024  # no n_positions, no n_ctx: GPT-2's


def test_weights_of_another_model_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_tiny(True).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["transformer.h.1.mlp.c_fc.weight"]  # missing, nothing unexpected
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"weights do not match GPT-2 \(missing \['transformer.h.1.mlp.c_fc.weight'\]"):
        load_hf_gpt2(tmp_path)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_export_refuses_a_target_holding_anything_but_an_earlier_export_of_the_same_run(tmp_path, capsys):
    run, other = random_run(tmp_path / "run", "char", 65), random_run(tmp_path / "other", "char", 65)
    write_json(other / "config.json", {"n_layer": 2})  # as train.py writes it: the run's own config
    hf_tiny(False).save_pretrained(tmp_path / "model", max_shard_size="20KB")  # another model, sharded...
    torch.save({}, tmp_path / "model/pytorch_model.bin")  # ...beside an older pickle
    export_run(other, tmp_path / "other_export")
    export_run(run, tmp_path / "card")
    (tmp_path / "card/README.md").write_text("my model card")  # an export of this run, plus the user's file
    capsys.readouterr()  # transformers' progress bars while saving
    for target, names in [(other, "ckpt.pt, config.json, manifest.json"), (tmp_path / "model", "config.json"),
                          (tmp_path / "other_export", "config.json"), (tmp_path / "card", "README.md")]:
        before = files(target)
        assert main(["export", str(run), str(target)]) == 2, target
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{target} holds files that are not an earlier export of {run} (" in err
        assert names in err and err.endswith("into another directory, an empty or new one\n")
        assert files(target) == before  # nothing written, nothing removed
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_two_checkpoint_files_of_one_folder_are_two_models(tmp_path, capsys):
    random_run(tmp_path, "char", 65)  # ckpt.pt, manifest.json
    os.replace(tmp_path / "ckpt.pt", tmp_path / "a.pt")
    random_run(tmp_path, "char", 65, n_embd=24)
    os.replace(tmp_path / "ckpt.pt", tmp_path / "b.pt")
    assert main(["export", str(tmp_path / "a.pt"), str(tmp_path / "hf")]) == 0
    assert main(["export", str(tmp_path / "b.pt"), str(tmp_path / "hf")]) == 2  # not a's export's update
    assert "holds files that are not an earlier export of" in capsys.readouterr().err


def test_a_killed_exports_folder_is_removed_by_the_next_export(tmp_path):
    run = random_run(tmp_path / "run", "char", 65)
    (tmp_path / ".hf.4194305.tmp").mkdir()  # a pid above Linux's limit: its process is gone
    (tmp_path / ".hf.4194305.tmp/model.safetensors").write_bytes(b"half a model")
    export_run(run, tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]


def test_exporting_again_replaces_the_runs_earlier_export_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = random_run(tmp_path / "run", "gpt2", 50304)
    assert main(["export", "run", "exported/run"]) == 0
    assert {"vocab.json", "merges.txt"} <= set(files(tmp_path / "exported/run"))
    random_run(run, "char", 65)  # the run trained again, now on characters: GPT-2's BPE files are stale
    capsys.readouterr()
    assert main(["export", str(run / "ckpt.pt"), str(tmp_path / "exported/run")]) == 0  # the same run, spelled apart
    names = ["config.json", "generation_config.json", "manifest.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json"]
    assert list(files(tmp_path / "exported/run")) == names
    assert f"exported/run: {', '.join(names)}\n" in capsys.readouterr().out  # the closing line lists these only
    assert json.loads((tmp_path / "exported/run/config.json").read_text())["vocab_size"] == 65
    assert os.listdir(tmp_path / "exported") == ["run"]  # no temporary left beside it


def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path, capsys, monkeypatch):
    run = random_run(tmp_path / "run", "char", 65)
    before = files(export_run(run, tmp_path / "hf"))
    random_run(run, "char", 65, n_embd=24)  # trained again: other weights
    replace_file = os.replace

    def disk_full(src, dst):
        if str(dst).endswith("config.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        replace_file(src, dst)

    monkeypatch.setattr(os, "replace", disk_full)
    assert main(["export", str(run), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.count("No space left on device") == 1
    assert files(tmp_path / "hf") == before and sorted(os.listdir(tmp_path)) == ["hf", "run"]


def test_export_into_a_file_or_where_nothing_can_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    run = random_run(tmp_path / "run", "char", 65)
    (tmp_path / "file").write_text("mine")
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    mkdir = os.mkdir

    def refuse(path, *args, **kwargs):  # root ignores mode 0555: refuse as the kernel does for anyone else
        if Path(path).parent == read_only:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    for target, says in [(tmp_path / "file", "file is a file; export"), (tmp_path / "file/hf", "could not write"),
                         (read_only / "hf", "(Permission denied)")]:
        assert main(["export", str(run), str(target)]) == 2, target
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and str(target) in err, err
    assert (tmp_path / "file").read_text() == "mine" and os.listdir(read_only) == []


def test_export_of_a_plain_file_or_an_empty_run_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for run, says in [(tmp_path / "notes.txt", "notes.txt is a file, not a checkpoint (.pt) or run directory"),
                      ("", "error: an empty run path names nothing")]:
        assert main(["export", str(run), str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and "train one first" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_exported_files_all_take_the_umask(tmp_path):
    run = random_run(tmp_path / "run", "char", 65)
    umask = os.umask(0o027)
    try:
        out = export_run(run, tmp_path / "hf")
    finally:
        os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == dict.fromkeys(files(out), "0o640")


def test_the_export_examples_target_is_ignored_by_git():
    """Read from .gitignore, not asked of git: a copy without .git (a release archive) runs it too."""
    assert pathspec.GitIgnoreSpec.from_lines((REPO / ".gitignore").open()).match_file("exported/small/model.safetensors")


def test_export_of_a_prepared_dataset_says_what_it_is(tmp_path, capsys):
    ds = tmp_path / "ds"
    ds.mkdir()
    for name in ("manifest.json", "train.bin", "val.bin"):
        (ds / name).write_bytes(b"")
    assert main(["export", str(ds), str(tmp_path / "hf")]) == 2  # was: no checkpoint at ...; train one first
    assert capsys.readouterr().err == f"error: {ds} is a prepared dataset, not a run; give a run directory or a .pt file\n"


def test_init_from_a_hf_folder_on_data_of_another_tokenizer_is_refused(tmp_path, capsys):
    (tmp_path / "abc.txt").write_text("abcdefghijk\n" * 400)  # 12 characters; the export below knows 65
    prepare(text=tmp_path / "abc.txt", tokenizer="char", name="abc", out_root=tmp_path, verbose=False)
    export = export_run(random_run(tmp_path / "run", "char", 65), tmp_path / "export")
    hf_tiny(vocab=50257).save_pretrained(tmp_path / "gpt2")  # no manifest.json: GPT-2 BPE's ids
    for source, says in [(export, "(vocab_size 65 -> 12, chars -"), (tmp_path / "gpt2", "(tokenizer 'gpt2' -> 'char'")]:
        for extra in ([], ["--eval-only"]):
            assert train.main(["--config", "tiny", "--device", "cpu", "--max-iters", "2", "--block-size", "8",
                               "--sample-tokens", "0", "--dataset", "abc", "--data-root", str(tmp_path), "--out-dir",
                               str(tmp_path / "ft"), "--init-from", str(source), *extra]) == 2, (source, extra)
            err = capsys.readouterr().err
            assert f"{source} was trained with another vocabulary than dataset abc's {says}" in err
            assert err.count("error:") == 1 and ("--dataset t" in err) == (source == export)


def test_an_export_given_as_a_run_says_what_it_is(tmp_path, capsys):
    export = export_run(random_run(tmp_path / "run", "char", 65), tmp_path / "export")
    says = f"{export} is an exported Hugging Face model, not a run; load it with transformers, or fine-tune"
    assert main(["export", str(export), str(tmp_path / "again")]) == 2
    assert says in capsys.readouterr().err
    assert sample.main(["--ckpt", str(export), "--max-new-tokens", "2"]) == 2
    assert says in capsys.readouterr().err
