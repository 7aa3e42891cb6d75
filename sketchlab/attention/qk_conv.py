r"""A short causal depthwise convolution on q and k, before the attention (``AttentionOptions.qk_conv``).

DeltaNet and LAWCAT put a width-``K`` (4) causal convolution on the query and key projections: each
position mixes its own q, k with those of the ``K − 1`` positions before it, which lets a kernel match
short n-grams (the recall ingredient). Per head ``h`` and channel ``d``:

.. math:: y_t[h, d] = \sum_{j=0}^{K-1} w[h, d, j]\, x_{t-K+1+j}[h, d],

with ``x`` before the sequence the carried *tail* (the last ``K − 1`` inputs of the previous call; zeros
at the start), so a state split anywhere equals the whole. The identity start
(``w[..., K−1] = 1``, the rest 0) gives ``y = x`` exactly: a converted model begins where it was.
The weights live in :class:`~sketchlab.attention.FarParams` (``conv_q``, ``conv_k``), the tails in
the state (``conv_q``, ``conv_k`` of :class:`~sketchlab.attention.AttentionState` and
:class:`~sketchlab.attention.MemoryState`). Both the exact and the sketched part see the convolved
q, k (the one q, k of the layer). :func:`causal_conv` runs a call (training, prefill, the op's one-token
call); :class:`ConvStep` is the lean decoding step (in place, checked once); :func:`causal_conv_naive` is
the float64 twin of both.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ._checks import check_key_padding_mask, check_segments
from .options import identity_conv_weight  # re-exported: the start of FarParams.conv_q/conv_k

__all__ = ["ConvStep", "causal_conv", "causal_conv_naive", "identity_conv_weight", "with_qk_conv"]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None):
    r"""Causal depthwise convolution of ``x [B, T, H, D]`` with ``weight [H, D, K]``.

    Parameters
    ----------
    x : Tensor ``[B, T, H, D]``
    weight : Tensor ``[H, D, K]``
    tail : Tensor ``[B, K − 1, H, D]`` or None
        The ``K − 1`` inputs before ``x`` (None: zeros, the start of a sequence).

    Returns
    -------
    y : Tensor ``[B, T, H, D]``
        :math:`y_t = \sum_j w_j\, x_{t-K+1+j}` (one ``conv1d`` with a group per channel).
    tail : Tensor ``[B, K − 1, H, D]``
        The last ``K − 1`` inputs, for the next call.
    """
    B, T, H, D = x.shape
    K = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(B, K - 1, H, D)
    xp = torch.cat([tail.to(x.dtype), x], 1)  # [B, K - 1 + T, H, D]
    y = F.conv1d(xp.reshape(B, K - 1 + T, H * D).transpose(1, 2),  # [B, H·D, K - 1 + T]
                 weight.to(x.dtype).reshape(H * D, 1, K), groups=H * D)  # [B, H·D, T]
    return y.transpose(1, 2).reshape(B, T, H, D), xp[:, xp.shape[1] - (K - 1):]


def causal_conv_naive(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None):
    """Float64 twin of :func:`causal_conv`: the sum written out, position by position and tap by tap."""
    x, weight = x.double(), weight.double()
    B, T, H, D = x.shape
    K = weight.shape[-1]
    before = torch.zeros(B, K - 1, H, D, dtype=torch.float64) if tail is None else tail.double()
    y = torch.zeros(B, T, H, D, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            src = t - K + 1 + j  # the input position tap j reads
            y[:, t] += weight[:, :, j] * (x[:, src] if src >= 0 else before[:, K - 1 + src])
    return y, torch.cat([before, x], 1)[:, T:]


def _tails(initial_state, options, q: torch.Tensor, k: torch.Tensor):
    """The carried tails ``(conv_q, conv_k)`` of ``initial_state`` (None, None at the start), checked."""
    if initial_state is None:
        return None, None
    tq, tk = getattr(initial_state, "conv_q", None), getattr(initial_state, "conv_k", None)
    B, _, H, D = q.shape
    want = (B, options.qk_conv - 1, H, D)
    for name, t in (("conv_q", tq), ("conv_k", tk)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = "None" if t is None else tuple(getattr(t, "shape", ()))
            raise ValueError(f"initial_state.{name} must be the short convolution's tail {list(want)} "
                             f"([B, K - 1, H, D], qk_conv={options.qk_conv}), got {got}: pass the state "
                             "that a call with the same options returned")
    return tq, tk


def with_qk_conv(run, q, k, v, *, options, params, initial_state, output_final_state: bool, key_padding_mask,
                    segments):
    """``run(q, k, v)`` on the short-convolved q, k (``options.qk_conv``; else on q, k as given), the final
    state carrying the new tails. Padded positions (``key_padding_mask`` False) enter as zeros; each
    segment starts from zeros. ``params``: the :class:`FarParams` holding ``conv_q``, ``conv_k``."""
    if not options.qk_conv:
        return run(q, k, v)
    if params is None or getattr(params, "conv_q", None) is None:
        raise ValueError(f"qk_conv={options.qk_conv} needs its weights params.conv_q and params.conv_k: build "
                         "the params with FarParams(options, heads, dim_v, dim=D)")
    H, D, K = params.conv_q.shape
    if (H, D, K) != (q.shape[2], q.shape[3], options.qk_conv):
        raise ValueError(f"params.conv_q has shape {[H, D, K]} but q has H={q.shape[2]}, D={q.shape[3]} and "
                         f"qk_conv={options.qk_conv}")
    tq, tk = _tails(initial_state, options, q, k)
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[1], q.device)
    if key_padding_mask is not None:  # pads enter the convolution as zeros, like the positions before a sequence
        keep = key_padding_mask[:, :, None, None].to(q.dtype)
        q, k = q * keep, k * keep
    if segments is None:
        (q, tq), (k, tk) = causal_conv(q, params.conv_q, tq), causal_conv(k, params.conv_k, tk)
    else:  # each joined sequence from zeros (segments never carry a state)
        cuts = check_segments(segments, q.shape[1])
        q = torch.cat([causal_conv(x, params.conv_q)[0] for x in q.split(cuts, 1)], 1)
        k = torch.cat([causal_conv(x, params.conv_k)[0] for x in k.split(cuts, 1)], 1)
    out = run(q, k, v)
    if not output_final_state:
        return out
    o, state = out
    return o, dataclasses.replace(state, conv_q=tq, conv_k=tk)


class ConvStep:
    r"""The short convolution of one decoded token at a time, in place (inference; no gradient): the lean
    decoding step's companion (:class:`sketchlab.attention.recurrent.RecurrentStep` takes the convolved
    q, k; the caller evaluates the feature maps between the two).

    The last ``K`` inputs of q and of k sit in one ring ``X [2, B·H, D, K]`` (input ``t`` in column
    ``t mod K``, the tails placed so the first new token lands in column 0); token ``t``'s output is one
    product with the taps rotated to that phase, :math:`y_t = \sum_c X[c]\, w[(c - t - 1) \bmod K]`,
    all ``K`` rotations made once per version of the weights (an optimiser's step in place is seen at
    the next token). Equal to :func:`causal_conv` on one token with the carried tail (tested in float64).

    Build it with :meth:`from_state`; :meth:`__call__` per token; :meth:`tails` writes the tails out.
    """

    def __init__(self):  # use from_state
        raise TypeError("build a ConvStep with ConvStep.from_state(state, options=..., params=...)")

    @classmethod
    @torch.no_grad()
    def from_state(cls, state, *, options, params) -> ConvStep:
        """The step continuing ``state`` (an :class:`AttentionState` or :class:`MemoryState` a call with
        ``options`` returned: its ``conv_q``, ``conv_k`` tails ``[B, K − 1, H, D]``, checked here once) with
        the weights ``params.conv_q``, ``params.conv_k`` ``[H, D, K]``."""
        if not options.qk_conv:
            raise ValueError("a ConvStep needs options.qk_conv > 0")
        if params is None or getattr(params, "conv_q", None) is None:
            raise ValueError(f"qk_conv={options.qk_conv} needs its weights params.conv_q and params.conv_k")
        H, D, K = params.conv_q.shape
        B = state.S.shape[0]
        probe = state.S.new_empty(B, 1, H, D)
        tq, tk = _tails(state, options, probe, probe)
        self = object.__new__(cls)
        self.params, self.B, self.H, self.D, self.K, self.t, self._version = params, B, H, D, K, 0, None
        tails = torch.stack([tq, tk])  # [2, B, K − 1, H, D]
        self.X = tails.new_zeros(2, B * H, D, K)
        self.X[..., 1:] = tails.permute(0, 1, 3, 4, 2).reshape(2, B * H, D, K - 1)  # inputs −K+1 … −1: columns 1 … K−1
        self._weights()
        return self

    def _weights(self) -> None:
        """The taps rotated to each phase, ``[K, 2, B·H, D, K]``, made once per version of the weights."""
        p = self.params
        try:
            key = tuple((id(w), w._version) for w in (p.conv_q, p.conv_k))
        except RuntimeError:  # inference tensors have no version: made again every token
            key = None
        if key is not None and key == self._version:
            return
        with torch.no_grad():
            w = torch.stack([p.conv_q, p.conv_k]).detach().to(self.X.dtype)  # [2, H, D, K]
            if not bool(torch.isfinite(w).all()):
                raise ValueError("the short convolution's weights (params.conv_q, conv_k) hold a value that is not finite")
            w = w.repeat(1, self.B, 1, 1)  # [2, B·H, D, K]
            self.phases = torch.stack([w.roll(r + 1, -1) for r in range(self.K)])
        self._version = key

    @torch.inference_mode()
    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q, k [B·H, 1, D]`` (one token, heads batch-major) → their convolutions, the same shapes (inference
        tensors in the ring's dtype); the ring moves on by one token."""
        self._weights()
        r = self.t % self.K
        self.X[0, :, :, r] = q.view(-1, self.D)
        self.X[1, :, :, r] = k.view(-1, self.D)
        self.t += 1
        y = torch.linalg.vecdot(self.X, self.phases[r])  # [2, B·H, D]
        return y[0, :, None], y[1, :, None]

    def tails(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``K − 1`` inputs of q and of k in position order, ``[B, K − 1, H, D]`` each (new tensors)."""
        cols = [(self.t + j) % self.K for j in range(1, self.K)]  # inputs t − K + 1 … t − 1
        x = self.X[..., cols].reshape(2, self.B, self.H, self.D, self.K - 1).permute(0, 1, 4, 2, 3)
        return x[0].clone(), x[1].clone()
