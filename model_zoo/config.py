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
_ATTENTIONS = ("gqa", "mla")
_SCORE_FUNCS = ("sigmoid", "softmax")
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


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values go through
    low-rank latents, and RoPE acts on a separate, decoupled part of each head.

    Queries: ``x -> wq_a (q_lora_rank) -> RMSNorm -> wq_b (n_head x (nope + rope))``, or
    one projection when ``q_lora_rank`` is None. Keys and values: ``x -> wkv_a`` gives a
    ``kv_lora_rank`` latent (normalized, then expanded by ``wkv_b`` into every head's
    ``nope`` key and ``v_head_dim`` value) and one ``qk_rope_head_dim`` key shared by all
    heads, which RoPE rotates. Generation caches only the latent and the rotated key.
    """

    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (what the KV cache stores per token)."""
    q_lora_rank: int | None = 1536
    """Width of the compressed query latent; None projects queries directly."""
    qk_nope_head_dim: int = 128
    """Channels of each query/key head that carry no position."""
    qk_rope_head_dim: int = 64
    """Channels of each query/key head that RoPE rotates (the key part is shared)."""
    v_head_dim: int = 128
    """Channels of each value head."""
    rope_interleave: bool = True
    """RoPE pairs adjacent channels ``(2i, 2i+1)``, the layout of DeepSeek's checkpoints
    (Hugging Face's ``rope_interleave``); False pairs ``i`` with ``i + rope_dim / 2``."""

    def __post_init__(self) -> None:
        sizes = {
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        bad = {key: v for key, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"MLAConfig: these sizes must be positive integers, got {bad}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLAConfig: RoPE rotates pairs of channels but qk_rope_head_dim="
                f"{self.qk_rope_head_dim} is odd; make it even (DeepSeek-V3 uses 64)."
            )

    @property
    def qk_head_dim(self) -> int:
        """Channels of each query/key head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (DeepSeek-V3, Qwen3-MoE).

    Each token picks ``top_k`` of ``n_routed_experts`` SwiGLU experts by its router
    scores; their outputs, weighted by the scores (normalized over the chosen ones), are
    summed with the always-on shared experts'. The first ``first_k_dense`` layers keep a
    dense SwiGLU of ``intermediate_size``.
    """

    n_routed_experts: int = 8
    """Experts each MoE layer routes between."""
    top_k: int = 2
    """Experts each token is sent to."""
    moe_intermediate_size: int = 256
    """Hidden width of each expert (and of each shared expert)."""
    n_shared_experts: int = 0
    """Experts every token goes through (one SwiGLU ``n_shared_experts`` times as wide)."""
    first_k_dense: int = 0
    """The first k layers keep a dense feed-forward network."""
    score_func: str = "sigmoid"
    """Router scores: ``sigmoid`` per expert (DeepSeek-V3) or ``softmax`` over experts
    (Qwen3-MoE, DeepSeek-V2)."""
    norm_topk_prob: bool = True
    """Normalize the chosen experts' scores to sum to 1 (before ``routed_scaling_factor``)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3: 2.5)."""
    n_group: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3: 8; 1 turns it off)."""
    topk_group: int = 1
    """Groups a token may pick experts from, ranked by their two best scores."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): after each optimizer
    step, each expert's routing bias moves by this much towards balance (up when it got
    fewer tokens than the mean, down when more), then the biases are re-centred to zero
    mean. The bias only chooses experts; it never enters the weights. 0 turns it off
    (DeepSeek-V3: 0.001)."""
    aux_loss_coeff: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss ``sum_i f_i P_i`` (0: off;
    DeepSeek-V3: 0.0001)."""
    capacity_factor: float | None = None
    """Each expert takes at most ``ceil(capacity_factor x tokens x top_k / experts)``
    tokens of a rank's micro-batch; the rest are dropped (the residual carries them).
    None: dropless."""

    def __post_init__(self) -> None:
        counts = {
            "n_routed_experts": self.n_routed_experts,
            "top_k": self.top_k,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
        }
        bad = {key: v for key, v in counts.items() if not isinstance(v, int) or v < 1}
        if self.n_shared_experts < 0 or self.first_k_dense < 0:
            bad |= {"n_shared_experts": self.n_shared_experts, "first_k_dense": self.first_k_dense}
        if bad:
            raise ValueError(f"MoEConfig: these counts must be positive integers, got {bad}.")
        self._check_routing()
        self._check_rates()

    def _check_routing(self) -> None:
        experts = self.n_routed_experts
        if self.top_k > experts:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} is larger than n_routed_experts={experts};"
                f" pick top_k <= {experts}."
            )
        if self.score_func not in _SCORE_FUNCS:
            raise ValueError(
                f"MoEConfig: unknown score_func={self.score_func!r}; choose one of {_SCORE_FUNCS}."
            )
        if experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(
                f"MoEConfig: n_group={self.n_group} must divide n_routed_experts={experts} and"
                f" be >= topk_group={self.topk_group}; use n_group: 1, topk_group: 1 to turn"
                " group-limited routing off."
            )
        reachable = self.topk_group * (experts // self.n_group)
        if self.top_k > reachable:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} exceeds the {reachable} experts of"
                f" topk_group={self.topk_group} groups; raise topk_group or lower top_k."
            )

    def _check_rates(self) -> None:
        if self.bias_update_rate < 0 or self.aux_loss_coeff < 0 or self.routed_scaling_factor <= 0:
            raise ValueError(
                f"MoEConfig: bias_update_rate={self.bias_update_rate} and aux_loss_coeff="
                f"{self.aux_loss_coeff} must be >= 0 and routed_scaling_factor="
                f"{self.routed_scaling_factor} > 0."
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"MoEConfig: capacity_factor={self.capacity_factor} must be > 0, or None for"
                " dropless routing."
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has a mixture of experts (else a dense SwiGLU)."""
        return index >= self.first_k_dense


@dataclass(frozen=True)
class BlockFlops:
    """Forward FLOPs per token of one transformer block, by part: 2 per multiply-add
    (backward takes twice the forward, so a training step three times it)."""

    matmul: int
    """The matmuls with the block's weights: 2 x those weights (of a mixture of experts,
    the ones a token runs through, and the router)."""
    down: int
    """Of :attr:`matmul`, the FFN's last matmul (its down projection): recomputation that
    stops once backward has what it saved (``torch.utils.checkpoint``) does not rerun it."""
    norms: int
    """The block's two norms: 2 x their weights (the 6N rule counts every parameter)."""
    attention: int
    """Scores and weighted values over the whole sequence, ``2 x n_head x (their width) x
    seq_len``; a causal kernel computes half."""

    @property
    def training(self) -> int:
        """Forward and backward of the whole block, causal masking ignored (PaLM's count:
        :meth:`TransformerConfig.flops_per_token` per block)."""
        return 3 * (self.matmul + self.norms + self.attention)


