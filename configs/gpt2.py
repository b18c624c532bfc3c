"""GPT-2 small (124M) from scratch on a Hugging Face web-text corpus; for a GPU node.

    # once, with internet (10B tokens; keep 10M for val):
    python -m data.prepare --hf HuggingFaceFW/fineweb-edu --subset sample-10BT --streaming \
        --name fineweb_edu --val-fraction 0.001
    torchrun --standalone --nproc_per_node=8 train.py --config gpt2

~0.5M tokens per optimizer step (gradient accumulation fills whatever the GPU count leaves),
19073 steps = 10B tokens, the schedule of GPT-2/GPT-3 small as reproduced by llm.c.
"""

from configs import BASE, replace

CONFIG = replace(
    BASE,
    dataset="fineweb_edu",
    dropout=0.0,  # the shape is GPTConfig's default: GPT-2 small
    vocab_size=50304,  # 50257 padded to a multiple of 128: faster matmuls, the extra rows go unused
    batch_size=32, tokens_per_step=524288,
    lr=6e-4, min_lr=6e-5, warmup_iters=715, lr_schedule="cosine",
    weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0,
    max_iters=19073, eval_interval=250, eval_iters=20, log_interval=10,
    compile=True,
)
