r"""``LLoPSAttention``: a multi-head attention block whose kernel is a per-head LLoPS map.

Layout ``[B, T, E]`` for the block's input and output (``E = embed_dim``), ``[B, T, H, D]`` for the
per-head queries, keys and values inside. The block computes

.. math:: q, k, v = x W_Q, x W_K, x W_V \;(\text{split into } H \text{ heads of } D), \qquad
          o = \mathrm{LLoPSAttn}(s\,q, s\,k, v)\, W_O,

where ``s`` is the factor the Q/K were scaled by when Θ was fitted (``"sqrt-d"`` → ``D^{-1/4}``,
so :math:`\phi(s q)\cdot\phi(s k)` approximates :math:`(q\cdot k/\sqrt D)^p`) and LLoPSAttn is
:func:`sketchlab.attention.linear_attention` through two :class:`~sketchlab.featuremaps.LLoPSMap` of Θ
``[H, t, p, D, M]`` (the fused Triton kernel on CUDA), called by the one layer core
(:class:`~sketchlab.attention.layer.LinearAttentionCore`) the block is an adapter over.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import DEFAULT_MAX_BYTES, as_float_tensor, check_degree, check_memory, check_positive_int
from ..featuremaps import LLoPSMap
from ..io.formats import rename_keys
from ..scaling import resolve_scale, scale_label
from ._checks import check_flag, check_theta
from .layer import LinearAttentionCore
from .options import DEFAULT_CHUNK_SIZE, AttentionOptions

__all__ = ["LLoPSAttention"]

#: The state-dict keys of Θ before the block became an adapter over the one layer core -> today's.
OLD_KEYS = (("theta_q", "map_q.theta"), ("theta_k", "map_k.theta"))


def _local_scale(qk_scale: float, head_dim: int, scale) -> float:
    """The window's softmax logit factor ``1/(√D·s²)`` on q, k already multiplied by ``s``; a ``scale``
    whose square under- or overflows float64 is refused naming it (it divided by zero)."""
    square = qk_scale * qk_scale
    if not (0 < square < math.inf) or not math.isfinite(head_dim ** -0.5 / square):
        raise ValueError(f"scale={scale!r}: the window's softmax divides the scaled qᵀk by scale² = {square:.3g}, which "
                         "under- or overflows float64; give a scale between 1e-100 and 1e100 ('sqrt-d' or 'none' are "
                         "the usual ones)")
    return head_dim ** -0.5 / square


class LLoPSAttention(LinearAttentionCore):
    r"""Multi-head attention with per-head LLoPS feature maps (linear in ``T``): the four projections and the
    Q/K scale around the one layer core (:class:`~sketchlab.attention.layer.LinearAttentionCore`).

    Attributes
    ----------
    options : AttentionOptions
        Every option of the block's attention, validated once here, its defaults decided by the core
        (:meth:`~sketchlab.attention.layer.LinearAttentionCore.resolved_options`) and passed on as it is.
    map_q, map_k : LLoPSMap
        Θ_Q and Θ_K (``map_k`` None: tied); :attr:`theta_q` and :attr:`theta_k` read them.
    far : FarParams or None
        The decay's, β's and the short convolution's learnable tensors (memory options or ``qk_conv`` only).

    Parameters
    ----------
    embed_dim : int
        Model width ``E`` of the input ``x[B, T, E]``.
    num_heads : int
        Heads ``H``; the head dimension is ``head_dim`` (default ``E // H``, which must divide).
    p, m, rank : int or None
        Degree, features per map ``M`` and CP rank ``t``. Without ``theta_q`` they size a fresh Θ
        (defaults 2, 64, 1); with it, any that is given must equal Θ's (an export of the wrong
        degree or size is rejected, not silently used).
    theta_q, theta_k : Tensor ``[H, t, p, D, M]`` or None
        Initial Θ; ``theta_k=None`` ties the key map to the query map. Without ``theta_q``, Θ is
        drawn (seeded) as :math:`\theta_{r,1} = \dots = \theta_{r,p} \sim N(0, 1/D)`, so each feature
        is :math:`(\theta_r\cdot x)^p`, non-negative for even ``p`` (safe with ``normalize="sum"``).
    learn_theta : bool
        Θ as parameters (trained with the block) or frozen buffers.
    scale : "none", "sqrt-d" or float
        Factor ``s`` applied to ``q`` and ``k`` before the feature map (see the module docstring).
    causal, normalize, non_negative, eps, backend, chunk_size
        Passed to :func:`sketchlab.attention.linear_attention`. ``normalize=None`` (the default)
        picks ``"sum"``, and with a given Θ that can be signed (not rank 1 with equal factors and
        even ``p``, :func:`llops_is_non_negative`) and ``non_negative`` not given it self-tensors
        (``non_negative=True``): a default never divides by a signed sum.
    window, sinks, local : int, int, str
        The sliding-window hybrid (:func:`~sketchlab.attention.linear_attention`); the local
        scores use ``qᵀk/√D`` of the unscaled projections (softmax) or the same scaled ``q, k``
        as the sketch (poly, so the local block is the exact kernel the sketch approximates).
    gate : bool
        A learnable per-head gate logit (initialised to 0: ``g = 1/2``) when ``window > 0``;
        ``False``: ``g = 1/2`` fixed.
    cache, decay, state, beta
        The long-context memory (DESIGN §7), as :class:`~sketchlab.attention.AttentionOptions`. With any
        of them on, the block holds a :class:`~sketchlab.attention.FarParams` (``far``; the gate stays
        ``gate``, where saved blocks have it) and its state is a :class:`~sketchlab.attention.MemoryState`;
        ``decay=1.0`` is no decay (no ``far``).
    qk_conv : int
        A causal depthwise convolution of width ``K`` on q and k (:mod:`sketchlab.attention.qk_conv`;
        0: none), its weights ``far.conv_q/conv_k`` started as the identity, its tails in the state.
    bias : bool
        Biases in the four projections.
    seed : int
        Seeds the projections' and Θ's initialisation.
    dtype, device
        Of every parameter.
    max_bytes : int
        Memory budget of the parameters as drawn (the four projections in float64, then cast, and Θ),
        checked before any allocation (:func:`sketchlab._validation.check_memory`: the size, the budget,
        the way out). Default 4 GiB.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, head_dim: int | None = None, p: int | None = None,
                 m: int | None = None, rank: int | None = None, theta_q=None, theta_k=None, learn_theta: bool = True, scale="sqrt-d",
                 causal: bool = True, normalize: str | None = None, non_negative: bool | None = None,
                 eps: float = 1e-6, backend: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE, bias: bool = False,
                 seed: int = 0, window: int = 0, sinks: int = 0, local: str = "softmax", gate: bool = True,
                 cache: int = 0, decay=None, state: str = "additive", beta: str = "head", qk_conv: int = 0,
                 dtype: torch.dtype = torch.float32, device=None, max_bytes: int = DEFAULT_MAX_BYTES):
        embed_dim = check_positive_int(embed_dim, "embed_dim")
        num_heads = check_positive_int(num_heads, "num_heads")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads} (or pass head_dim)")
            head_dim = embed_dim // num_heads
        head_dim = check_positive_int(head_dim, "head_dim")
        # every option checked once, by the options object (its local scale and self-tensoring are settled below)
        options = AttentionOptions(causal=causal, normalize=normalize, non_negative=non_negative, eps=eps,
                                   window=window, sinks=sinks, local=local, cache=cache, decay=decay, state=state,
                                   beta=beta, qk_conv=qk_conv, backend=backend, chunk_size=chunk_size)
        given_theta = theta_q is not None
        qk_scale = resolve_scale(scale, head_dim)
        check_flag(learn_theta, "learn_theta")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        gen = torch.Generator().manual_seed(seed)
        inner = num_heads * head_dim
        if theta_q is None:  # checked before the estimate; drawn after the projections (the generator's order)
            p = check_degree(2 if p is None else p)
            m = check_positive_int(64 if m is None else m, "m")
            rank = check_positive_int(1 if rank is None else rank, "rank")
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 8
        draw = 4 * embed_dim * inner * (8 + itemsize)  # drawn in float64, then cast
        check_memory(draw + (0 if theta_q is not None else 2 * num_heads * rank * p * head_dim * m * 8),
                     what=f"LLoPSAttention({embed_dim}, {num_heads}): its four {embed_dim}x{inner} projections "
                          "(drawn in float64) and its Θ", way_out="give a smaller embed_dim, head_dim or m",
                     max_bytes=max_bytes)

        def linear(n_in, n_out):
            layer = nn.Linear(n_in, n_out, bias=bias, dtype=torch.float64)
            bound = 1 / math.sqrt(n_in)  # nn.Linear's default range, drawn from our generator
            with torch.no_grad():
                layer.weight.uniform_(-bound, bound, generator=gen)
                if bias:
                    layer.bias.uniform_(-bound, bound, generator=gen)
            return layer.to(dtype=dtype, device=device)

        projections = [linear(embed_dim, inner), linear(embed_dim, inner), linear(embed_dim, inner),
                       linear(inner, embed_dim)]  # q, k, v, o

        if theta_q is None:
            base = torch.randn(num_heads, rank, 1, head_dim, m, generator=gen, dtype=torch.float64) / math.sqrt(head_dim)
            theta_q = base.expand(-1, -1, p, -1, -1).clone()  # [H, t, p, D, M], equal factors
            theta_k = None
        theta_q = as_float_tensor(theta_q, "theta_q").detach().to(dtype=dtype, device=device)
        tied = theta_k is None
        theta_k = theta_q if tied else as_float_tensor(theta_k, "theta_k").detach().to(dtype=dtype, device=device)
        probe = torch.empty(0, dtype=dtype, device=theta_q.device)
        check_theta(theta_q, theta_k, heads=num_heads, dim=head_dim, like=probe)
        for name, want, axis in (("p (the degree)", p, 2), ("m (features per map)", m, 4), ("rank", rank, 1)):
            if want is not None and want != theta_q.shape[axis]:
                raise ValueError(
                    f"theta_q has {name} = {theta_q.shape[axis]} (axis {axis} of [H, t, p, D, M] = "
                    f"{list(theta_q.shape)}), but {name.split()[0]}={want} was asked for"
                )
        if not given_theta:  # a drawn Θ starts with equal factors and is taken as unsigned
            options = options.resolve(True)
        check_flag(gate, "gate")
        window = options.window
        # local scores: softmax on qᵀk/√D of the projections (q, k arrive scaled by s: divide s² out);
        # poly on the scaled q, k, the kernel the sketch approximates
        local_scale = _local_scale(qk_scale, head_dim, scale) if options.local == "softmax" and window else 1.0
        map_q = LLoPSMap(num_heads, head_dim, theta=theta_q, learn=learn_theta)
        map_k = None if tied else LLoPSMap(num_heads, head_dim, theta=theta_k, learn=learn_theta)
        super().__init__(map_q, map_k, options=options.replace(local_scale=local_scale), heads=num_heads,
                         dim_v=head_dim, dim=head_dim, gate=gate, dtype=dtype, device=device)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = projections
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.qk_scale, self.scale_label, self.tied = qk_scale, scale_label(scale), tied

    def _load_from_state_dict(self, state_dict, prefix, *args):  # blocks saved before the one layer core: Θ's keys
        super()._load_from_state_dict(rename_keys(state_dict, prefix, OLD_KEYS), prefix, *args)

    @property
    def theta_q(self) -> torch.Tensor:
        """Θ_Q ``[H, t, p, D, M]`` (``map_q.theta``: a parameter, or a buffer without ``learn_theta``)."""
        return self.map_q.theta

    @property
    def theta_k(self) -> torch.Tensor | None:
        """Θ_K (``map_k.theta``); None when tied to Θ_Q."""
        return None if self.map_k is None else self.map_k.theta

    @property
    def degree(self) -> int:
        """Degree ``p`` of each map."""
        return self.theta_q.shape[2]

    @property
    def num_features(self) -> int:
        """Features ``M`` per map."""
        return self.theta_q.shape[-1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segments=None, key_padding_mask=None,
               initial_state=None, output_final_state: bool = False):
        """The attention core on per-head tensors: ``q, k [B, T, H, D]``, ``v [B, T, H, Dv]`` → ``[B, T, H, Dv]``.

        Applies the Q/K scale, then the core's call of :func:`~sketchlab.attention.linear_attention` with this
        block's maps, options, gate and far parameters; ``segments`` (lengths of sequences joined along the token axis) keeps each
        causal mask inside its own sequence; ``initial_state``/``output_final_state`` carry the
        state (an :class:`AttentionState`, or a :class:`MemoryState` with memory options).
        """
        out = super().attend(q * self.qk_scale, k * self.qk_scale, v, segments=segments,
                             key_padding_mask=key_padding_mask, initial_state=initial_state,
                             output_final_state=output_final_state)
        return out if output_final_state else out[0]

    def forward(self, x: torch.Tensor, *, key_padding_mask=None, initial_state=None, output_final_state: bool = False):
        """``x[B, T, E]`` → ``[B, T, E]`` (or ``(y, AttentionState)``): projections, per-head LLoPS
        attention, output projection."""
        x = as_float_tensor(x, "x")
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have layout [B, T, E={self.embed_dim}], got shape {tuple(x.shape)}")
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, H, D]
        v = self.v_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, H, D]
        out = self.attend(q, k, v, key_padding_mask=key_padding_mask, initial_state=initial_state,
                          output_final_state=output_final_state)  # [B, T, H, D]
        state = None
        if output_final_state:
            out, state = out
        out = out.to(x.dtype)  # backend "reference" computes (and returns) float64
        y = self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))  # [B, T, E]
        return (y, state) if output_final_state else y

    def step(self, x_t: torch.Tensor, state=None):
        """Decode one token: ``x_t [B, E]`` and the state of the tokens before it (``None`` at the
        start) → ``(y_t [B, E], state)``. Costs ``O(M·Dv + (window + sinks)·D)`` per head at any
        context length; a loop of steps equals :meth:`forward` on the whole sequence."""
        if not self.causal:
            raise ValueError("step decodes causal attention; this block has causal=False")
        x_t = as_float_tensor(x_t, "x_t")
        if x_t.ndim != 2 or x_t.shape[-1] != self.embed_dim:
            raise ValueError(f"x_t must have layout [B, E={self.embed_dim}], got shape {tuple(x_t.shape)}")
        y, state = self.forward(x_t[:, None], initial_state=state, output_final_state=True)
        return y[:, 0], state

    @classmethod
    def from_pretrained(cls, theta_file, layer: int = 0, *, embed_dim: int | None = None, **kwargs) -> LLoPSAttention:
        """A block with the Θ of one layer of a Θ export (:func:`sketchlab.load_theta`, DESIGN.md §3).

        Parameters
        ----------
        theta_file : str or Path
            A ``.safetensors`` file with ``theta_q``, ``theta_k`` ``[L, H, t, p, d, m]`` and its
            metadata; the file's ``scale`` becomes the block's Q/K scale.
        layer : int
            Which layer (``0 … L-1``, negative counts from the end).
        embed_dim : int or None
            Model width; default ``H·d``.
        **kwargs
            Other :class:`LLoPSAttention` arguments (``learn_theta``, ``normalize``, ``seed``, ...).
            The projections are initialised fresh (the export holds Θ only). A fitted Θ is
            usually signed (rank > 1, or unequal factors): unless ``normalize``/``non_negative``
            are given, the block then self-tensors it (``non_negative=True``, ``M²`` features),
            so the default never divides by a signed sum (on the shipped MQAR dump the raw
            ``"sum"`` meets denominators ``<= 0``; tested).
        """
        from ..io import load_theta, select_indices

        theta_q, theta_k, meta = load_theta(theta_file)
        if "scale" in kwargs:
            raise ValueError(f"{theta_file}: scale comes from the file's metadata ({meta['scale']!r}); do not pass scale")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {layer!r}")
        (index,) = select_indices([layer], theta_q.shape[0], "layer", str(theta_file))
        L, H, t, p, d, m = theta_q.shape
        dtype = kwargs.pop("dtype", theta_q.dtype)
        block = cls(H * d if embed_dim is None else embed_dim, H, head_dim=d, theta_q=theta_q[index],
                    theta_k=theta_k[index], scale=meta["scale"], dtype=dtype, **kwargs)
        block.source = {"file": str(theta_file), "layer": index, **{key: meta[key] for key in ("method", "source_sha256")}}
        return block

    @classmethod
    def from_fit(cls, fit, *, layer: int | None = None, scale="none", embed_dim: int | None = None,
                 **kwargs) -> LLoPSAttention:
        """A block with the maps of a fit (``fit_sketch``'s :class:`~sketchlab.Fit`).

        Parameters
        ----------
        fit : Fit
            Of LLoPS maps, or of maps with an exact LLoPS form (:func:`sketchlab.as_llops`: ``TiedLLoPSMap``,
            ``ExpandMap``, ``PSFRandomMap``), of batch shape ``[]``, ``[H]`` or ``[L, H]`` (then pick ``layer``).
        layer : int or None
            Required when the fit has a layer axis.
        scale : "none", "sqrt-d" or float
            The factor q and k were scaled by when the maps were fitted.
        """
        from ..export import fit_llops_maps

        map_q, map_k = fit_llops_maps(fit)
        theta_q, theta_k = map_q.theta.detach(), None if map_k is map_q else map_k.theta.detach()  # [L·H, t, p, d, m]
        lead = tuple(fit.batch_shape)
        if len(lead) == 2:
            if layer is None:
                raise ValueError(f"the fit has layers and heads {list(lead)}: pass layer=")
            from ..io import select_indices

            (index,) = select_indices([layer], lead[0], "layer", "fit")
            theta_q = theta_q.reshape(*lead, *theta_q.shape[1:])[index]
            theta_k = None if theta_k is None else theta_k.reshape(*lead, *theta_k.shape[1:])[index]
        elif len(lead) > 2:
            raise ValueError(f"the fit must have batch shape [], [H] or [L, H], got {list(lead)}")
        elif len(lead) == 1 and layer is not None:
            raise ValueError(f"the fit has no layer axis (batch shape {list(lead)}); pass layer=None")
        H, _, _, d, _ = theta_q.shape
        dtype = kwargs.pop("dtype", theta_q.dtype)
        return cls(H * d if embed_dim is None else embed_dim, H, head_dim=d, theta_q=theta_q, theta_k=theta_k,
                   scale=scale, dtype=dtype, **kwargs)
