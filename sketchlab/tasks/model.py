r"""A small causal transformer with pluggable attention, used for MQAR and the shipped Q/K dump.

The attention *kernel* is a separate module that takes ``q, k, v`` of layout ``[B, T, H, D]``
(after the projections and the rotary embedding) and returns ``[B, T, H, D]``. It is chosen by
name from a registry (:func:`register_attention`), so a checkpoint stores only the name and a
later sketched attention drops in by registering itself. ``"softmax"`` is causal softmax
attention (:func:`sketchlab.attention.softmax_attention`'s core) with logits ``q kᵀ / √D``.

Block (pre-norm, as GPT-2/LLaMA)::

    u = conv(LN(x))             # optional causal depthwise conv (short_conv = c > 0), else LN(x)
    x = x + W_o · attn(rope(W_q u), rope(W_k u), W_v u)
    x = x + MLP(LN(x))          # Linear(d, r·d) → GELU → Linear(r·d, d), r = mlp_ratio

with token embeddings, no absolute positions (RoPE carries the position), a final LayerNorm and
an untied output head. The short convolution (kernel ``c``, each channel mixing positions
``t-c+1 … t``) is the "short conv" of H3/BASED: it hands every position its predecessor's token,
so one softmax layer can match a query key against the *value* positions of the context and
associative recall is learned in a few hundred CPU steps instead of waiting for an induction
circuit to form across two layers. Attention itself is unchanged softmax attention.

References
----------
Fu et al. *Hungry Hungry Hippos*, 2023 (short convolutions); Arora et al. *BASED*, 2024.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .._validation import check_positive_int, check_real
from ..attention.softmax import _softmax_attention

__all__ = [
    "CausalSelfAttention",
    "adamw_groups",
    "SoftmaxAttention",
    "TransformerConfig",
    "TransformerLM",
    "apply_rope",
    "attention_registry",
    "cache_nbytes",
    "generate",
    "kv_cache_step",
    "register_attention",
]

_ATTENTION: dict[str, Callable[[TransformerConfig, int], nn.Module]] = {}
_OPTIONS: dict[str, Callable[[dict, TransformerConfig], dict] | None] = {}


#: Called when a config names an attention no kernel is registered for yet (a feature map registered since):
#: :mod:`sketchlab.tasks.attention` adds its registrar here (this module never imports it).
ON_UNKNOWN_ATTENTION: list[Callable[[], object]] = []


def register_attention(name: str, *, options: Callable[[dict, TransformerConfig], dict] | None = None):
    """Register ``factory(config, layer_index) -> nn.Module`` as the attention kernel ``name``.

    The module's ``forward(q, k, v)`` takes and returns ``[B, T, H, D]`` and must be causal. For
    decoding (:func:`generate`) it may also define ``step(q, k, v, state) -> (out, state)``: the
    same attention for ``n >= 1`` new tokens given the state of the earlier ones (``None`` at the
    start) — a KV cache for exact attention, an :class:`~sketchlab.attention.AttentionState` for
    linear attention.
    ``options(attention_options, config) -> dict`` validates and completes the kernel's options
    (``TransformerConfig.attention_options``) once, when the config is built; it raises
    ``ValueError`` naming the option. Without it the kernel takes no options.
    """

    def decorate(factory):
        if name in _ATTENTION and _ATTENTION[name] is not factory:
            raise ValueError(f"an attention named {name!r} is already registered")
        _ATTENTION[name] = factory
        _OPTIONS[name] = options
        return factory

    return decorate


def attention_registry() -> list[str]:
    """Names of the registered attention kernels, sorted."""
    return sorted(_ATTENTION)


def kv_cache_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, attend):
    """Exact attention of ``n`` new tokens against a KV cache ``(K [B, P, H, D], V [B, P, H, Dv])``.

    ``attend(q, K, V, allowed)`` computes the attention of ``q [B, n, H, D]`` on every key with the
    bool mask ``allowed [n, P + n]`` (key ``j`` allowed for new query ``i`` iff ``j <= P + i``).
    Returns ``(out [B, n, H, Dv], (K, V))`` with the new keys appended (memory grows with context).
    """
    if cache is not None:
        k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)  # [B, P + n, H, ·]
    n, total = q.shape[1], k.shape[1]
    allowed = torch.arange(total, device=q.device)[None, :] <= torch.arange(total - n, total, device=q.device)[:, None]
    return attend(q, k, v, allowed), (k, v)


class SoftmaxAttention(nn.Module):
    """Causal softmax attention, layout ``[B, T, H, D]`` in and out, logits scaled by ``1/√D``
    (:func:`sketchlab.attention.softmax_attention`'s core)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _softmax_attention(q, k, v, causal=True)  # [B, T, H, D]

    def step(self, q, k, v, state):
        """``n`` new tokens ``q, k, v [B, n, H, D]`` against the KV cache ``state = (K [B, P, H, D], V)`` (``None``
        at the start): the causal attention of the last ``n`` of the ``P + n`` positions. Returns
        ``(out [B, n, H, D], (K, V))`` with the new keys appended (memory grows with context)."""
        if state is not None:
            k, v = torch.cat([state[0], k], 1), torch.cat([state[1], v], 1)  # [B, P + n, H, D]
        return _softmax_attention(q, k, v, causal=True), (k, v)


@register_attention("softmax")
def _softmax_factory(config: TransformerConfig, layer: int) -> nn.Module:
    return SoftmaxAttention()



def apply_rope(x: torch.Tensor, *, base: float = 10000.0, offset: int = 0) -> torch.Tensor:
    r"""Rotary position embedding of ``x[B, T, H, D]`` (``D`` even), half-split convention.

    Notes
    -----
    With ``x = [x_1, x_2]`` (halves of the last axis), ``θ_i = base^{-2i/D}`` and angle
    ``t θ_i`` at position ``t``: ``rope(x) = [x_1 cos − x_2 sin, x_2 cos + x_1 sin]``, so
    ``⟨rope(q)_t, rope(k)_s⟩`` depends on ``t − s`` only (the LLaMA / GPT-NeoX convention).
    ``offset`` is the position of the first token (decoding continues at the context length).
    """
    B, T, H, D = x.shape
    if D % 2:
        raise ValueError(f"apply_rope needs an even head dimension, got D={D}")
    inv_freq = base ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)  # [D/2]
    angle = torch.arange(offset, offset + T, dtype=torch.float64)[:, None] * inv_freq  # [T, D/2]
    cos = angle.cos().to(x.dtype)[None, :, None, :]  # [1, T, 1, D/2]
    sin = angle.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of :class:`TransformerLM` (all stored in the checkpoint's JSON).

    ``rope_base``: the base of the rotary embedding applied to q and k, or ``None`` for no positional
    encoding (NoPE: Zoology's MQAR models have none; order then comes only from causality and
    ``short_conv``)."""

    vocab_size: int
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4
    attention: str = "softmax"
    rope_base: float | None = 10000.0
    short_conv: int = 0
    attention_options: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            check_positive_int(getattr(self, name), name)
        if isinstance(self.short_conv, bool) or not isinstance(self.short_conv, int) or self.short_conv < 0:
            raise ValueError(f"short_conv must be an integer >= 0 (0 = none), got {self.short_conv!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads, got d_model={self.d_model}, n_heads={self.n_heads}")
        if self.head_dim % 2 and self.rope_base is not None:
            raise ValueError(f"head dimension d_model/n_heads must be even for RoPE, got {self.head_dim} "
                             "(rope_base=None: no positional encoding)")
        if isinstance(self.attention, str) and self.attention not in _ATTENTION:  # a feature map registered since
            for hook in ON_UNKNOWN_ATTENTION:
                hook()
        if not isinstance(self.attention, str) or self.attention not in _ATTENTION:
            raise ValueError(f"attention must be one of {attention_registry()}, got {self.attention!r}")
        rb = self.rope_base
        # θ_i = base^{-2i/D}: base <= 0 gives NaN/inf angles, base == 1 gives no rotation at all
        if rb is not None and (isinstance(rb, bool) or not isinstance(rb, numbers.Real) or not math.isfinite(rb) or rb <= 1):
            raise ValueError(f"rope_base must be a finite number > 1 (RoPE frequencies base^(-2i/D)) or None "
                             f"(no positional encoding), got {rb!r}")
        opts = self.attention_options
        if not isinstance(opts, dict) or not all(isinstance(key, str) for key in opts):
            raise TypeError(f"attention_options must be a dict with string keys, got {opts!r}")
        check = _OPTIONS[self.attention]
        if check is None:
            if opts:
                raise ValueError(f"attention {self.attention!r} takes no options, got attention_options={opts!r}")
            completed = {}
        else:
            completed = check(dict(opts), self)
        object.__setattr__(self, "attention_options", completed)  # frozen: the validated, completed options

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


def adamw_groups(module: nn.Module, kernel, *, no_decay=(), lr: float, weight_decay: float, kernel_lr: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.98)) -> torch.optim.AdamW:
    """AdamW over ``module``'s parameters in groups (nanoGPT's), each with its ``"lr_factor"``.

    The matrices (``ndim >= 2``, but those of ``no_decay``) decay by ``weight_decay``; the other parameters
    do not; nor do the ``kernel`` parameters (the attention kernels' own), at ``kernel_lr`` times the rate
    (a group only when there are some). Frozen parameters (``requires_grad`` False) are left out. A loop
    sets ``lr = schedule · lr_factor``.
    """
    lr = check_real(lr, "lr", positive=True)
    weight_decay = check_real(weight_decay, "weight_decay", positive=False)
    kernel_lr = check_real(kernel_lr, "kernel_lr", positive=True)
    kernel, skip = [p for p in kernel if p.requires_grad], {id(p) for p in no_decay}
    own, decay, other = {id(p) for p in kernel}, [], []
    for p in module.parameters():
        if p.requires_grad and id(p) not in own:
            (decay if p.ndim >= 2 and id(p) not in skip else other).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "lr_factor": 1.0},
              {"params": other, "weight_decay": 0.0, "lr_factor": 1.0}]
    if kernel:
        groups.append({"params": kernel, "weight_decay": 0.0, "lr_factor": kernel_lr})
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


class CausalSelfAttention(nn.Module):
    """Projections, RoPE and the pluggable kernel ``self.attn`` (its inputs are what the dump captures)."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        d = config.d_model
        self.n_heads, self.head_dim, self.rope_base = config.n_heads, config.head_dim, config.rope_base
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.attn = _ATTENTION[config.attention](config, layer)
        c = config.short_conv
        self.conv = nn.Conv1d(d, d, kernel_size=c, groups=d, padding=c - 1, bias=False) if c else None

    def forward(self, x: torch.Tensor, cache: dict | None = None, *, stateful: bool = False):
        """``x [B, T, d]`` → ``[B, T, d]``; with ``stateful=True`` also the layer's decoding cache:
        ``{"offset", "conv" (the last c−1 inputs of the short conv), "attn" (the kernel's state)}``,
        continuing from ``cache`` (``None`` at the start)."""
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        offset = 0 if cache is None else cache["offset"]
        new_cache = {"offset": offset + T}
        if self.conv is not None:  # causal depthwise conv: position t mixes tokens t-c+1 … t
            c = self.conv.kernel_size[0]
            if stateful:
                prev = x.new_zeros(B, c - 1, x.shape[-1]) if cache is None else cache["conv"]  # [B, c-1, d]
                xx = torch.cat([prev, x], 1)  # [B, c-1+T, d]
                new_cache["conv"] = xx[:, xx.shape[1] - (c - 1):]
                x = self.conv(xx.transpose(1, 2))[..., c - 1:c - 1 + T].transpose(1, 2)  # [B, T, d]
            else:
                x = self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)  # [B, T, d]
        q = self.q_proj(x).view(B, T, H, D)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, H, D)  # [B, T, H, D]
        if self.rope_base is not None:  # None: no positional encoding (Zoology's models: the short conv orders)
            q = apply_rope(q, base=self.rope_base, offset=offset)
            k = apply_rope(k, base=self.rope_base, offset=offset)
        v = self.v_proj(x).view(B, T, H, D)  # [B, T, H, D]
        if stateful:
            step = getattr(self.attn, "step", None)
            if step is None:
                raise ValueError(f"attention kernel {type(self.attn).__name__} has no step(q, k, v, state): it "
                                 "cannot decode with a state")
            out, new_cache["attn"] = step(q, k, v, None if cache is None else cache["attn"])  # [B, T, H, D]
            return self.o_proj(out.reshape(B, T, H * D)), new_cache
        out = self.attn(q, k, v)  # [B, T, H, D]
        return self.o_proj(out.reshape(B, T, H * D))  # [B, T, d]


