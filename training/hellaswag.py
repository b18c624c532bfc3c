"""HellaSwag for --hellaswag FILE: which of four endings a model finds likeliest after a context.

Scored as llm.c scores GPT-2, so that the numbers compare with its results: the context's tokens,
then each ending encoded as " " + ending. `acc` picks the ending with the highest summed
log-likelihood, `acc_norm` the highest per token. The validation split, 10,042 items, is one file:
    curl -LO https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl
"""

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from configs import UserError
from training.runtime import summed


def load_items(path: str, tok) -> list[tuple[list[int], list[list[int]], int]]:
    """Each line's (context tokens, the four endings' tokens, label), read afresh at every call."""
    try:
        lines = Path(os.path.expanduser(path)).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"--hellaswag {path}: {e}; give a HellaSwag .jsonl file (training/hellaswag.py says "
            "where to get one), or --hellaswag '' to go on without"
        ) from None
    items = []
    for number, line in enumerate(lines, 1):
        where = f"--hellaswag {path}, line {number}"
        try:
            row = json.loads(line)
            endings = [tok.encode(" " + ending) for ending in row["endings"]]
            items.append((tok.encode(row["ctx"]), endings, int(str(row["label"]))))  # not 1.7
        except (ValueError, KeyError, TypeError, UserError) as e:
            raise UserError(f"{where}: not a HellaSwag item ({e})") from None
        if len(endings) != 4 or not all(endings) or items[-1][2] not in range(4):
            raise UserError(f"{where}: a HellaSwag item has four endings and a label from 0 to 3")
    if not items:
        raise UserError(f"--hellaswag {path} holds no items")
    return items


@torch.no_grad()
def score(model, items, rt, batch_size: int, vocab_size: int, stopped=lambda: False) -> dict | None:
    """acc and acc_norm over the items; each process scores its share, and the counts are summed.
    None when stopped() became true in any process."""
    model.eval()
    right = torch.zeros(2, device=rt.device)  # by the summed log-likelihood, and per token
    mine, per_batch = items[rt.rank :: rt.world_size], max(1, batch_size // 4)
    for start in range(0, len(mine), per_batch):  # whole items: four rows each
        if stopped():
            break
        batch = mine[start : start + per_batch]
        # A row is the context and one ending, right-padded; one longer than the block loses the
        # start of its context.
        pairs = [(ctx, end) for ctx, ends, _ in batch for end in ends]
        rows = [(ctx + end)[-model.config.block_size - 1 :] for ctx, end in pairs]
        x = torch.zeros(len(rows), max(map(len, rows)) - 1, dtype=torch.long)
        y = torch.full_like(x, -1)  # -1: left out of the sum (the context and the padding)
        for i, ((_, end), row) in enumerate(zip(pairs, rows)):
            n = min(len(end), len(row) - 1)  # the ending's tokens
            x[i, : len(row) - 1] = torch.tensor(row[:-1])
            y[i, len(row) - 1 - n : len(row) - 1] = torch.tensor(row[-n:])
        with rt.autocast():
            logits, _ = model(x.to(rt.device))  # (4 items, T, V)
        logits = logits[..., :vocab_size].float().transpose(1, 2)  # (4 items, V, T): no padding ids
        nll = F.cross_entropy(logits, y.to(rt.device), ignore_index=-1, reduction="none")
        total = -nll.sum(1).view(-1, 4)  # (4 items, T) -> (items, 4): each ending's log-likelihood
        tokens = (y != -1).sum(1).view(-1, 4).to(rt.device)
        picks = torch.stack([total.argmax(1), (total / tokens).argmax(1)])  # (2, items)
        right += (picks == torch.tensor([label for *_, label in batch], device=rt.device)).sum(1)
    model.train()
    if (counts := summed(torch.cat([right, right.new_tensor([len(mine)])]), stopped(), rt)) is None:
        return None
    right_sum, right_norm, n = counts.tolist()
    return {
        "hellaswag_acc": right_sum / n,
        "hellaswag_acc_norm": right_norm / n,
        "hellaswag_items": int(n),
    }
