r"""Chunked linear attention in PyTorch (layout ``[B, T, H, D]``): the CPU path.

The sequence is cut into chunks of ``C`` tokens. Within a chunk the masked ``C × C`` score
product is formed directly; across chunks the running state
:math:`S = \sum_{s} \phi(k_s)^\top v_s \in \mathbb R^{M\times D_v}` and normaliser
:math:`z = \sum_s \phi(k_s)` carry everything earlier chunks contribute:

.. math:: o_t = \phi(q_t)^\top S_{<c} + \sum_{s \in c,\, s\le t} (\phi(q_t)\cdot\phi(k_s))\, v_s,
          \qquad \text{den}_t = \phi(q_t)\cdot z_{<c} + \sum_{s\in c,\, s\le t}\phi(q_t)\cdot\phi(k_s).

Chunks are processed a *block* of ``block_chunks`` chunks at a time, fully vectorised inside the
block (batched matmuls over ``B·H·chunks``, an exclusive cumulative sum of the per-chunk states),
with the state carried from block to block by a short Python loop. The LLoPS map is computed
block by block from ``q``/``k`` (:func:`llops_attention_chunked`), so the whole ``[B, T, H, M]``
feature tensor is never held in the forward pass. Memory in the forward pass:
``O(T·(D + Dv))`` for inputs and output plus, per block, ``O(block·(M + C) + chunks·M·Dv)``:
never ``T²``. Under autograd the per-block features and states are kept for the backward pass,
``O(T·(M + C) + (T/C)·M·Dv)``: linear in ``T``.

``non_negative=True`` (self-tensored features ``φ ⊗ φ``, kernel :math:`(\phi(q)\cdot\phi(k))^2`):
the intra-chunk scores are squared and never touch ``M²``; the inter-chunk state is
``(φ⊗φ)ᵀ v``, of size ``M²·Dv``, and the block's features ``φ ⊗ φ`` (``block·M²``) are
materialised to build and read it. That part is ``M²`` by nature (the map has ``M²`` features).

Gradients flow by autograd to every input (features, values, and Θ in the LLoPS path).
Normalisation semantics: see :mod:`sketchlab.attention.reference`.
"""

from __future__ import annotations

import torch

from .._validation import DEFAULT_MAX_BYTES, check_memory, check_positive_int
from ._checks import check_eps, check_flag, check_normalize, check_qkv, check_theta
from .reference import self_tensor

__all__ = ["DEFAULT_BLOCK_CHUNKS", "DEFAULT_CHUNK_SIZE", "feature_attention", "llops_attention_chunked", "llops_feature_fn"]

#: Tokens per chunk (the intra-chunk product is ``C × C``).
DEFAULT_CHUNK_SIZE = 64
#: Chunks processed together, vectorised, per step of the block loop.
DEFAULT_BLOCK_CHUNKS = 16


def llops_feature_fn(theta: torch.Tensor):
    r"""A function ``x[B, H, n, D] → φ(x)[B, H, n, M]`` for per-head Θ ``[H, t, p, D, M]``.

    Same map as :func:`sketchlab.llops_features` (tested against it), computed as one batched
    matmul ``x @ Θ_flat`` with ``Θ_flat = [H, D, t·p·M]`` followed by ``p - 1`` products and
    ``t - 1`` sums of ``[B, H, n, M]`` slices (the broadcast form would copy ``x`` ``t·p`` times).
    """
    H, t, p, D, M = theta.shape
    flat = theta.permute(0, 3, 1, 2, 4).reshape(H, D, t * p * M)  # [H, D, t·p·M]

    def features(x: torch.Tensor) -> torch.Tensor:
        proj = (x @ flat).unflatten(-1, (t, p, M))  # [B, H, n, t, p, M]
        out = None
        for r in range(t):
            term = proj[..., r, 0, :]
            for j in range(1, p):
                term = term * proj[..., r, j, :]  # [B, H, n, M]
            out = term if out is None else out + term
        return out

    return features