class _Block(nn.Module):
    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        d = config.d_model
        self.ln_1 = nn.LayerNorm(d)
        self.attention = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, config.mlp_ratio * d), nn.GELU(), nn.Linear(config.mlp_ratio * d, d))

    def forward(self, x: torch.Tensor, cache=None, *, stateful: bool = False):
        if stateful:
            a, cache = self.attention(self.ln_1(x), cache, stateful=True)
            x = x + a
            return x + self.mlp(self.ln_2(x)), cache
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TransformerLM(nn.Module):
    """Causal transformer language model: ``tokens[B, T] -> logits[B, T, vocab_size]``."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(_Block(config, i) for i in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self.init_weights)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        """Linear and embedding weights ``N(0, 0.02²)``, biases 0 (nanoGPT's)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check_tokens(tokens)
        x = self.embed(tokens)  # [B, T, d]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [B, T, vocab]

    def kernel_parameters(self) -> list[nn.Parameter]:
        """The attention kernels' own parameters (LLoPS's Θ, a hybrid's gates, ...; none for softmax)."""
        own = {id(p) for block in self.blocks for p in block.attention.attn.parameters()}
        return [p for p in self.parameters() if id(p) in own]

    def configure_optimizers(self, *, lr: float, weight_decay: float, kernel_lr: float = 1.0,
                             betas: tuple[float, float] = (0.9, 0.98)) -> torch.optim.AdamW:
        """AdamW over this model's parameters in groups (nanoGPT's), each with its ``"lr_factor"``.

        The matrices (``ndim >= 2``, but the embedding) decay by ``weight_decay``; the embedding, norms and
        biases do not; nor do the :meth:`kernel_parameters`, at ``kernel_lr`` times the rate (a group only
        when there are some: a softmax model keeps two groups). A loop sets ``lr = schedule · lr_factor``.
        Adam moves every parameter by about its rate per step whatever the gradient's scale, so Θ
        started at an exact special case (BASED's 0/1 selection) leaves its non-negative kernel within
        tens of steps at the model's rate; ``kernel_lr < 1`` keeps it near while the rest learns.
        """
        return adamw_groups(self, self.kernel_parameters(), no_decay=(self.embed.weight,), lr=lr,
                            weight_decay=weight_decay, kernel_lr=kernel_lr, betas=betas)

    def forward_step(self, tokens: torch.Tensor, cache: list | None = None) -> tuple[torch.Tensor, list]:
        """``tokens [B, n]`` following the tokens summarised by ``cache`` (``None``: none) →
        ``(logits [B, n, vocab], cache)``. Equals the last ``n`` rows of :meth:`forward` on the
        whole sequence; the cache holds, per layer, the kernel's state (constant in the context
        length for linear attention, a KV cache for exact attention) and the short conv's inputs."""
        self._check_tokens(tokens)
        if cache is not None and (not isinstance(cache, list) or len(cache) != len(self.blocks)):
            raise ValueError(f"cache must be None or the list of {len(self.blocks)} layer caches forward_step returned")
        x = self.embed(tokens)  # [B, n, d]
        new = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, None if cache is None else cache[i], stateful=True)
            new.append(layer_cache)
        return self.head(self.ln_f(x)), new

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype != torch.long:
            got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be a LongTensor [B, T], got {got}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), got range "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )


