"""BASED maps: Taylor kernel 1 + s + s²/2, project-then-expand kernel (qᵀPPᵀk)^p, feature counts,
the budget rule for d', PCA projection.

Tolerances: float64 identities between a feature inner product and a closed-form kernel; both
are sums of ≤ d'^2 + d' + 1 rounded terms, so 1e-12 relative is ample.
"""

import pytest
import torch

from sketchlab import fit_sketch, poly_kernel
from sketchlab.featuremaps.based import (
    ExpandMap,
    TaylorMap,
    based_dim_for_budget,
    based_num_features,
    pca_projection,
    taylor_features_naive,
)

F64 = torch.float64


def _kernel(fmap, q, k):
    """``φ(q) φ(k)ᵀ`` of a map of one head on ``q [n_q, d]``, ``k [n_k, d]``."""
    return fmap.features(q[None, :, None])[0, :, 0] @ fmap.features(k[None, :, None])[0, :, 0].T


def _data(n=7, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=F64), torch.randn(n - 2, d, generator=g, dtype=F64)


@pytest.mark.parametrize("symmetric", [False, True])
def test_taylor_kernel(symmetric):
    q, k = _data()
    proj = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    s = TaylorMap(1, 5, proj=proj[None], symmetric=symmetric)
    dot = (q @ proj) @ (k @ proj).T / 3**0.5  # s = u_qᵀu_k / √d'
    want = 1 + dot + dot**2 / 2
    assert torch.allclose(_kernel(s, q, k), want, rtol=1e-12, atol=0)
    naive = taylor_features_naive(q, proj, symmetric)
    assert torch.allclose(s.features(q[None, :, None])[0, :, 0], naive, rtol=1e-12, atol=0)
    assert torch.equal(s.features_naive(q[None, :, None])[0, :, 0], naive)  # the map's twin
    assert s.num_parameters == 5 * 3 and s.dim == 3 and s.non_negative


def test_feature_counts():
    assert based_num_features(16, 2, "taylor") == 273  # BASED: d' = 16 -> 1 + 16 + 256
    assert based_num_features(16, 2, "taylor", symmetric=True) == 153
    assert based_num_features(8, 2, "expand") == 64 and based_num_features(10, 2, "expand", True) == 55
    assert based_dim_for_budget(32, 2, 64, "expand", True) == 10
    assert based_dim_for_budget(32, 3, 64, "expand", True) == 6  # C(8, 3) = 56 <= 64 < C(9, 3) = 84
    assert based_dim_for_budget(32, 2, 64, "expand", False) == 8
    assert based_dim_for_budget(3, 2, 64, "expand", False) == 3  # capped at d
    with pytest.raises(ValueError, match="below the smallest BASED taylor map"):
        based_dim_for_budget(4, 2, 2, "taylor")


@pytest.mark.parametrize("p", [1, 2, 3])
def test_expand_kernel(p):
    q, k = _data()
    proj = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
    want = ((q @ proj) @ (k @ proj).T) ** p
    for symmetric in (False, True):
        s = ExpandMap(1, 5, p=p, proj=proj[None], symmetric=symmetric)
        assert torch.allclose(_kernel(s, q, k), want, rtol=1e-12, atol=1e-12 * want.abs().max())
        assert s.non_negative == (p % 2 == 0)


def test_pca_projection_is_orthonormal_and_exact_at_full_dim():
    q, k = _data(n=12, d=4)
    p_full = pca_projection(q, k, 4)
    assert torch.allclose(p_full.T @ p_full, torch.eye(4, dtype=F64), atol=1e-12)
    s = ExpandMap(1, 4, p=2, proj=p_full[None], symmetric=False)
    assert torch.allclose(_kernel(s, q, k), poly_kernel(q, k, 2), rtol=1e-10, atol=1e-12)  # PPᵀ = I
    # the first direction keeps the most energy of [q; k] among unit vectors
    x = torch.cat([q, k])
    top = (x @ pca_projection(q, k, 1)).norm()
    other = torch.randn(4, 1, dtype=F64, generator=torch.Generator().manual_seed(3))
    assert top >= (x @ torch.nn.functional.normalize(other, dim=0)).norm()


def test_fit_based():
    q = torch.randn(2, 30, 6, generator=torch.Generator().manual_seed(0))
    k = torch.randn(2, 30, 6, generator=torch.Generator().manual_seed(1))
    fit = fit_sketch("based", q, k, p=2, m=20, seed=0)
    assert fit.report.info["dim"] == 5 and fit.report.num_features == 15  # C(6, 2) = 15 <= 20 < 21
    assert fit.tied and isinstance(fit.map_q, ExpandMap) and fit.map_q.proj.shape == (2, 6, 5)
    assert fit.report.num_parameters == 6 * 5  # one head's projection
    rnd = fit_sketch("based", q, k, p=2, m=20, seed=0, projection="random", symmetric=False)
    assert rnd.map_q.dim == 4 and rnd.report.num_features == 16
    # d = 7 (D = 28): m = 21 would equal D = C(7, 2) = 21 at d = 6, which fit_sketch rejects (tail 0)
    q7, k7 = torch.randn(2, 30, 7, generator=torch.Generator().manual_seed(4)), torch.randn(2, 30, 7, generator=torch.Generator().manual_seed(5))
    tay = fit_sketch("based", q7, k7, p=2, m=21, seed=0, form="taylor")
    assert tay.report.num_features == 21 and isinstance(tay.map_q, TaylorMap)  # d' = 4: 1 + 4 + 16
    with pytest.raises(ValueError, match="p must be 2"):
        fit_sketch("based", q, k, p=3, m=20, form="taylor")
    with pytest.raises(ValueError, match="projection must be"):
        fit_sketch("based", q, k, p=2, m=20, projection="learned")


