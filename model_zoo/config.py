"""One configuration dataclass for every transformer family, plus the preset registry.

Layer choices are strings (``norm="rmsnorm"``, ``mlp="swiglu"``) so a config round-trips
through YAML; :mod:`plugintrain.model_zoo.transformer` resolves them to modules. The family
modules (``gpt2.py``, ``llama3.py``, ``qwen3.py``) register their presets with
:func:`register_preset`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_NORMS = ("layernorm", "rmsnorm")
_MLPS = ("gelu", "swiglu")
_POSITIONS = ("learned", "rope")
_PRESETS: dict[str, TransformerConfig] = {}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension without retraining).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep
    their frequency, those longer than ``original_max_position_embeddings /
    low_freq_factor`` are slowed down by ``factor``, and the band between is interpolated.
    """

    factor: float = 8.0
    """Divisor applied to the low frequencies (32 for Llama 3.2, 8 for Llama 3.1)."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pretrained with before the extension."""

    def __post_init__(self) -> None:
        if (
            self.factor < 1
            or self.low_freq_factor <= 0
            or self.original_max_position_embeddings < 1
        ):
            raise ValueError(
                f"RopeScaling needs factor >= 1, low_freq_factor > 0 and "
                f"original_max_position_embeddings >= 1, got {self}."
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling needs high_freq_factor > low_freq_factor, got "
                f"high_freq_factor={self.high_freq_factor}, "
                f"low_freq_factor={self.low_freq_factor}; Llama 3 uses 4.0 and 1.0."
            )


