"""A toy-sized run for tests and smoke checks: seconds on one CPU core.

    python train.py --config tiny
"""

from configs import BASE, replace

CONFIG = replace(
    BASE,
    dataset="shakespeare_char",
    n_layer=2, n_head=2, n_embd=16, block_size=32, dropout=0.0,
    batch_size=4,
    lr=1e-3, min_lr=1e-4, warmup_iters=2,
    max_iters=20, eval_interval=10, eval_iters=2, log_interval=1, sample_tokens=32,
)
