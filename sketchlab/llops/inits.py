r"""Starting points of the LLoPS fits (:func:`llops_init`): the multinomial "svd" init, Gaussian,
the CP of ``W*``, the exact forms of BASED / PolySketchFormer, or a given sketch."""

from __future__ import annotations

import math

import torch

from .._validation import DEFAULT_MAX_BYTES, check_degree, check_memory, check_pair, check_positive_int
from .svd_init import _init_svd

__all__ = ["INITS", "llops_init"]

#: Initialisations accepted by the fits (besides LLoPS maps and maps :func:`sketchlab.featuremaps.to_llops.as_llops`
#: converts).
INITS = ("svd", "random", "cp", "based", "psf")

def _init_random(q, k, sq_norm, rank, p, m, generator):
    """Gaussian Θ scaled so that ``φ_Q φ_Kᵀ`` has the root-mean-square size of ``A`` (``sq_norm = ‖A‖²``)."""
    B, _, d = q.shape
    x_rms = torch.cat([q, k], -2).pow(2).sum(-1).mean(-1).sqrt()  # [B]
    a_rms = (sq_norm / (q.shape[-2] * k.shape[-2])).sqrt()  # [B]
    sigma = (a_rms / math.sqrt(m * rank)).pow(1.0 / (2 * p)) / x_rms  # [B]
    shape = (B, rank, p, d, m)
    theta_q = torch.randn(shape, generator=generator, dtype=torch.float64).to(q.device) * sigma[:, None, None, None, None]
    theta_k = torch.randn(shape, generator=generator, dtype=torch.float64).to(q.device) * sigma[:, None, None, None, None]
    return theta_q, theta_k


def _pad(theta_q, theta_k, axis: int, size: int, generator, relative=1e-3):
    """Extend Θ ``[B, t, p, d, m]`` along ``axis`` (1: CP terms, 4: columns) to ``size`` with small
    Gaussian entries (``relative`` × each head's RMS), so a smaller special case can start a bigger fit."""
    have = theta_q.shape[axis]
    if have > size:
        what = "CP terms" if axis == 1 else "columns"
        raise ValueError(f"init has {have} {what}, more than the requested {size}")
    if have == size:
        return theta_q, theta_k
    out = []
    for theta in (theta_q, theta_k):
        rms = theta.pow(2).mean((1, 2, 3, 4)).sqrt().clamp_min(torch.finfo(torch.float64).tiny)  # [B]
        shape = list(theta.shape)
        shape[axis] = size - have
        extra = torch.randn(shape, generator=generator, dtype=torch.float64).to(theta.device)
        out.append(torch.cat([theta, extra * (relative * rms)[:, None, None, None, None]], axis))
    return out[0], out[1]


def _special_case(name, q, k, p, m, seed):
    """The BASED (project-then-expand, PCA projection) or PolySketchFormer sketch of size ``<= m``.

    Imported here, at call time.
    The baselines' own fitters, not :func:`sketchlab.fit.sketch_fitter`: the fits sit below
    :mod:`sketchlab.fit` (tests/test_layers.py).
    """
    from ..featuremaps.based import _fit_based
    from ..featuremaps.psf_random import _fit_psf

    return {"based": _fit_based, "psf": _fit_psf}[name](q, k, p=p, m=m, seed=seed).map_q


#: log10 of the smallest kernel bound a given init may have (:func:`_check_init_scale`). The direct fit's
#: normal matrices hold squares of the features (underflow near a kernel of 1e-250: a good Θ × 1e-75 at
#: p = 2 stopped on non-finite values) and Adam's second moments squares of the gradients (a good Θ × 1e-50,
#: kernel 1e-200, returned an all-zero Θ); 1e-100 leaves both a margin, and only Θ's direction matters.
_MIN_INIT_LOG10 = -100.0