def test_pca_projection_validates_dim():
    q, k = _data(n=12, d=4)
    for bad in (0, -1):  # used to slice vh[:-1] (d - 1 columns) or vh[:0] (no columns)
        with pytest.raises(ValueError, match="dim .* must be an integer >= 1"):
            pca_projection(q, k, bad)
    with pytest.raises(TypeError, match="dim"):
        pca_projection(q, k, 2.0)
    with pytest.raises(ValueError, match="must be <= d = 4, got 5"):
        pca_projection(q, k, 5)
    with pytest.raises(ValueError, match="rank bound"):  # 2 tokens in all: rank <= 2 < 3 <= d
        pca_projection(q[:1], k[:1], 3)
    assert pca_projection(q, k, 4).shape == (4, 4)


def test_taylor_naive_requires_a_matrix():
    proj = torch.eye(3, dtype=F64)
    with pytest.raises(ValueError, match=r"x\[n, d\], got shape \(3,\)"):
        taylor_features_naive(torch.ones(3, dtype=F64), proj)
    with pytest.raises(ValueError, match=r"proj\[d, d'\] with d = x.shape\[1\] = 3"):
        taylor_features_naive(torch.ones(2, 3, dtype=F64), torch.eye(4, dtype=F64))


def test_random_projection_follows_the_input_device():
    # The projection is drawn on a CPU generator and must then live on q's device. The "meta"
    # device (shapes only, no data) stands in for a GPU on this CPU-only machine: without the
    # move, proj would stay on the CPU.
    from sketchlab.featuremaps.based import _fit_based

    q = torch.empty(2, 30, 6, device="meta")
    s = _fit_based(q, q, p=2, m=20, seed=0, projection="random").map_q
    assert s.proj.device.type == "meta" and s.features(torch.empty(1, 30, 2, 6, device="meta")).device.type == "meta"
    # the draw itself is the same as on the CPU (same seed, same P)
    cpu = _fit_based(torch.zeros(2, 30, 6), torch.zeros(2, 30, 6), p=2, m=20, seed=0, projection="random").map_q
    assert cpu.proj.device.type == "cpu" and cpu.proj.shape == s.proj.shape


def test_pca_projection_spans_the_top_singular_subspace():
    # Tokens with singular values 8, 4, 2, 1, 0.5, 0.25 along a random orthonormal basis: the top-3 PCA
    # projector must equal V₃V₃ᵀ of [q; k] (gaps ≥ 2×, so the subspace is well conditioned: 1e-10).
    # A random (JL) projection spans a random 3-d subspace: its projector differs by O(1).
    gen = torch.Generator().manual_seed(11)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=F64))[0]
    scales = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25], dtype=F64)
    x = torch.linalg.qr(torch.randn(40, 6, generator=gen, dtype=F64))[0] * scales @ basis.T  # [40, 6]
    q, k = x[:25], x[25:]
    proj = pca_projection(q, k, 3)
    want = basis[:, :3] @ basis[:, :3].T
    assert torch.allclose(proj @ proj.T, want, atol=1e-10)


def test_fit_based_pca_is_exact_on_data_in_a_subspace():
    # q, k in a 3-d subspace of R^6; m = 6 = C(3+1, 2) gives d' = 3 symmetric expand features, and the
    # PCA projection recovers the subspace, so the kernel (qᵀΠk)² equals (qᵀk)² to round-off (rel_fro
    # ≤ 1e-10 in float64). A random projection loses part of the subspace: rel_fro of order 1.
    gen = torch.Generator().manual_seed(12)
    basis = torch.linalg.qr(torch.randn(6, 3, generator=gen, dtype=F64))[0]  # [6, 3]
    q = torch.randn(2, 30, 3, generator=gen, dtype=F64) @ basis.T  # [2, 30, 6]
    k = torch.randn(2, 30, 3, generator=gen, dtype=F64) @ basis.T
    fit = fit_sketch("based", q, k, p=2, m=6, seed=0)
    assert fit.report.info["dim"] == 3
    assert bool((fit.report.rel_fro <= 1e-10).all()), fit.report.rel_fro
    rnd = fit_sketch("based", q, k, p=2, m=6, seed=0, projection="random")
    assert bool((rnd.report.rel_fro > 0.1).all()), rnd.report.rel_fro


def test_fit_based_takes_an_explicit_dim_and_checks_it():
    """``dim=`` overrides the budget rule (the projection has ``dim`` columns); a non-positive one is refused
    naming ``dim``."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 30, 6, dtype=torch.float64), torch.randn(2, 30, 6, dtype=torch.float64)
    fit = fit_sketch("based", q, k, p=2, m=10, dim=3)
    assert fit.report.info["dim"] == 3 and fit.map_q.dim == 3
    with pytest.raises(ValueError, match=r"dim must be an integer >= 1, got 0"):
        fit_sketch("based", q, k, p=2, m=10, dim=0)
