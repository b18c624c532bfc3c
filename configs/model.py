"""GPTConfig: the network's shape and switches, each with one default, a --help line and a check."""

from argparse import ArgumentTypeError
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from functools import cache
from typing import Any, Literal, get_type_hints

from .cli import converter, integer, number, setting
from .errors import UserError


@dataclass(frozen=True)
class GPTConfig:
    """Defaults are GPT-2 small (124M); switches give the modern variant (RoPE, RMSNorm, ReLU^2, QK-norm, no bias)."""

    vocab_size: int = setting(50257, "rows of the token embedding (GPT-2's BPE has 50257)", "model", integer(lo=1))
    # Each block registers a T x T mask, which at T = 2**20 would already take 1 TiB.
    block_size: int = setting(1024, "context length in tokens", check=integer(1, 2**20))
    # Each block takes a few ms to build, so 2e9 layers would hang; DeepNet's 1,000 layers are the deepest published.
    n_layer: int = setting(12, "transformer blocks", check=integer(1, 1000))
    n_head: int = setting(12, "attention heads per block; must divide n_embd", check=integer(lo=1))
    n_embd: int = setting(768, "width of the residual stream", check=integer(lo=1))
    dropout: float = setting(0.0, "only while training; > 0 helps small data, not big corpora",
                             check=number(0, 1, hi_open=True))
    bias: bool = setting(True, "biases in Linear layers and norms, as GPT-2 has")
    pos_emb: Literal["learned", "rope"] = setting("learned", "learned absolute positions (GPT-2) or rotary")
    norm: Literal["layernorm", "rmsnorm"] = setting("layernorm", "LayerNorm (GPT-2) or RMSNorm")
    activation: Literal["gelu", "gelu_exact", "relu2"] = setting("gelu", "GPT-2's tanh GELU, exact GELU or relu(x)^2")
    qk_norm: bool = setting(False, "normalise queries and keys per head before their dot product")
    tie_weights: bool = setting(True, "lm_head shares its weight with the token embedding")
    mlp_ratio: int = setting(4, "the MLP's hidden width as a multiple of n_embd", check=integer(lo=1))
    norm_eps: float = setting(1e-5, "the epsilon of every norm layer")
    rope_base: float = setting(10000.0, "rope: the base of the rotary frequencies")
    attention: Literal["sdpa", "explicit"] = setting("sdpa", "F.scaled_dot_product_attention or the spelled-out "
                                                     "softmax(QK^T)V: same numbers, speed depends on the device")

    def __post_init__(self) -> None:
        prefix = "model config: " if type(self) is GPTConfig else ""  # a TrainConfig's fields are its flags
        for name, check in checks(type(self)).items():
            value = getattr(self, name)
            try:
                if type(value) not in (int, type(check(value))):  # 1.0 for an int, "1" for a number: refused too
                    raise ArgumentTypeError(f"expects {type(check(value)).__name__}, got {value!r}")
            except ArgumentTypeError as e:
                raise UserError(f"{prefix}{name} {e}") from None
        if self.n_embd % self.n_head:
            divisors = [h for h in range(1, 17) if self.n_embd % h == 0]
            raise UserError(f"model config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); pass "
                            f"--n-head as one of {divisors} or another --n-embd")
        if self.pos_emb == "rope" and self.head_size % 2:
            raise UserError(f"model config: rope needs an even head size, got {self.head_size}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> "GPTConfig":
        """From a saved dict (and overrides, e.g. dropout), ignoring keys this version does not know."""
        return cls(**{k: v for k, v in {**d, **overrides}.items() if k in checks(cls)})


@cache
def checks(cls: type) -> dict[str, Callable[[Any], Any]]:
    """Each field's check: its setting's, else by its type (a number: at least 0)."""
    return {f.name: f.metadata["check"] or converter(get_type_hints(cls)[f.name]) for f in fields(cls)}
