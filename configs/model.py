"""GPTConfig: the model's shape and architecture switches. Pure data, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .cli import integer, number
from .errors import UserError

CHOICES = {"pos_emb": ("learned", "rope"), "norm": ("layernorm", "rmsnorm"),
           "activation": ("gelu", "gelu_exact", "relu2"), "attention": ("sdpa", "explicit")}

# Caps where a size stops being a model: each block is Python objects, a few ms to build even on the meta
# device (the plan's), so 2e9 layers would hang, and DeepNet's 1,000 are the deepest published; each block
# registers a T x T mask, 1 TiB at T = 2**20, past any machine (and past 2**63 bytes at 2**30).
BOUNDS = dict.fromkeys("vocab_size n_head n_embd mlp_ratio".split(), integer(lo=1)) | {
    "dropout": number(0, 1, hi_open=True), "n_layer": integer(1, 1000), "block_size": integer(1, 2**20)}


@dataclass
class GPTConfig:
    """Defaults are GPT-2 small (124M). The switches select the modern variant
    (RoPE, RMSNorm, ReLU^2, QK-norm, no biases) within the same GPT class."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and norms; GPT-2 has them
    pos_emb: str = "learned"  # learned absolute positions (GPT-2) or rotary
    norm: str = "layernorm"
    activation: str = "gelu"  # GPT-2's tanh-approximated GELU, the exact (erf) one, or relu(x)^2
    qk_norm: bool = False  # normalise queries and keys per head before the dot product
    tie_weights: bool = True  # lm_head shares its weight with the token embedding
    mlp_ratio: int = 4
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    # Both give the same numbers: F.scaled_dot_product_attention (flash kernels on a GPU), or
    # softmax(QK^T / sqrt(hs) + mask) V spelled out (what model.trace reads attention maps from).
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        for name, rule in BOUNDS.items():  # and TrainConfig's flags of these names, as they are parsed
            value = getattr(self, name)
            if type(value) not in (int, rule.kind) or not rule.holds(value):  # no bool, no 2.0 for an int
                raise UserError(f"model config: {name} expects {rule.expects}, got {value!r}")
        if self.n_embd % self.n_head:
            divisors = [h for h in range(1, 17) if self.n_embd % h == 0]
            raise UserError(f"model config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); pass "
                            f"--n-head as one of {divisors} or another --n-embd")
        if self.pos_emb == "rope" and self.head_size % 2:
            raise UserError(f"model config: rope needs an even head size, got {self.head_size}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"model config: {name} must be one of {allowed}, got {getattr(self, name)!r}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> GPTConfig:
        """From a saved dict (and overrides, e.g. dropout), ignoring keys this version does not know."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in {**d, **overrides}.items() if k in known})


# GPT-2 small's shape is GPTConfig's defaults: the presets that train or fine-tune it take it from here.
GPT2_SHAPE = {k: getattr(GPTConfig, k) for k in ("n_layer", "n_head", "n_embd", "block_size")}
