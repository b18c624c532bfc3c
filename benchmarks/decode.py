"""Decoding speed: generate()'s tokens/s on a config's shape, random weights; transformers' too."""

import time

import torch

from benchmarks import emit
from configs import UserError, device_and_dtype, load_config
from model.gpt import GPT, generate


def transformers_twin(model: GPT):
    """transformers' GPT2LMHeadModel holding the same weights (GPT-2's shape only)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    if c.pos_emb != "learned" or not c.bias or not c.tie_weights:
        raise UserError("--modes transformers needs GPT-2's shape: --config gpt2")
    activation = {"gelu": "gelu_new", "gelu_exact": "gelu"}[c.activation]
    shape = dict(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd)
    hf = GPT2LMHeadModel(
        GPT2Config(**shape, n_layer=c.n_layer, n_head=c.n_head, activation_function=activation)
    )
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # stored (in, out) there
    state = {k: v.t() if k.endswith(conv1d) else v for k, v in model.state_dict().items()}
    missing, _ = hf.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith(".attn.bias")], missing
    return hf.eval()


def main(args) -> None:
    cfg = load_config(args.config)
    torch.manual_seed(0)
    vocab = 65 if cfg.dataset.endswith("char") else 50257  # the tokenizer's
    model = GPT(cfg.model_config(vocab)).eval()
    _, dtype = device_and_dtype("cpu", args.dtype)
    if model.config.n_embd <= 256:  # as sample.py decodes a small model
        torch.set_num_threads(1)
        dtype = torch.float32 if args.dtype == "auto" else dtype
    prompt = torch.zeros(1, 8, dtype=torch.long)
    for mode in args.modes.split(","):
        if mode == "transformers":  # in its own default dtype, float32, unless --dtype names one
            decoder = transformers_twin(model).to(torch.float32 if args.dtype == "auto" else dtype)
        elif mode == "compiled":
            from model.compiled import compiled

            decoder = compiled(model.to(dtype))
        else:
            decoder = model.to(dtype)
        rates, n = [], args.tokens
        with torch.no_grad():
            for _ in range(4):  # the first round compiles, or warms up
                t0 = time.perf_counter()
                if mode == "transformers":  # greedy, never stopping early
                    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                    decoder.generate(prompt, **kw)
                else:
                    sampling = args.temperature, None, None, torch.Generator().manual_seed(0), vocab
                    for _ in generate(decoder, prompt, n, *sampling):
                        pass
                rates.append(n / (time.perf_counter() - t0))
        emit(
            {
                "bench": "sample",
                "config": args.config,
                "mode": mode,
                "dtype": str(next(decoder.parameters()).dtype)[6:],
                "temperature": args.temperature,
                "threads": torch.get_num_threads(),
                "tokens_per_s": round(max(rates[1:]), 1),
            }
        )
