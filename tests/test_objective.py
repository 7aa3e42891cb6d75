"""The shared gradient trainer of the learned sketches (sketchlab.objective): its flags, messages and output.

The learned sketches' own tests check their fitted kernels; these check what ``train_kernel_sketch``
and ``check_finite_loss`` report about a fit: the ``converged`` flag against its documented rule, the
location of a non-finite loss, the memory refusal's description of the kernel, and that
``progress=False`` prints nothing.
"""

import re

import pytest
import torch

from sketchlab.objective import check_finite_loss, kernel_loss, train_kernel_sketch
from sketchlab.polynomial import poly_kernel

F64 = torch.float64


def _problem(heads=2, n=12, d=3, m=4, seed=0):
    """A linear-map sketch φ(x) = x W per head (q/k shared), ``W [heads, d, m]``, on random tokens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, d, generator=g, dtype=F64)
    k = torch.randn(heads, n, d, generator=g, dtype=F64)
    w = torch.randn(heads, d, m, generator=g, dtype=F64).requires_grad_(True)
    return [w], (lambda a, b: (a @ w, b @ w)), q, k


def test_converged_follows_its_rule_over_the_last_ten_steps():
    """``converged``: the summed loss moved by less than ``tol`` (relative) over the last 10 steps."""
    # a learning rate of 1e-14 moves the loss by ~1e-14 relative: converged
    params, features, q, k = _problem()
    info = train_kernel_sketch(params, features, q, k, 2, steps=20, lr=1e-14)
    assert info["converged"] is True and info["steps"] == 20
    # fewer than 11 evaluations (steps + 1): never converged, however flat
    params, features, q, k = _problem()
    assert train_kernel_sketch(params, features, q, k, 2, steps=5, lr=1e-14)["converged"] is False
    # a real fit still improving by far more than tol over its last 10 steps: not converged
    params, features, q, k = _problem()
    info = train_kernel_sketch(params, features, q, k, 2, steps=12, lr=0.05)
    assert info["converged"] is False
    assert bool((info["rel_fro"] < info["init_rel_fro"]).all())


def test_rel_fro_reports_the_kept_parameters():
    """``rel_fro`` is ‖φ_Q φ_Kᵀ − A‖_F/‖A‖_F of the parameters left in place (the best seen), per head,
    recomputed here from them; ``init_rel_fro`` that of the start."""
    params, features, q, k = _problem()
    exact = poly_kernel(q, k, 2)
    start = (kernel_loss(*features(q, k), exact) / (exact**2).sum((-2, -1))).sqrt().detach()
    info = train_kernel_sketch(params, features, q, k, 2, steps=30, lr=0.05)
    with torch.no_grad():
        now = (kernel_loss(*features(q, k), exact) / (exact**2).sum((-2, -1))).sqrt()
    torch.testing.assert_close(info["init_rel_fro"], start, rtol=1e-12, atol=0)
    torch.testing.assert_close(info["rel_fro"], now, rtol=1e-12, atol=0)
    assert info["rel_fro"].shape == (2,)


def test_a_non_finite_loss_names_the_step_and_where():
    loss = torch.tensor([1.0, float("nan"), 2.0, float("inf")])
    with pytest.raises(FloatingPointError, match=re.escape("at step 7 for 2 head(s), flattened batch indices [1, 3];")):
        check_finite_loss(loss, 7, "Adam")
    with pytest.raises(FloatingPointError, match=re.escape("at step 0 for 2 head(s), (layer, head) [(0, 1), (1, 1)];")):
        check_finite_loss(loss, 0, "Adam", batch=(2, 2))
    check_finite_loss(torch.ones(3), 0, "Adam")  # finite: no error


def test_memory_refusal_describes_the_kernel_by_its_token_counts():
    """The kernel of each head is n_q × n_k: the refusal states those (5 × 7 here, with 3 heads)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 5, 2, generator=g), torch.randn(3, 7, 2, generator=g)
    w = torch.randn(3, 2, 4, generator=g).requires_grad_(True)
    with pytest.raises(ValueError, match=re.escape("the kernel, residual and gradient of 3 head(s) (5 x 7, torch.float32)")):
        train_kernel_sketch([w], lambda a, b: (a @ w, b @ w), q, k, 2, steps=3, max_bytes=100)


def test_progress_false_prints_nothing_and_true_shows_the_bar(capfd):
    params, features, q, k = _problem()
    train_kernel_sketch(params, features, q, k, 2, steps=3, lr=1e-3, progress=False, what="quiet fit")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    params, features, q, k = _problem()
    train_kernel_sketch(params, features, q, k, 2, steps=3, lr=1e-3, progress=True, what="loud fit")
    out, err = capfd.readouterr()
    assert "loud fit" in err
