r"""Initialisations of :class:`~sketchlab.tasks.TransformerLM`: the weights shared with another model
(:func:`copy_shared_weights`) and the Θ of ``llops`` layers (:func:`init_llops`): ``"random"`` (the
construction's draw), ``"based"`` (:func:`sketchlab.as_llops` of BASED's expand map, or with ``affine``
of its Taylor map, so step 0 *is* that BASED model), ``"theta"`` (an exported Θ,
:func:`sketchlab.io.load_theta`, rescaled from the file's recorded input scale to ``D^{-1/4}``).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from .._validation import check_nonnegative_int
from .attention import input_scale, kernel_modules
from .model import TransformerLM

__all__ = ["LLOPS_INITS", "based_init_dim", "copy_shared_weights", "init_llops"]

LLOPS_INITS = ("random", "based", "theta")


def based_init_dim(head_dim: int, p: int, m: int, form: str = "expand") -> tuple[int, bool]:
    """``(d', symmetric)`` of the BASED map of ``form`` with exactly ``m`` features for degree ``p``.

    ``form="expand"``: ``C(d'+p-1, p)`` (symmetric) or ``d'^p`` features; ``form="taylor"`` (``p`` must
    be 2): ``1 + d' + C(d'+1, 2)`` or ``1 + d' + d'²``. The symmetric form is tried first, then the full
    one; ``ValueError`` lists the valid sizes when neither matches.
    """
    from ..featuremaps.based import based_num_features

    if form == "taylor" and p != 2:
        raise ValueError(f"init 'based' with affine=true is BASED's Taylor map 1 + s + s²/2: it needs p=2, got p={p}")
    for symmetric in (True, False):
        for dim in range(1, head_dim + 1):
            if based_num_features(dim, p, form, symmetric) == m:
                return dim, symmetric
    valid = sorted({based_num_features(dim, p, form, s) for dim in range(1, head_dim + 1) for s in (True, False)})
    counts = "C(d'+p-1, p) or d'^p" if form == "expand" else "1 + d' + C(d'+1, 2) or 1 + d' + d'^2"
    raise ValueError(
        f"init 'based' needs m equal to the feature count of a BASED {form} map of degree p={p} on d' <= "
        f"{head_dim} coordinates ({counts}), got m={m}; valid m: {valid}"
    )


def _theta_factor(scale_label: str, head_dim: int, where: str) -> float:
    """Factor turning a Θ fitted on ``x · c`` (the file's ``scale``) into one applied to ``x · D^{-1/4}``.

    Each of the ``p`` factors of a LLoPS feature is linear in ``x``, so ``φ_Θ(c x) = φ_{ρΘ}(D^{-1/4} x)``
    with ``ρ = c / D^{-1/4}``.
    """
    if scale_label in ("none", "sqrt-d"):
        c = 1.0 if scale_label == "none" else input_scale(head_dim)
    else:
        try:
            c = float(scale_label)
        except ValueError:
            raise ValueError(f"{where}: metadata scale must be 'none', 'sqrt-d' or a number, got {scale_label!r}") from None
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"{where}: metadata scale must be a positive finite number, got {scale_label!r}")
    return c / input_scale(head_dim)


def _based_theta(D: int, H: int, o: dict) -> tuple[torch.Tensor, dict]:
    """Θ ``[H, 1, p, D (+ 1), m]`` of BASED's map on the first ``d'`` coordinates (:func:`init_llops`)."""
    from ..featuremaps.based import ExpandMap, TaylorMap
    from ..featuremaps.to_llops import as_llops

    if o["rank"] != 1:
        raise ValueError(f"init 'based' gives a rank-1 Θ (BASED is one product per feature); the model has "
                         f"rank={o['rank']}: use rank 1")
    form = "taylor" if o["affine"] else "expand"
    if o["affine"] and o["non_negative"]:
        raise ValueError("init 'based' with affine=true is BASED's Taylor map, and non_negative=true would square "
                         "its kernel ((1 + s + s²/2)² is no BASED model): use non_negative=false")
    dim, symmetric = based_init_dim(D, o["p"], o["m"], form)
    proj = torch.eye(D, dim, dtype=torch.float64).expand(H, D, dim)  # [H, D, d']: P = [I_{d'}; 0]
    fmap = (TaylorMap(H, D, proj=proj, symmetric=symmetric) if o["affine"]
            else ExpandMap(H, D, p=o["p"], proj=proj, symmetric=symmetric))
    theta = as_llops(fmap, affine=o["affine"]).theta.detach()
    if o["affine"]:  # the Taylor map takes the unscaled q, k; the layer gives Θ x · D^{-1/4}
        theta[..., :D, :] *= D**0.25
    return theta, {"init": "based", "dim": dim, "symmetric": symmetric, **({"form": form} if o["affine"] else {})}


def init_llops(model: TransformerLM, init: str = "random", theta_file=None, *, seed: int = 0) -> dict:
    r"""Initialise the Θ of every ``llops`` layer of ``model`` in place.

    Parameters
    ----------
    model : TransformerLM
        With ``config.attention == "llops"``.
    init : {"random", "based", "theta"}
        ``"random"``: element-wise ``θ_{r,j} = G_r`` for every factor ``j`` and both sides, ``G`` i.i.d.
        ``N(0, 1/d)`` (``d`` Θ's row count), layer ``i`` from ``seed + i`` (the draw of
        :class:`~sketchlab.featuremaps.LLoPSMap`): every feature is ``Σ_r ⟨g_r, x⟩^p``, so for even ``p``
        the kernel starts non-negative. ``"based"``: ``Θ_Q = Θ_K = as_llops(ExpandMap(H, D, p=p,
        proj=P))`` with ``P = [I_{d'}; 0]`` and ``(d', symmetric)`` from :func:`based_init_dim`
        (``m`` a BASED feature count, ``rank`` 1): the model then computes exactly the ``"based-expand"``
        attention of degree ``p`` (``2p`` with ``non_negative``); with ``affine``, ``as_llops`` of BASED's
        Taylor map (``p = 2``, not ``non_negative``), its ``x`` rows times ``D^{1/4}`` (the Taylor map sees
        the unscaled q, k): the ``"based-taylor"`` attention. ``"theta"``: ``theta_file``, a
        :func:`sketchlab.io.save_theta` export of shape ``[L, H, t, p, D, m]`` matching the model,
        rescaled by :func:`_theta_factor` from its recorded ``scale`` (with ``affine``, a zero row for
        the constant coordinate: the same homogeneous features at step 0).
    theta_file : str or Path
        Required for (and only for) ``init="theta"``.
    seed : int >= 0
        For ``"random"``.

    Returns
    -------
    dict
        A JSON description of the initialisation (stored in the run's identity): ``init`` and, for
        ``"random"``, ``seed``; for ``"based"``, ``dim`` and ``symmetric`` (and ``form: "taylor"`` with
        ``affine``); for ``"theta"``, the file, its SHA-256 and ``scale``.
    """
    from ..featuremaps import LLoPSMap
    from ..io import load_theta
    from ..llops import affine_theta

    layers = kernel_modules(model)
    if model.config.attention != "llops":
        raise ValueError(f"init_llops needs a model with attention 'llops', got {model.config.attention!r}")
    if init not in LLOPS_INITS:
        raise ValueError(f"init must be one of {list(LLOPS_INITS)}, got {init!r}")
    if (theta_file is None) != (init != "theta"):
        raise ValueError(f"theta_file is required for init='theta' and only for it, got init={init!r}, "
                         f"theta_file={theta_file!r}")
    cfg, o = model.config, model.config.attention_options
    H, D = cfg.n_heads, cfg.head_dim
    if init == "random":
        seed = check_nonnegative_int(seed, "seed")
        thetas = [2 * [LLoPSMap(H, D + o["affine"], p=o["p"], m=o["m"], rank=o["rank"], seed=seed + i,
                                dtype=torch.float64).theta] for i in range(len(layers))]
        info = {"init": "random", "seed": seed}
    elif init == "based":
        theta, info = _based_theta(D, H, o)
        thetas = [(theta, theta)] * len(layers)
    else:
        path = Path(theta_file)
        theta_q, theta_k, meta = load_theta(path)  # [L, H, t, p, d, m]
        expect = (cfg.n_layers, H, o["rank"], o["p"], D, o["m"])
        if tuple(theta_q.shape) != expect:
            names = ("layers L", "heads H", "rank t", "degree p", "head dimension d", "features m")
            diff = [f"{n}: {a} in the file, {b} in the model" for n, a, b in zip(names, theta_q.shape, expect) if a != b]
            raise ValueError(f"{path}: Θ of shape [L, H, t, p, d, m] = {list(theta_q.shape)} does not match the "
                             f"model {list(expect)} ({'; '.join(diff)})")
        rho = _theta_factor(meta["scale"], D, str(path))
        if o["affine"]:  # the constant coordinate's row: zero, so step 0 has the file's homogeneous features
            theta_q, theta_k = affine_theta(theta_q), affine_theta(theta_k)
        thetas = [(tq.double() * rho, tk.double() * rho) for tq, tk in zip(theta_q, theta_k)]
        info = {"init": "theta", "file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "scale": meta["scale"]}
    with torch.no_grad():
        for layer, (tq, tk) in zip(layers, thetas):
            layer.theta_k.copy_(tk)  # Θ_Q last: a tied layer keeps it
            layer.theta_q.copy_(tq)
    return info


def copy_shared_weights(source: TransformerLM, target: TransformerLM) -> list[str]:
    """Copy every weight of ``source`` into ``target`` except the attention kernels' own tensors.

    Embeddings, projections, convolutions, norms, MLPs and the head must exist in both with the
    same shapes (the same model with another attention); the kernels' parameters and buffers
    (``blocks.i.attention.attn.*``) are left as ``target`` has them. Returns the copied names.
    """
    if not isinstance(source, TransformerLM) or not isinstance(target, TransformerLM):
        raise TypeError("copy_shared_weights takes two TransformerLM models")
    src = {k: v for k, v in source.state_dict().items() if ".attention.attn." not in k}
    dst = {k: v for k, v in target.state_dict().items() if ".attention.attn." not in k}
    if set(src) != set(dst):
        raise ValueError(
            f"the models differ outside the attention kernels: only in the source {sorted(set(src) - set(dst))}, "
            f"only in the target {sorted(set(dst) - set(src))}"
        )
    bad = [f"{k}: {tuple(src[k].shape)} vs {tuple(dst[k].shape)}" for k in src if src[k].shape != dst[k].shape]
    if bad:
        raise ValueError(f"the models' shared weights differ in shape: {'; '.join(bad)}")
    with torch.no_grad():
        for k, v in dst.items():
            v.copy_(src[k])
    return sorted(src)