def _log10_norm(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``log10 ‖x‖`` along ``dim`` without underflow (the squares of 1e-300 entries are 0): scaled by the
    largest entry first; ``-inf`` for an all-zero vector."""
    top = x.abs().amax(dim, keepdim=True)
    ratio = torch.linalg.vector_norm(x / torch.where(top > 0, top, torch.ones_like(top)), dim=dim)
    return top.squeeze(dim).log10() + ratio.log10()


def _check_init_scale(theta_q, theta_k, q64, k64, p: int) -> None:
    r"""Refuse a given init Θ ``[B, t, p, d, m]`` whose kernel underflows on these tokens.

    :math:`|\hat A_{ts}| \le \sum_i \prod_j \|\theta^Q_{j,i}\|\|\theta^K_{j,i}\| \,(\max\|q\|\max\|k\|)^p`;
    below 1e-100 (:data:`_MIN_INIT_LOG10`) the fits' normal matrices or second moments underflow: the
    direct fit returned an all-zero Θ (rel_fro 1, exit 0) from a Θ × 1e-300 and stopped on "non-finite
    loss" (blaming the input scale) from × 1e-75; Adam returned an all-zero Θ from × 1e-50. The bound is taken in logarithms, so a Θ
    of any scale is measured; an all-zero Θ (every gradient zero) is refused the same way.
    """
    with torch.no_grad():
        side = _log10_norm(theta_q, -2).sum(-2) + _log10_norm(theta_k, -2).sum(-2)  # [B, t, m]: each term's bound
        data = p * (_log10_norm(q64, -1).amax(-1) + _log10_norm(k64, -1).amax(-1))  # [B]
        bound = side.flatten(1).amax(-1) + data  # [B]
        low = bound < _MIN_INIT_LOG10  # -inf (an all-zero Θ) too
        if bool(low.any()):
            head = int(low.nonzero()[0])
            largest = max(float(theta_q[head].abs().max()), float(theta_k[head].abs().max()))
            size = "0 (an all-zero Θ)" if not math.isfinite(float(bound[head])) else f"1e{float(bound[head]):.0f}"
            raise ValueError(
                f"init Θ is too small to fit from: its kernel φ(q)ᵀφ(k) is at most {size} on these tokens (head "
                f"{head}; Θ's largest entry {largest:.3g}), below 1e{_MIN_INIT_LOG10:.0f}, where the fit's normal "
                "matrices underflow float64 and it would return an all-zero Θ (rel_fro 1) or stop on non-finite "
                "values; rescale the init Θ (only its direction matters to the fit, e.g. divide each θ_j by its "
                "norm), or start from init='svd'"
            )


def _given_thetas(init) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 Θ ``[H', t, p, d, m]`` of both sides of a given init: LLoPS maps (one for both sides, or a pair), or
    maps :func:`sketchlab.featuremaps.to_llops.as_llops` converts (which returns LLoPS maps unchanged); a
    ``TypeError`` for anything else."""
    from ..featuremaps.llops import LLoPSMap
    from ..featuremaps.to_llops import as_llops

    try:
        converted = as_llops(init)
    except TypeError:
        raise TypeError(f"init must be one of {INITS}, LLoPS maps, or maps sketchlab.as_llops converts; got "
                        f"{type(init).__name__}") from None
    pair = (converted, converted) if isinstance(converted, LLoPSMap) else converted
    return tuple(f.theta.detach().to(torch.float64) for f in pair)


def llops_init(q, k, *, p: int, m: int, rank: int = 1, init="svd", seed: int = 0,
               max_bytes: int = DEFAULT_MAX_BYTES, **cp_options):
    r"""Initial Θ for the fits: ``(theta_q, theta_k)``, float64 ``[..., rank, p, d, m]``.

    Parameters
    ----------
    q, k : Tensor ``[..., n, d]``
    p, m, rank : int
    init : {"svd", "random", "cp", "based", "psf"}, LLoPS maps, or a sketch with an LLoPS form
        ``"svd"``: the leading ``m`` terms of :math:`(\sum_a s_a (u_a^\top q)(v_a^\top k))^p`, the
        multinomial expansion of the kernel in the singular directions of :math:`QK^\top` (this is
        project-then-expand, BASED-style, with data-chosen directions and terms). ``"random"``:
        Gaussian, scaled to the size of ``A``. ``"cp"``: :func:`fit_llops_cp` (``cp_options`` go
        there). ``"based"``/``"psf"``: the BASED project-then-expand sketch (PCA projection) or
        the PolySketchFormer sketch fitted with budget ``m`` (``fit_sketch("based"/"psf", ...)``),
        converted exactly by :func:`sketchlab.featuremaps.to_llops.as_llops` (which raises for the cases
        without a rank-1 form, e.g. PSF of degree 3). LLoPS maps (an
        :class:`~sketchlab.featuremaps.LLoPSMap`, both sides, or a pair ``(map_q, map_k)``), or any maps
        :func:`sketchlab.featuremaps.to_llops.as_llops` converts, of ``prod(batch)`` heads
        (the batch flattened row-major) or one head shared by all, with matching ``p``, ``d``, at most ``m``
        features and rank ``<= rank``, is used as is. Missing CP terms and columns are filled
        with small Gaussian ones (``1e-3`` of the factors' RMS) so that alternating least squares
        can move them.
    seed : int
        Seeds every random draw (same seed, same Θ).
    max_bytes : int
        Memory budget of the init's big allocations (the svd init's candidate terms, Θ itself).
    """
    q, k = check_pair(q, k)
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    rank = check_positive_int(rank, "rank")
    batch, d = q.shape[:-2], q.shape[-1]
    q64 = q.to(torch.float64).reshape(-1, *q.shape[-2:])  # [B, n_q, d]
    k64 = k.to(torch.float64).reshape(-1, *k.shape[-2:])  # [B, n_k, d]
    generator = torch.Generator().manual_seed(seed)
    if isinstance(init, str):
        if init == "svd":
            theta_q, theta_k = _init_svd(q64, k64, p, m, generator, max_bytes)
        elif init == "random":
            from ..metrics import _kernel_sq_norm

            check_memory(2 * q64.shape[0] * rank * p * d * m * 8, what=f"Θ [{q64.shape[0]}, {rank}, {p}, {d}, {m}] float64 (two sides)",
                         way_out="use a smaller p, d or m", max_bytes=max_bytes)
            theta_q, theta_k = _init_random(q64, k64, _kernel_sq_norm(q64, k64, p, max_bytes), rank, p, m, generator)
        elif init == "cp":
            from .fit_cp import fit_llops_cp  # the CP fit starts from the svd init (aligned gauge)

            map_q, map_k = fit_llops_cp(q, k, p=p, m=m, rank=rank, seed=seed, **cp_options)
            theta_q = map_q.theta.detach().to(torch.float64)  # [B, t, p, d, m]
            theta_k = map_k.theta.detach().to(torch.float64)
        elif init in ("based", "psf"):
            return llops_init(q, k, p=p, m=m, rank=rank, init=_special_case(init, q, k, p, m, seed), seed=seed)
        else:
            raise ValueError(f"init must be one of {INITS}, LLoPS maps, or maps sketchlab.as_llops converts; got {init!r}")
    else:
        theta_q, theta_k = _given_thetas(init)  # [H', t', p', d', m'] each
        heads = q64.shape[0]
        if theta_q.shape[0] == 1 and heads > 1:  # one map shared by every head
            theta_q, theta_k = theta_q.expand(heads, *theta_q.shape[1:]), theta_k.expand(heads, *theta_k.shape[1:])
        if theta_q.shape[0] != heads or theta_q.shape[2:4] != (p, d) or theta_q.shape[-1] > m:
            raise ValueError(
                f"init LLoPS must have {heads} head(s) (batch {list(batch)} flattened) or one, p, d = {(p, d)} and at "
                f"most m={m} features to initialise this fit, got theta of shape {tuple(theta_q.shape)} "
                "([heads, t, p, d, m])"
            )
        theta_q, theta_k = theta_q.to(q.device), theta_k.to(q.device)  # [B, t', p, d, m']
        _check_init_scale(theta_q, theta_k, q64, k64, p)
        theta_q, theta_k = _pad(theta_q, theta_k, 4, m, generator)
    theta_q, theta_k = _pad(theta_q, theta_k, 1, rank, generator)
    shape = (*batch, rank, p, d, m)
    return theta_q.reshape(shape).contiguous(), theta_k.reshape(shape).contiguous()
