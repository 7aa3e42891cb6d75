r"""One options object for every attention path, validated once (DESIGN §7).

:class:`AttentionOptions` holds what the attention functions, the modules
(:class:`~sketchlab.attention.LLoPSAttention`, the converted layers, the toy model's kernels),
``convert_attention``, ``linearize`` and the CLIs pass on: the hybrid's layout (window, sinks,
local part), the normalisation, and the long-context memory (a sparse exact cache, a decaying far
state, a delta-rule far state). Its ``__post_init__`` checks every field once, by the one set of scalar rules
(:mod:`sketchlab._validation`: ``check_int``, ``check_real``, ``check_flag``, ``check_choice``); code that receives
an instance trusts it.

:class:`FarParams` holds the learnable tensors those options call for (the gate, the decay and the
delta rule's β), one module per attention layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from .._validation import check_choice, check_flag, check_int, check_real

__all__ = ["AttentionOptions", "BACKENDS", "BETAS", "DECAYS", "DEFAULT_BLOCK_CHUNKS", "DEFAULT_CHUNK_SIZE",
           "DENOMINATOR_CHECKS", "FarParams", "LOCALS", "NORMALIZE", "STATES"]

#: Kinds of learned decay (a float in (0, 1] is a fixed decay; None: none).
DECAYS = ("head", "input")
#: Far states.
STATES = ("additive", "delta")
#: How the delta rule's β is made.
BETAS = ("head", "input")
#: The hybrid's exact part.
LOCALS = ("softmax", "poly")
#: Normalisations.
NORMALIZE = ("none", "sum")
#: Backends.
BACKENDS = ("auto", "triton", "torch", "reference")
#: Tokens per chunk of the chunked paths (the intra-chunk product is ``C × C``).
DEFAULT_CHUNK_SIZE = 64
#: Chunks vectorised together per step of the chunked path's block loop.
DEFAULT_BLOCK_CHUNKS = 16
#: What a normalising denominator <= 0 does.
DENOMINATOR_CHECKS = ("warn", "raise", "off")


@dataclass(frozen=True)
class AttentionOptions:
    r"""Every option of (hybrid, memory) attention, checked once at construction.

    Attributes
    ----------
    causal : bool
        ``s ≤ t`` only.
    normalize : ``"none"``, ``"sum"`` or None
        ``None``: the map decides (``"sum"``; signed maps are then self-tensored).
    non_negative : bool or None
        Self-tensor the features (``None``: the map decides).
    eps : float >= 0
        Added to the normaliser.
    window, sinks : int >= 0
        Exact local keys and attention sinks; ``sinks > 0`` needs ``window >= 1``; a window needs a
        normalised attention (``normalize`` ``"sum"`` or ``None``).
    local : ``"softmax"`` or ``"poly"``
        The exact part's scores.
    local_scale : float > 0 or None
        ``s`` of the exact part (``None``: ``1/√D``).
    cache : int >= 0
        ``K`` far keys kept exact (a sparse cache; needs ``window >= 1`` and ``causal``).
    decay : None, float in (0, 1], ``"head"`` or ``"input"``
        Decay of the far state per step: none, fixed, learned per head, or from the current value.
        ``1.0`` is no decay (today's hybrid, bit for bit).
    state : ``"additive"`` or ``"delta"``
        The far state: sums ``S, z`` or the delta rule's ``S`` (needs ``causal``).
    beta : ``"head"`` or ``"input"``
        The delta rule's write strength ``β``: learned per head or from the entering key's value.
    rescore : int >= 1
        Cached keys are re-scored against the state at positions ``≡ 0 (mod rescore)``.
    qk_conv : int >= 0
        Width ``K`` of a causal depthwise convolution on q and k before the attention (0: none; 4 in
        DeltaNet), its weights ``FarParams.conv_q/conv_k`` started as the identity
        (:mod:`sketchlab.attention.qk_conv`; needs ``causal``).
    backend, chunk_size, block_chunks, denominator_check
        Execution: ``"auto" | "triton" | "torch" | "reference"``; tokens per chunk (>= 1); chunks
        vectorised together per step of the chunked path's block loop (>= 1); what a denominator
        ``<= 0`` does (``"warn" | "raise" | "off"``).
    """

    causal: bool = True
    normalize: str | None = None
    non_negative: bool | None = None
    eps: float = 1e-6
    window: int = 0
    sinks: int = 0
    local: str = "softmax"
    local_scale: float | None = None
    cache: int = 0
    decay: str | float | None = None
    state: str = "additive"
    beta: str = "head"
    rescore: int = 64
    qk_conv: int = 0
    backend: str = "auto"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    block_chunks: int = DEFAULT_BLOCK_CHUNKS
    denominator_check: str = "warn"

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("causal", check_flag(self.causal, "causal"))
        if self.normalize is not None:
            check_choice(self.normalize, "normalize", NORMALIZE)
        if self.non_negative is not None:
            check_flag(self.non_negative, "non_negative")
        set_("eps", check_real(self.eps, "eps", lo=0.0, lo_open=False))
        set_("window", check_int(self.window, "window", 0))
        set_("sinks", check_int(self.sinks, "sinks", 0))
        if self.sinks and not self.window:
            raise ValueError(f"sinks={self.sinks} needs window >= 1: window=0 is pure linear attention (no exact "
                             "keys); pass window= too")
        check_choice(self.local, "local", LOCALS)
        if self.local_scale is not None:
            set_("local_scale", check_real(self.local_scale, "local_scale", lo=0.0, lo_open=True))
        if self.window and self.normalize == "none":
            raise ValueError(f"the hybrid (window={self.window} > 0) shares one denominator between the exact and the "
                             "sketched keys and is always normalised: pass normalize='sum' (or None), got 'none'")
        set_("cache", check_int(self.cache, "cache", 0))
        if isinstance(self.decay, str):
            check_choice(self.decay, "decay", DECAYS)
        elif self.decay is not None:
            set_("decay", check_real(self.decay, "decay (a fixed decay per step)", lo=0.0, lo_open=True, hi=1.0))
        check_choice(self.state, "state", STATES)
        check_choice(self.beta, "beta", BETAS)
        set_("rescore", check_int(self.rescore, "rescore", 1))
        set_("qk_conv", check_int(self.qk_conv, "qk_conv", 0))
        if self.qk_conv and not self.causal:
            raise ValueError(f"qk_conv={self.qk_conv} needs causal=True: the convolution reads the positions "
                             "before each token and carries them across calls, which an encoder has no order for")
        check_choice(self.backend, "backend", BACKENDS)
        set_("chunk_size", check_int(self.chunk_size, "chunk_size", 1))
        set_("block_chunks", check_int(self.block_chunks, "block_chunks", 1))
        check_choice(self.denominator_check, "denominator_check", DENOMINATOR_CHECKS)
        if self.cache and not self.window:
            raise ValueError(f"cache={self.cache} needs window >= 1: cached keys share the exact window's "
                             "normalisation (window=0 has none)")
        if self.memory and not self.causal:
            raise ValueError(f"{self._memory_names()} need causal=True: the memory mechanisms are recurrences over "
                             "the token order, which an encoder (causal=False) does not have")
        if self.state == "delta" and self.normalize == "none":
            raise ValueError("state='delta' mixes two normalised parts (the exact window's and the delta state's "
                             "readout): normalize='none' has no meaning there, pass 'sum' or None")

    def _memory_names(self) -> str:
        names = []
        if self.cache:
            names.append(f"cache={self.cache}")
        if self.learned_decay or (self.decay is not None and self.decay != 1.0):
            names.append(f"decay={self.decay!r}")
        if self.state == "delta":
            names.append("state='delta'")
        return ", ".join(names)

    @property
    def learned_decay(self) -> bool:
        """The decay is a parameter (``"head"``, ``"input"``)."""
        return isinstance(self.decay, str)

    @property
    def memory(self) -> bool:
        """Any memory mechanism is on (a cache, a decay other than ``None``/``1.0``, the delta state):
        such a call runs :func:`sketchlab.attention.memory.memory_attention`."""
        return bool(self.cache or self.learned_decay or (self.decay is not None and self.decay != 1.0)
                    or self.state == "delta")

    def resolve(self, map_non_negative) -> AttentionOptions:
        r"""These options with ``normalize`` and ``non_negative`` decided for a map (the one rule of
        every entry point and module).

        ``normalize=None`` is ``"sum"``. ``non_negative=None`` self-tensors exactly when the call
        normalises (``"sum"``), the far state has a denominator (not ``state="delta"``, whose
        readout divides by none) and the map can be signed (``map_non_negative`` False): a default
        never divides by a signed sum. Given values are kept.

        Parameters
        ----------
        map_non_negative : bool or callable () -> bool
            The map's kernel is provably ``>= 0`` (``FeatureMap.non_negative``; for Θ,
            :func:`~sketchlab.llops.maps.llops_is_non_negative` of both sides); a callable is asked only
            when the answer matters (a given ``non_negative``, ``normalize="none"`` or the delta state
            never need it).
        """
        normalize = self.normalize or "sum"
        non_negative = self.non_negative
        if non_negative is None:
            needed = normalize == "sum" and self.state != "delta"
            non_negative = needed and not (map_non_negative() if callable(map_non_negative) else map_non_negative)
        if (normalize, non_negative) == (self.normalize, self.non_negative):
            return self
        return self.replace(normalize=normalize, non_negative=non_negative)

    def replace(self, **changes) -> AttentionOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict (what saved conversions and run configs record)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "options") -> AttentionOptions:
        """Options from :meth:`as_dict` output; unknown keys are refused, naming them and ``where``."""
        if not isinstance(data, dict):
            raise TypeError(f"{where}: attention options must be a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown attention option(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def identity_conv_weight(heads: int, dim: int, kernel: int, *, dtype=None, device=None) -> torch.Tensor:
    """``[H, D, K]`` weights of the identity convolution (the last tap 1, the others 0): the start of
    :class:`FarParams`' ``conv_q``, ``conv_k`` (:mod:`sketchlab.attention.qk_conv`)."""
    w = torch.zeros(heads, dim, kernel, dtype=dtype, device=device)
    w[..., -1] = 1.0
    return w


