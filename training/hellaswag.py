"""HellaSwag-style multiple choice: which of four endings the model finds likeliest after a context.

Scored as llm.c scores it, so that the numbers compare with its GPT-2 results: the context's tokens, then each
ending encoded as " " + ending. `acc` picks the ending with the highest summed log-likelihood; `acc_norm` divides
each sum by the ending's token count first (lm-evaluation-harness divides by characters instead).
"""

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from configs.errors import UserError
from data.sources import hub_dataset, reading
from training.runtime import Runtime

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
Item = tuple[list[int], list[list[int]], int]  # the context's tokens, the four endings' tokens, the label


def load_items(source: str, tok: Any) -> list[Item]:
    """The encoded items of a local JSON Lines file, or of a hub dataset's validation split (Rowan/hellaswag)."""
    fix = f"fetch the validation split with `curl -LO {URL}` and pass --hellaswag hellaswag_val.jsonl"
    if source.endswith((".jsonl", ".json")) or Path(source).is_file():
        if not Path(source).is_file():
            raise UserError(f"--hellaswag: no file {source}; {fix}")
        with reading(f"HellaSwag file {source}", "check that it is JSON Lines", offline=True) as datasets:
            rows = datasets.load_dataset("json", data_files=source, split="train")
    else:
        rows = hub_dataset(f"hub dataset {source!r}", source, None, "validation", None, False, fix=f"offline, {fix}")
    if len(rows) == 0:
        raise UserError(f"--hellaswag {source} holds no items; {fix}")
    return [encode(tok, row, i) for i, row in enumerate(rows)]


def encode(tok: Any, row: dict[str, Any], index: int) -> Item:
    """One item's tokens and label, or one line naming the item and what is wrong with it."""
    endings, label = row.get("endings"), str(row.get("label"))
    what = f"HellaSwag item {index} (ind {row.get('ind', '?')})"
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) and e for e in endings):
        raise UserError(f"{what}: needs four non-empty endings, has {endings!r}")
    if not isinstance(row.get("ctx"), str) or not row["ctx"]:
        raise UserError(f"{what}: needs a non-empty ctx, has {row.get('ctx')!r}")
    if label not in ("0", "1", "2", "3"):
        raise UserError(f"{what}: label {row.get('label')!r} is not 0, 1, 2 or 3")
    try:
        return tok.encode(row["ctx"]), [tok.encode(" " + e) for e in endings], int(label)
    except UserError as e:
        raise UserError(f"{what}: {e}") from None


@torch.no_grad()
def ending_loglik(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], vocab_size: int,
                  rt: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (context, ending) pair's summed log-likelihood of the ending, and the ending's token count: (n,), (n,).
    The pairs go through the model as one right-padded batch; one longer than the block loses its context's left."""
    rows = [(ctx + end)[-(model.config.block_size + 1):] for ctx, end in pairs]
    counts = [min(len(end), len(row) - 1) for (_, end), row in zip(pairs, rows)]
    x = torch.zeros(len(rows), max(map(len, rows)) - 1, dtype=torch.long)
    y = torch.full_like(x, -1)  # -1 is left out of the sum: the context and the padding
    for i, (row, n) in enumerate(zip(rows, counts)):
        x[i, :len(row) - 1] = torch.tensor(row[:-1])
        y[i, len(row) - 1 - n:len(row) - 1] = torch.tensor(row[-n:])
    if rt.threads:
        rt.threads.update()  # as evaluate() does, so that scoring uses the cores other processes leave idle
    with rt.autocast():
        logits, _ = model(x.to(rt.device))  # (n, T, V)
    nll = F.cross_entropy(logits[..., :vocab_size].float().transpose(1, 2), y.to(rt.device), ignore_index=-1,
                          reduction="none")  # (n, V, T) -> (n, T); the padded vocabulary's columns cut off
    return -nll.sum(1), torch.tensor(counts, device=rt.device)


def score(model: torch.nn.Module, items: list[Item], vocab_size: int, rt: Runtime,
          batch_rows: int) -> dict[str, float]:
    """Accuracy by summed log-likelihood (acc) and per ending token (acc_norm), over batches of whole items."""
    model.eval()
    correct = torch.zeros(2)
    per_batch = max(1, batch_rows // 4)
    for start in range(0, len(items), per_batch):
        batch = items[start:start + per_batch]
        total, count = ending_loglik(model, [(ctx, end) for ctx, ends, _ in batch for end in ends], vocab_size, rt)
        total, count = total.view(-1, 4), count.view(-1, 4)  # (items * 4,) -> (items, 4)
        picks = torch.stack([total.argmax(1), (total / count).argmax(1)]).cpu()  # (2, items): by sum, per token
        correct += (picks == torch.tensor([label for *_, label in batch])).sum(1)
    model.train()  # as evaluate() leaves it: both run between training steps
    acc, acc_norm = (correct / len(items)).tolist()
    return {"hellaswag_acc": acc, "hellaswag_acc_norm": acc_norm, "hellaswag_items": len(items)}