def _pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad ``x[B, H, n, ·]`` along the token axis to ``length`` (zero features/values add nothing)."""
    extra = length - x.shape[2]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, 0, 0, extra))


def _engine(feat_q, feat_k, v: torch.Tensor, length_q: int, *, causal: bool, normalize: str, non_negative: bool,
            eps: float, chunk_size: int, block_chunks: int, num_features: int, max_bytes: int) -> torch.Tensor:
    """Chunked attention on internal layout ``[B, H, ·, ·]``.

    ``feat_q(a, b)`` / ``feat_k(a, b)`` return the features ``[B, H, b - a, M]`` of tokens
    ``a:b``; ``v`` is ``[B, H, S, Dv]``. Returns ``[B, H, T, Dv]``.
    """
    B, H, S, Dv = v.shape
    C = chunk_size
    M2 = num_features**2 if non_negative else num_features
    block = C * block_chunks
    itemsize = v.element_size()
    check_memory(B * H * (block_chunks * M2 * Dv + (2 * block * M2 if non_negative else 0)) * itemsize,
                 what=f"the per-chunk states of one block ([B={B}, H={H}, {block_chunks} chunks, {M2}, {Dv}])"
                      + (f" and its self-tensored features (2 × [B, H, {block}, {M2}])" if non_negative else ""),
                 way_out="lower block_chunks or the number of features (non_negative squares it)", max_bytes=max_bytes)
    lift = self_tensor if non_negative else (lambda f: f)
    state = v.new_zeros(B, H, M2, Dv)  # Σ φ(k)ᵀ v over finished blocks
    zsum = v.new_zeros(B, H, M2)  # Σ φ(k) over finished blocks
    outs = []
    if not causal:  # one pass for the state, one for the queries
        for a in range(0, S, block):
            fk = lift(feat_k(a, min(a + block, S)))  # [B, H, n, M2]
            state = state + fk.mT @ v[:, :, a:a + block]  # [B, H, M2, Dv]
            zsum = zsum + fk.sum(2)
        for a in range(0, length_q, block):
            fq = lift(feat_q(a, min(a + block, length_q)))  # [B, H, n, M2]
            out = fq @ state  # [B, H, n, Dv]
            if normalize == "sum":
                out = out / ((fq @ zsum[..., None]) + eps)
            outs.append(out)
        return torch.cat(outs, 2)

    tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    for a in range(0, S, block):
        b = min(a + block, S)
        n = b - a
        padded = -(-n // C) * C
        N = padded // C
        fq = _pad_tokens(feat_q(a, b), padded).unflatten(2, (N, C))  # [B, H, N, C, M]
        fk = _pad_tokens(feat_k(a, b), padded).unflatten(2, (N, C))  # [B, H, N, C, M]
        vb = _pad_tokens(v[:, :, a:b], padded).unflatten(2, (N, C))  # [B, H, N, C, Dv]
        scores = fq @ fk.mT  # [B, H, N, C, C]
        if non_negative:
            scores = scores.square()  # (φ(q)·φ(k))² = (φ⊗φ)(q)·(φ⊗φ)(k), no M² here
        scores = scores.masked_fill(~tril, 0.0)
        out = scores @ vb  # [B, H, N, C, Dv]   intra-chunk
        fq2, fk2 = lift(fq), lift(fk)  # [B, H, N, C, M2]
        upd = fk2.mT @ vb  # [B, H, N, M2, Dv]  per-chunk Σ φ(k)ᵀ v
        prev = torch.cat([state[:, :, None], upd[:, :, :-1]], 2).cumsum(2)  # [B, H, N, M2, Dv] exclusive prefix
        out = out + fq2 @ prev  # inter-chunk
        state = prev[:, :, -1] + upd[:, :, -1]
        if normalize == "sum":
            zc = fk2.sum(3)  # [B, H, N, M2]
            zprev = torch.cat([zsum[:, :, None], zc[:, :, :-1]], 2).cumsum(2)  # [B, H, N, M2]
            den = (fq2 @ zprev[..., None]).squeeze(-1) + scores.sum(-1)  # [B, H, N, C]
            zsum = zprev[:, :, -1] + zc[:, :, -1]
            out = out / (den[..., None] + eps)
        outs.append(out.flatten(2, 3)[:, :, :n])  # [B, H, n, Dv]
    return torch.cat(outs, 2)


def _check_engine_args(causal, normalize, non_negative, eps, chunk_size, block_chunks):
    check_flag(causal, "causal")
    check_flag(non_negative, "non_negative")
    return (check_normalize(normalize), check_eps(eps), check_positive_int(chunk_size, "chunk_size"),
            check_positive_int(block_chunks, "block_chunks"))


def feature_attention(phi_q, phi_k, v, *, causal: bool = True, normalize: str = "sum", non_negative: bool = False,
                      eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE, block_chunks: int = DEFAULT_BLOCK_CHUNKS,
                      max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""Linear attention through given features, chunked (never ``T × S``).

    Parameters
    ----------
    phi_q : Tensor ``[B, T, H, M]``
        Query features.
    phi_k : Tensor ``[B, S, H, M]``
        Key features.
    v : Tensor ``[B, S, H, Dv]``
    causal : bool
        ``s ≤ t`` only (``T == S``).
    normalize : ``"none"`` or ``"sum"``
        Unnormalised, or divided by :math:`\sum_s a_{ts} + \varepsilon` (safe for non-negative maps
        only; see :mod:`sketchlab.attention.reference`).
    non_negative : bool
        Self-tensored features ``φ ⊗ φ`` (kernel ``(φ(q)·φ(k))²``, ``M²`` features).
    eps : float >= 0
    chunk_size : int >= 1
        Tokens per chunk ``C``.
    block_chunks : int >= 1
        Chunks vectorised together per step of the block loop.
    max_bytes : int
        Memory budget for one block's per-chunk states (:func:`sketchlab._validation.check_memory`).

    Returns
    -------
    Tensor ``[B, T, H, Dv]`` in the dtype of the inputs; equals
    :func:`~sketchlab.attention.feature_attention_naive` to round-off.
    """
    normalize, eps, chunk_size, block_chunks = _check_engine_args(causal, normalize, non_negative, eps, chunk_size,
                                                                  block_chunks)
    phi_q, phi_k, v = check_qkv(phi_q, phi_k, v, causal=causal, names=("phi_q", "phi_k", "v"))
    fq, fk = phi_q.transpose(1, 2), phi_k.transpose(1, 2)  # [B, H, T|S, M]
    out = _engine(lambda a, b: fq[:, :, a:b], lambda a, b: fk[:, :, a:b], v.transpose(1, 2), phi_q.shape[1],
                  causal=causal, normalize=normalize, non_negative=non_negative, eps=eps, chunk_size=chunk_size,
                  block_chunks=block_chunks, num_features=phi_q.shape[-1], max_bytes=max_bytes)
    return out.transpose(1, 2)  # [B, T, H, Dv]