class FarParams(nn.Module):
    r"""The learnable tensors of one attention layer's far part and mixing, as ``options`` ask.

    Parameters
    ----------
    options : AttentionOptions
    heads : int
        ``H``.
    dim_v : int
        ``Dv`` (the value width: data-dependent decay and β read the value vector).
    gate : bool
        A learnable gate logit per head (``g = σ(gate)``, initialised at ``gate_init``); ``False``
        or ``window = 0``: none (``g = 1/2`` in the hybrid).
    gate_init : float
        The gate logits' initial value.
    decay_init : float in (0, 1)
        Initial decay of a learned decay (``decay_bias = logit(decay_init)``, ``decay_weight = 0``).
    beta_init : float in (0, 1)
        Initial β of the delta rule.
    dim : int or None
        ``D``, the q/k width the short convolution acts on (needed with ``options.qk_conv``).

    Attributes
    ----------
    gate : Parameter ``[H]`` or None
    decay_bias : Parameter ``[H]`` or None
        ``"head"``/``"input"`` decay: ``γ = σ(decay_bias [+ decay_weight·v_t])``.
    decay_weight : Parameter ``[H, Dv]`` or None
        ``"input"`` only.
    beta_bias : Parameter ``[H]`` or None
        ``state="delta"``: ``β = σ(beta_bias [+ beta_weight·v_j])``.
    beta_weight : Parameter ``[H, Dv]`` or None
        ``beta="input"`` only.
    conv_q, conv_k : Parameter ``[H, D, K]`` or None
        ``qk_conv = K``: the depthwise convolutions of q and k, started as the identity.
    """

    def __init__(self, options: AttentionOptions, heads: int, dim_v: int, *, gate: bool = True,
                 gate_init: float = 0.0, decay_init: float = 0.99, beta_init: float = 0.5, dim: int | None = None):
        super().__init__()
        if not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
        heads, dim_v = check_int(heads, "heads", 1), check_int(dim_v, "dim_v", 1)
        gate_init = check_real(gate_init, "gate_init", lo=-math.inf, lo_open=True)
        decay_init = check_real(decay_init, "decay_init", lo=0.0, lo_open=True, hi=1.0)
        beta_init = check_real(beta_init, "beta_init", lo=0.0, lo_open=True, hi=1.0)
        if decay_init == 1.0 or beta_init == 1.0:
            raise ValueError("decay_init and beta_init must be < 1 (their logits must be finite)")
        self.options = options
        logit = lambda p: math.log(p) - math.log1p(-p)  # noqa: E731
        zeros = lambda *shape: torch.zeros(*shape)  # noqa: E731
        self.gate = nn.Parameter(torch.full((heads,), gate_init)) if gate and options.window else None
        learned = options.learned_decay
        self.decay_bias = nn.Parameter(torch.full((heads,), logit(decay_init))) if learned else None
        self.decay_weight = nn.Parameter(zeros(heads, dim_v)) if options.decay == "input" else None
        delta = options.state == "delta"
        self.beta_bias = nn.Parameter(torch.full((heads,), logit(beta_init))) if delta else None
        self.beta_weight = nn.Parameter(zeros(heads, dim_v)) if delta and options.beta == "input" else None
        self.conv_q = self.conv_k = None
        if options.qk_conv:
            if dim is None:
                raise ValueError(f"qk_conv={options.qk_conv} needs dim= (D, the q/k width it convolves)")
            dim = check_int(dim, "dim", 1)
            self.conv_q = nn.Parameter(identity_conv_weight(heads, dim, options.qk_conv))
            self.conv_k = nn.Parameter(identity_conv_weight(heads, dim, options.qk_conv))

    def extra_repr(self) -> str:
        o = self.options
        return f"decay={o.decay!r}, state={o.state!r}, beta={o.beta!r}, qk_conv={o.qk_conv}"