@dataclass
class TransformerConfig:
    """Architecture of a decoder-only transformer (GPT-2, Llama 3, Qwen3, ...).

    Build one from a preset with :meth:`from_name`, overriding any field.
    """

    name: str
    """Preset name, e.g. ``gpt2-124m`` or ``llama3.2-1b``."""
    family: str
    """Model family: a name in :data:`plugintrain.model_zoo.families.FAMILIES` (``gpt2``,
    ``llama3``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``), whose spec holds the family's
    Hugging Face and GGUF weight adapters and tensor-parallel plan; the model itself is
    built from the other fields."""
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
    attention: str = "gqa"
    """Attention: ``gqa`` (multi-head or grouped-query, ``n_kv_head``) or ``mla``
    (multi-head latent attention, shaped by ``mla``)."""
    mla: MLAConfig | None = None
    """Shape of multi-head latent attention; needed by (and only with) ``attention="mla"``."""
    moe: MoEConfig | None = None
    """Mixture-of-experts feed-forward layers; None: every layer is dense."""
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
        _check_mla(self)
        if self.moe is not None and self.moe.first_k_dense > self.n_layer:
            raise ValueError(
                f"{self.name}: moe.first_k_dense={self.moe.first_k_dense} exceeds n_layer="
                f"{self.n_layer}; at most every layer can be dense."
            )
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
            ("attention", self.attention, _ATTENTIONS),
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
        if self.attention == "mla":
            return  # MLAConfig checks its rotated width
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
    def rope_dim(self) -> int:
        """Channels of a head that RoPE rotates: ``head_dim``, or MLA's ``qk_rope_head_dim``."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

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
        nested = {"rope_scaling": RopeScaling, "mla": MLAConfig, "moe": MoEConfig}
        for key, kind in nested.items():
            if isinstance(fields.get(key), dict):
                fields = {**fields, key: kind(**fields[key])}
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

    def one_block(self) -> TransformerConfig:
        """This architecture with one block, of the kind most of its blocks are (a mixture
        of experts' is an MoE block: its few dense first blocks are the exception)."""
        if self.moe is None:
            return dataclasses.replace(self, n_layer=1)
        return dataclasses.replace(
            self, n_layer=1, moe=dataclasses.replace(self.moe, first_k_dense=0)
        )

    def num_params(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Count the parameters analytically, without building the model.

        Args:
            include_embeddings: With False, leave out the lookup tables (token and learned
                position embeddings) but keep the output projection, which is a matmul on
                every token even when its weight is tied. This is the N of the 6N FLOPs
                rule and nanoGPT's "non-embedding" count.
            active: Count only what one token runs through: of each MoE layer's routed
                experts, the ``top_k`` it is sent to (DeepSeek-V3: 37B of 671B).
        """
        head = self.vocab_size * self.n_embd  # the output projection, tied or not
        blocks = sum(self._block_params(i, active) for i in range(self.n_layer))
        body = blocks + self._norm_params() + head
        if not include_embeddings:
            return body
        positions = self.block_size * self.n_embd if self.position == "learned" else 0
        return body + positions + (0 if self.tie_embeddings else head)

    def _block_params(self, index: int = 0, active: bool = False) -> int:
        ffn = _ffn_params(self, index, active)
        return _attention_params(self) + ffn + 2 * self._norm_params()

    def _norm_params(self) -> int:
        with_bias = self.norm == "layernorm" and self.bias
        return self.n_embd * (2 if with_bias else 1)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), for MFU.

        ``6 * N + 12 * n_layer * n_head * head_dim * seq_len`` (PaLM paper, appendix B;
        nanoGPT's ``estimate_mfu``): 6N counts the matmuls with the weights (2 FLOPs per
        multiply-add, times 3 for forward plus backward), with N from ``num_params(
        include_embeddings=False, active=True)`` (a mixture of experts counts only the
        experts a token runs through); the second term counts the attention scores and
        weighted values, whose width is the query width ``n_head * head_dim`` (``n_embd``
        unless ``head_size`` sets it apart, as in Qwen3), also under GQA; with MLA it is
        ``6 * n_layer * n_head * (qk_head_dim + v_head_dim) * seq_len``. Like those
        references it ignores causal masking, norms, softmax and routing. Summed block by
        block (:meth:`block_flops`), then the final norm and the output projection.

        Args:
            seq_len: Tokens per training sequence.
        """
        blocks = sum(self.block_flops(i, seq_len).training for i in range(self.n_layer))
        return blocks + 6 * (self._norm_params() + self.vocab_size * self.n_embd)

    def block_flops(self, index: int, seq_len: int) -> BlockFlops:
        """Forward FLOPs per token of block ``index`` over sequences of ``seq_len`` tokens."""
        norms = 2 * self._norm_params()
        ffn = _ffn_params(self, index, active=True)
        down = ffn // (3 if self.mlp == "swiglu" or self.moe is not None else 2)
        if self.mla is None:
            width = 2 * self.head_dim  # scores (q . k) and weighted values, hs wide each
        else:
            width = self.mla.qk_head_dim + self.mla.v_head_dim
        matmul = 2 * (self._block_params(index, active=True) - norms)
        return BlockFlops(matmul, 2 * down, 2 * norms, 2 * self.n_head * width * seq_len)


def _check_mla(config: TransformerConfig) -> None:
    """Raise unless ``attention`` and ``mla`` agree and the latents fit the width."""
    if (config.attention == "mla") != (config.mla is not None):
        raise ValueError(
            f"{config.name}: attention={config.attention!r} with mla={config.mla}; set both"
            " attention: mla and an mla: block, or neither."
        )
    if config.mla is None:
        return
    ranks = {"kv_lora_rank": config.mla.kv_lora_rank, "q_lora_rank": config.mla.q_lora_rank}
    bad = {key: r for key, r in ranks.items() if r is not None and r > config.n_embd}
    if bad:
        raise ValueError(
            f"{config.name}: MLA ranks {bad} are larger than the model width n_embd="
            f"{config.n_embd}; a low-rank latent must be narrower than n_embd."
        )
    if config.position != "rope" or config.bias or config.norm != "rmsnorm":
        raise ValueError(
            f"{config.name}: attention='mla' is built with position='rope', bias=False and"
            f" norm='rmsnorm', got position={config.position!r}, bias={config.bias},"
            f" norm={config.norm!r}."
        )


def _attention_params(config: TransformerConfig) -> int:
    """Parameters of one block's attention."""
    d, hs = config.n_embd, config.head_dim
    if config.mla is not None:
        return _mla_params(config)
    bias = int(config.bias)  # one bias per output feature of each Linear
    qkv_out = hs * (config.n_head + 2 * config.kv_heads)
    wo = config.n_head * hs * d  # from the concatenated heads back to the width
    qk_norms = 2 * hs if config.qk_norm else 0  # one RMSNorm weight for queries, one for keys
    return d * qkv_out + wo + bias * (qkv_out + d) + qk_norms


def _mla_params(config: TransformerConfig) -> int:
    """Parameters of one multi-head latent attention."""
    mla, d, nh = config.mla, config.n_embd, config.n_head
    q_out = nh * mla.qk_head_dim
    queries = d * q_out if mla.q_lora_rank is None else mla.q_lora_rank * (d + 1 + q_out)
    kv_a = d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank  # + its norm
    kv_b = mla.kv_lora_rank * nh * (mla.qk_nope_head_dim + mla.v_head_dim)
    return queries + kv_a + kv_b + nh * mla.v_head_dim * d


def _ffn_params(config: TransformerConfig, index: int, active: bool) -> int:
    """Parameters of block ``index``'s feed-forward network (a token's experts if ``active``)."""
    d, f = config.n_embd, config.ffn_dim
    if config.moe is not None and config.moe.is_moe_layer(index):
        moe = config.moe
        experts = moe.top_k if active else moe.n_routed_experts
        routed_and_shared = 3 * d * moe.moe_intermediate_size * (experts + moe.n_shared_experts)
        return routed_and_shared + moe.n_routed_experts * d  # + the router
    bias = int(config.bias)
    n_in = 2 if config.mlp == "swiglu" else 1  # SwiGLU has a gate and an up projection
    return (n_in + 1) * d * f + bias * (n_in * f + d)


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
torch.serialization.add_safe_globals([TransformerConfig, RopeScaling, MLAConfig, MoEConfig])
