"""Fine-tune pretrained GPT-2 on Shakespeare, BPE tokens.

    python train.py --config finetune_gpt2                          # gpt2 from the Hugging Face cache or hub
    python train.py --config finetune_gpt2 --init-from gpt2-medium  # any GPT-2 hub id or local HF directory
    python train.py --config finetune_gpt2 --eval-only              # GPT-2's loss on Shakespeare, untrained

The model shape comes from the pretrained weights; a small constant learning rate for a few
dozen steps is enough (Shakespeare is ~300k tokens, so longer runs overfit).
"""

from configs import BASE, replace

CONFIG = replace(
    BASE,
    dataset="shakespeare",
    init_from="gpt2",
    dropout=0.1,  # the shape comes from the weights
    batch_size=4, tokens_per_step=32768,
    lr=3e-5, min_lr=3e-5, warmup_iters=0, lr_schedule="constant",
    weight_decay=0.0, beta2=0.99,
    max_iters=40, eval_interval=5, eval_iters=20, log_interval=1,
)
