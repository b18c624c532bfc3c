"""A GPU-sized character model, nanoGPT's shakespeare_char: ~10M parameters, under a minute on a GPU.

    python train.py --config shakespeare_gpu

nanoGPT's shape, dropout and batch; small's recipe (Muon, warmup-stable-decay to zero), 1000 steps:
the corpus overfits after ~2000, so the run ends at its best. Measured on an H100: docs/gpu.md.
"""

from configs import BASE, replace

CONFIG = replace(
    BASE,
    dataset="shakespeare_char",
    n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2,
    batch_size=64,
    optimizer="muon", muon_lr=0.02, lr=2e-2, min_lr=0.0, warmup_iters=100, lr_schedule="wsd", decay_frac=0.8,
    beta2=0.99, max_iters=1000, eval_interval=250, eval_iters=200, log_interval=10,
    compile=True,
)