def cache_nbytes(cache) -> int:
    """Bytes held by the tensors of a decoding cache (:meth:`TransformerLM.forward_step`)."""
    if isinstance(cache, torch.Tensor):
        return cache.numel() * cache.element_size()
    if isinstance(cache, dict):
        return sum(cache_nbytes(x) for x in cache.values())
    if isinstance(cache, (list, tuple)):
        return sum(cache_nbytes(x) for x in cache)
    nbytes = getattr(cache, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 0


@torch.no_grad()
def generate(model: TransformerLM, prompt_tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding with the model's decoding state.

    The prompt ``[B, T0]`` (``T0 >= 1``) is read in one :meth:`TransformerLM.forward_step`, then
    each new token costs one step on the cache: for linear attention (``llops``, ``based``,
    ``psf``) memory is constant in the context length; softmax and exact polynomial attention use
    a KV cache. Returns ``[B, T0 + max_new_tokens]``: the prompt then the argmax tokens, equal to
    greedy decoding by full forward passes. The model is put in eval mode.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if not isinstance(prompt_tokens, torch.Tensor) or prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens must be a LongTensor [B, T0] with T0 >= 1, got "
                         f"{tuple(prompt_tokens.shape) if isinstance(prompt_tokens, torch.Tensor) else prompt_tokens!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    model.eval()
    out = [prompt_tokens]
    if max_new_tokens == 0:
        return prompt_tokens.clone()
    logits, cache = model.forward_step(prompt_tokens)
    for i in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out.append(nxt)
        if i + 1 < max_new_tokens:
            logits, cache = model.forward_step(nxt, cache)
    return torch.cat(out, 1)