@dataclass
class TransformerConfig:
    """Architecture of a decoder-only transformer (GPT-2, Llama 3, Qwen3, ...).

    Build one from a preset with :meth:`from_name`, overriding any field.
    """

    name: str
    """Preset name, e.g. ``gpt2-124m`` or ``llama3.2-1b``."""
    family: str
    """Model family (``gpt2``, ``llama3`` or ``qwen3``): picks the weight adapter and parallel
    plans."""
    vocab_size: int
    """Number of token ids the embedding and output layers cover."""
    block_size: int
    """Maximum context length in tokens."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Number of query attention heads."""
    n_embd: int
    """Hidden size (model width)."""
    n_kv_head: int | None = None
    """Number of key/value heads for grouped-query attention; None means ``n_head`` (MHA)."""
    head_size: int | None = None
    """Channels per attention head; None means ``n_embd // n_head``. Qwen3 sets it apart from
    the width (Qwen3-0.6B: 16 heads of 128 channels over ``n_embd=1024``), so the query and
    attention-output width ``n_head * head_size`` need not be ``n_embd``."""
    qk_norm: bool = False
    """RMSNorm (epsilon ``norm_eps``, a weight of ``head_dim``) over each head's queries and
    keys, after their projection and before RoPE (Qwen3)."""
    intermediate_size: int | None = None
    """Hidden size of the feed-forward network; None means ``4 * n_embd``."""
    bias: bool = True
    """Whether the Linear layers and LayerNorms have biases (GPT-2: yes, Llama: no)."""
    norm: str = "layernorm"
    """Normalization layer: ``layernorm`` or ``rmsnorm``."""
    norm_eps: float = 1e-5
    """Epsilon added to the variance in the normalization layers."""
    mlp: str = "gelu"
    """Feed-forward network: ``gelu`` (two layers, tanh GELU) or ``swiglu`` (gated, three)."""
    position: str = "learned"
    """Position encoding: ``learned`` absolute embeddings or ``rope`` (rotary)."""
    rope_theta: float = 10000.0
    """RoPE base period; only used with ``position="rope"``."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 RoPE frequency scaling; None leaves the frequencies unscaled."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output projection."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    tokenizer: str | None = None
    """The tokenizer whose ids the model reads: ``gpt2``, ``llama3``, a pretrained name
    (``smollm2-135m``) or the path of a ``tokenizer.json``, Hugging Face directory or GGUF
    file; None means the family's (``gpt2`` for GPT-2, ``llama3`` for Llama 3; Qwen3 has none
    built in: its Hugging Face directory brings it)."""

    def __post_init__(self) -> None:
        self._check_positive()
        self._check_choices()
        self._check_heads()
        self._check_position()
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={self.dropout}.")

    def _check_positive(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "n_kv_head": self.kv_heads,
            "intermediate_size": self.ffn_dim,
            "norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "init_std": self.init_std,
        }
        if self.head_size is not None:
            sizes["head_size"] = self.head_size
        bad = {key: value for key, value in sizes.items() if value <= 0}
        if bad:
            raise ValueError(f"{self.name}: these sizes must be positive, got {bad}.")

    def _check_choices(self) -> None:
        for field, value, choices in (
            ("norm", self.norm, _NORMS),
            ("mlp", self.mlp, _MLPS),
            ("position", self.position, _POSITIONS),
        ):
            if value not in choices:
                raise ValueError(
                    f"{self.name}: unknown {field}={value!r}; choose one of {choices}."
                )

    def _check_heads(self) -> None:
        if self.head_size is None and self.n_embd % self.n_head:
            raise ValueError(
                f"{self.name}: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"pick n_head among the divisors of n_embd, or set head_size."
            )
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"{self.name}: n_head={self.n_head} is not divisible by n_kv_head={self.kv_heads}; "
                f"each key/value head must serve a whole group of query heads."
            )

    def _check_position(self) -> None:
        if self.position == "rope" and self.head_dim % 2:
            source = (
                f"head_size={self.head_size}"
                if self.head_size is not None
                else f"head_dim={self.head_dim} (n_embd={self.n_embd} / n_head={self.n_head})"
            )
            raise ValueError(
                f"{self.name}: RoPE rotates pairs of channels but {source} is odd; make"
                f" {'head_size' if self.head_size is not None else 'n_embd / n_head'} even."
            )
        if self.position != "rope" and self.rope_scaling is not None:
            raise ValueError(
                f"{self.name}: rope_scaling={self.rope_scaling} needs position='rope', "
                f"got position={self.position!r}; drop rope_scaling or use rope."
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head, resolved (``n_embd // n_head`` when ``head_size`` is
        None)."""
        return self.n_embd // self.n_head if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads, resolved (``n_head`` when ``n_kv_head`` is None)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        """Hidden size of the feed-forward network, resolved."""
        return 4 * self.n_embd if self.intermediate_size is None else self.intermediate_size

    @classmethod
    def from_dict(cls, fields: dict[str, object]) -> TransformerConfig:
        """The config whose fields ``dataclasses.asdict`` gave (``rope_scaling`` too)."""
        scaling = fields.get("rope_scaling")
        if isinstance(scaling, dict):
            fields = {**fields, "rope_scaling": RopeScaling(**scaling)}
        return cls(**fields)

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> TransformerConfig:
        """Return the preset called ``name`` with some fields replaced.

        Args:
            name: A registered preset, see :meth:`presets`.
            **overrides: Field values that replace the preset's (validated again).

        Raises:
            ValueError: If the preset or an override field is unknown, or the result is
                invalid.
        """
        if name not in _PRESETS:
            raise ValueError(f"Unknown model preset {name!r}; known presets: {cls.presets()}.")
        unknown = set(overrides) - {field.name for field in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"Unknown TransformerConfig fields {sorted(unknown)} for {name!r}.")
        return dataclasses.replace(_PRESETS[name], **overrides)

    @classmethod
    def presets(cls) -> list[str]:
        """Names of all registered presets, sorted."""
        return sorted(_PRESETS)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Count the parameters analytically, without building the model.

        Args:
            include_embeddings: With False, leave out the lookup tables (token and learned
                position embeddings) but keep the output projection, which is a matmul on
                every token even when its weight is tied. This is the N of the 6N FLOPs
                rule and nanoGPT's "non-embedding" count.
        """
        head = self.vocab_size * self.n_embd  # the output projection, tied or not
        body = self.n_layer * self._block_params() + self._norm_params() + head
        if not include_embeddings:
            return body
        positions = self.block_size * self.n_embd if self.position == "learned" else 0
        return body + positions + (0 if self.tie_embeddings else head)

    def _block_params(self) -> int:
        d, hs, f = self.n_embd, self.head_dim, self.ffn_dim
        bias = int(self.bias)  # one bias per output feature of each Linear
        qkv_out = hs * (self.n_head + 2 * self.kv_heads)
        wo = self.n_head * hs * d  # from the concatenated heads back to the width
        attention = d * qkv_out + wo + bias * (qkv_out + d)
        qk_norms = 2 * hs if self.qk_norm else 0  # one RMSNorm weight for queries, one for keys
        n_in = 2 if self.mlp == "swiglu" else 1  # SwiGLU has a gate and an up projection
        ffn = (n_in + 1) * d * f + bias * (n_in * f + d)
        return attention + qk_norms + ffn + 2 * self._norm_params()

    def _norm_params(self) -> int:
        with_bias = self.norm == "layernorm" and self.bias
        return self.n_embd * (2 if with_bias else 1)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), for MFU.

        ``6 * N + 12 * n_layer * n_head * head_dim * seq_len`` (PaLM paper, appendix B;
        nanoGPT's ``estimate_mfu``): 6N counts the matmuls with the weights (2 FLOPs per
        multiply-add, times 3 for forward plus backward), with N from ``num_params(
        include_embeddings=False)``; the second term counts the attention scores and weighted
        values, whose width is the query width ``n_head * head_dim`` (``n_embd`` unless
        ``head_size`` sets it apart, as in Qwen3), also under GQA. Like those references it
        ignores causal masking, norms and softmax.

        Args:
            seq_len: Tokens per training sequence.
        """
        attention = 12 * self.n_layer * self.n_head * self.head_dim * seq_len
        return 6 * self.num_params(include_embeddings=False) + attention


def register_preset(config: TransformerConfig) -> TransformerConfig:
    """Make ``config`` available as ``TransformerConfig.from_name(config.name)``.

    Raises:
        ValueError: If a preset with the same name exists.
    """
    if config.name in _PRESETS:
        raise ValueError(f"Model preset {config.name!r} is registered twice.")
    _PRESETS[config.name] = config
    return config


# Configs are plain data: let `torch.load(weights_only=True)`, the default of Lightning's
# `load_from_checkpoint`, rebuild them from a checkpoint's hyperparameters.
torch.serialization.add_safe_globals([TransformerConfig, RopeScaling])