def llops_attention_chunked(q, k, v, theta_q, theta_k, *, causal: bool = True, normalize: str = "sum",
                            non_negative: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE,
                            block_chunks: int = DEFAULT_BLOCK_CHUNKS, max_bytes: int = DEFAULT_MAX_BYTES,
                            validate: bool = True) -> torch.Tensor:
    r"""LLoPS attention, chunked, with the feature map computed block by block.

    Parameters
    ----------
    q : Tensor ``[B, T, H, D]``
    k : Tensor ``[B, S, H, D]``
    v : Tensor ``[B, S, H, Dv]``
    theta_q, theta_k : Tensor ``[H, t, p, D, M]``
        :math:`\phi(x)_i = \sum_r \prod_j \langle\theta_{r,j,:,i}, x\rangle` per head.
    causal, normalize, non_negative, eps, chunk_size, block_chunks, max_bytes
        As in :func:`feature_attention`.
    validate : bool
        Check the arguments (``False`` only from :func:`sketchlab.attention.llops_attention`,
        which has checked them already).

    Returns
    -------
    Tensor ``[B, T, H, Dv]``; gradients reach ``q, k, v, theta_q, theta_k``.
    """
    normalize, eps, chunk_size, block_chunks = _check_engine_args(causal, normalize, non_negative, eps, chunk_size,
                                                                  block_chunks)
    if validate:
        q, k, v = check_qkv(q, k, v, causal=causal)
        theta_q, theta_k = check_theta(theta_q, theta_k, heads=q.shape[2], dim=q.shape[3], like=q)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T|S, D]
    phi_q, phi_k = llops_feature_fn(theta_q), llops_feature_fn(theta_k)
    out = _engine(lambda a, b: phi_q(qt[:, :, a:b]),  # [B, H, n, M]
                  lambda a, b: phi_k(kt[:, :, a:b]),
                  v.transpose(1, 2), q.shape[1], causal=causal, normalize=normalize, non_negative=non_negative,
                  eps=eps, chunk_size=chunk_size, block_chunks=block_chunks, num_features=theta_q.shape[-1],
                  max_bytes=max_bytes)
    return out.transpose(1, 2)  # [B, T, H, Dv]
