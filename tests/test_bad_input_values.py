"""Values no computation can use: non-finite attention inputs, Θ and q/k whose kernel underflows or
overflows the dtype, dumps whose kernel energy underflows float64 or overflows it, a rank-deficient
kernel. Each gives a clear error (or a warning) naming the tensor and the way out, never an
all-zero or NaN result with exit 0."""

import re
import warnings

import pytest
import torch
from attention_calls import run_llops

import sketchlab as sl
from sketchlab.cli import main

B, T, H, D, M = 2, 16, 2, 8, 6


def _attention_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    theta = (torch.randn(H, 1, 2, D, M, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    return q, k, v, theta


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_llops_attention_refuses_non_finite_inputs(backend, name, bad):
    q, k, v, theta = _attention_inputs()
    tensors = {"q": q, "k": k, "v": v}
    tensors[name] = tensors[name].clone()
    tensors[name][1, 3, 0, 2] = bad
    with pytest.raises(ValueError, match=rf"^{name} must be finite: 1 non-finite value\(s\) of {B * T * H * D}, "
                                         rf"the first at index \(1, 3, 0, 2\)"):
        run_llops(tensors["q"], tensors["k"], tensors["v"], theta, theta, backend=backend)


@pytest.mark.parametrize("attend", ["poly", "softmax"])
def test_other_attention_functions_refuse_nan_too(attend):
    q, k, v, _ = _attention_inputs()
    q = q.clone()
    q[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^q must be finite"):
        sl.poly_attention(q, k, v, 2) if attend == "poly" else sl.softmax_attention(q, k, v)


@pytest.mark.parametrize("non_negative", [False, True])
def test_theta_scaled_to_underflow_is_refused(non_negative):
    q, k, v, theta = _attention_inputs()
    # p = 2, |θ| ~ 0.3e-30: φ ~ 1e-61·‖x‖², far below float32's 1.2e-38; without the check the output is all 0
    with pytest.raises(ValueError, match=r"theta_q, theta_k with q, k underflow torch.float32: every kernel value of "
                                         r"head 0 is at most .*e-\d{3}, below the smallest normal number 1.18e-38"):
        run_llops(q, k, v, theta * 1e-30, theta * 1e-30, normalize="none", non_negative=non_negative)


def test_theta_scaled_to_overflow_is_refused_in_float32_and_fine_in_float64():
    q, k, v, theta = _attention_inputs()
    # |φ| ~ (1e9·‖x‖)², a product of two ~1e40 > 3.4e38: float32 gives inf/NaN without the check
    with pytest.raises(ValueError, match=r"theta_q, theta_k with q, k overflow torch.float32: a product of the features "
                                         r"of the largest query and key is .*e\+4\d, above the largest representable"):
        run_llops(q, k, v, theta * 1e10, theta * 1e10, normalize="none", backend="torch")
    q64, k64, v64, theta64 = _attention_inputs(torch.float64)
    out = run_llops(q64, k64, v64, theta64 * 1e10, theta64 * 1e10, normalize="none", backend="torch")
    ref = run_llops(q64, k64, v64, theta64, theta64, normalize="none", backend="reference")
    # the kernel is homogeneous of degree 2p = 4 in θ: the output scales by 1e40 exactly (to round-off)
    torch.testing.assert_close(out / 1e40, ref, rtol=1e-10, atol=0)


def test_a_sum_that_may_overflow_warns():
    q, k, v, theta = _attention_inputs()
    # at this seed and scale one product of the largest tokens' features is ~2e37 (finite in float32) but
    # 16 keys × the largest kernel value pass 3.4e38; at 1/10 of the scale (10^-4 of the kernel) no warning
    with pytest.warns(RuntimeWarning, match=r"16 keys × kernel values up to .*e\+37 may overflow torch.float32"):
        run_llops(q, k, v, theta * 1.6e9, theta * 1.6e9, normalize="none", backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_llops(q, k, v, theta * 1.6e8, theta * 1.6e8, normalize="none", backend="torch")


def test_zero_queries_are_not_an_underflow():
    q, k, v, theta = _attention_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run_llops(q * 0, k, v, theta, theta, normalize="none", backend="torch")
    assert bool((out == 0).all())


def test_a_theta_file_scaled_to_underflow_fails_at_its_first_use(tmp_path):
    q, k, v, theta = _attention_inputs()
    path = tmp_path / "theta.safetensors"
    tiny = theta[None] * 1e-30  # [L=1, H, t, p, D, M]
    sl.save_theta(path, tiny, tiny, p=2, m=M, t=1, d=D, method="llops", scale="none", source_sha256="0" * 64,
                  errors={}, sketchlab_version="0")
    block = sl.LLoPSAttention.from_pretrained(path, normalize="none")
    with pytest.raises(ValueError, match=r"underflow torch.float32"):
        block.attend(q, k, v)


# ------------------------------------------------------------------------------------------------
# dumps and the optimum: float64 overflow and underflow, rank-deficient kernels


def _qk(dtype=torch.float64, n=40, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, n, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(1, 2, n, d, generator=g, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("n", [8, 40])  # the SVD route (n <= D = 10) and the QR route
def test_optimal_sketch_overflow_is_a_clear_error_not_a_linalg_error(n):
    q, k = _qk(n=n)
    with pytest.raises(FloatingPointError, match=r"overflows (torch.)?float64"):
        sl.optimal_sketch(q * 1e150, k * 1e150, p=2, m=4)


def test_kernel_spectrum_overflow_is_a_clear_error():
    q, k = _qk()
    with pytest.raises(ValueError, match=r"the kernel \(qᵀk\)\^p with p=2 overflows torch.float64 at head \(0, 0\): "
                                         r"max \|qᵀk\| = 1.07\d*e\+301"):
        sl.kernel_spectrum((q * 1e150, k * 1e150), p=2, scale="none")


@pytest.mark.parametrize("dtype,factor,what", [
    (torch.float64, 1e-100, r"‖A‖_F² \(float64\) ≤ 1e-79\d"),
    (torch.float32, 1e-30, r"every \|A_ts\| \(torch.float32\) ≤ 1e-11\d"),
])
def test_optimal_sketch_underflow_is_refused(dtype, factor, what):
    q, k = _qk(dtype)
    with pytest.raises(ValueError, match=rf"the kernel \(qᵀk\)\^p with p=2 underflows at head \(0, 0\): {what}, "
                                         r"below the smallest normal number .*scale q and k up"):
        sl.optimal_sketch(q * factor, k * factor, p=2, m=4)


def test_small_but_representable_float64_inputs_still_work():
    q, k = _qk()
    tail = sl.optimal_sketch(q * 1e-30, k * 1e-30, p=2, m=4).tail
    ref = sl.optimal_sketch(q, k, p=2, m=4).tail
    # (qᵀk)^2 is homogeneous of degree 4 in the scale, so the tail (squares) scales by 1e-240
    torch.testing.assert_close(tail * 1e240, ref, rtol=1e-10, atol=0)


def test_a_zero_head_is_exact_not_an_underflow():
    q, k = _qk()
    q = q * torch.tensor([0.0, 1.0], dtype=torch.float64).view(1, 2, 1, 1)
    tail = sl.optimal_sketch(q, k, p=2, m=4).tail
    assert tail[0, 0] == 0 and tail[0, 1] > 0


def test_a_rank_deficient_kernel_warns_that_the_ratio_is_undefined():
    _, k = _qk()
    q = torch.ones_like(k)  # A = (1ᵀk)^p: every row the same, rank 1 < m
    with pytest.warns(RuntimeWarning, match=r"sketch method 'optimal': 2 of 2 optimality_ratio undefined, shown as "
                                            r"'undefined' \(JSON null with the reason\): the Theorem 3.1 tail "
                                            r"√Σ_\{i>m\}σ_i² is round-off"):
        fit = sl.fit_sketch("optimal", q, k, p=2, m=4)
    assert bool(fit.report.optimality_ratio.isnan().all())


@pytest.mark.parametrize("argv,match", [
    (["spectrum", "{tiny64}", "--scale", "none"], r"underflows at head \(0, 0\): ‖A‖_F² \(float64\)"),
    (["fit", "{tiny}", "--m", "4", "--out", "{tmp}/t.safetensors"], r"underflows at head"),
    (["compare", "{tiny}", "--m", "4", "--methods", "optimal,psf"], r"tiny.safetensors \(after the scale: .*underflows at head"),
    (["spectrum", "{huge}", "--scale", "none"], r"overflows torch.float64 at head"),
])
def test_the_commands_stop_on_unusable_magnitudes(argv, match, tmp_path, capsys):
    q, k = _qk(torch.float32)
    sl.save_qk(tmp_path / "tiny.safetensors", q * 1e-30, k * 1e-30)
    sl.save_qk(tmp_path / "huge.safetensors", q.double() * 1e150, k.double() * 1e150)
    sl.save_qk(tmp_path / "tiny64.safetensors", q.double() * 1e-100, k.double() * 1e-100)
    argv = [a.format(tiny=tmp_path / "tiny.safetensors", huge=tmp_path / "huge.safetensors",
                     tiny64=tmp_path / "tiny64.safetensors", tmp=tmp_path)
            for a in argv] + ["--no-progress"]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and re.search(match, err[0]), err
    assert not (tmp_path / "t.safetensors").exists()


def test_the_warning_is_one_line_on_the_command_line(tmp_path, capsys):
    _, k = _qk(torch.float32)
    sl.save_qk(tmp_path / "const.safetensors", torch.ones_like(k), k)
    rc = main(["fit", str(tmp_path / "const.safetensors"), "--m", "4", "--out", str(tmp_path / "t.safetensors"),
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and err[0].startswith("sketchlab: warning: sketch method 'llops': 2 of 2 optimality_ratio, ")
    assert all(line.startswith(("sketchlab: warning: ", "wrote ")) for line in err), err
    assert sum(line.startswith("sketchlab: warning: ") for line in err) == 1, err  # one warning per call

