"""A GPU-sized character model, nanoGPT's shakespeare_char: ~10M parameters, minutes on a GPU.

Val loss around 1.47.

    python train.py --config shakespeare_gpu
"""

from dataclasses import replace

from configs import BASE

CONFIG = replace(
    BASE,
    dataset="shakespeare_char",
    n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2,
    batch_size=64,
    lr=1e-3, min_lr=1e-4, warmup_iters=100, lr_schedule="cosine", beta2=0.99,
    max_iters=5000, eval_interval=250, eval_iters=200, log_interval=10,
    compile=True,
)
