"""The main job: a character-level GPT on tinyshakespeare, a few minutes on a 2-core CPU.

    python train.py --config small
    python train.py --config small --max-time 45     # time-budgeted: the schedule ends on time

Each choice below was measured against nanoGPT's CPU recipe (AdamW 1e-3, cosine, learned
positions): docs/performance.md has the figures and the commands.
"""

from configs import BASE, replace

CONFIG = replace(
    BASE,
    dataset="shakespeare_char",
    n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, pos_emb="rope",
    attention="explicit",  # same numbers as SDPA, faster on a CPU at this size
    activation="gelu_exact",  # GPT-2's tanh GELU to ~1e-3, with torch's faster CPU kernel
    batch_size=16,
    # lr is AdamW's (embedding, norms, biases); Muon trains the block matrices
    optimizer="muon", muon_lr=0.02, lr=2e-2, min_lr=0.0, beta2=0.99, weight_decay=0.1,
    warmup_iters=30, lr_schedule="wsd", decay_frac=0.8,
    max_iters=1600, eval_interval=800, eval_iters=0, eval_batch_size=256, log_interval=10,
)
