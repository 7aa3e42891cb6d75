r"""The sparse exact cache's choice in one decoding step, compiled: one call instead of ~30 small tensor
operations (DESIGN §7, step 2; :meth:`sketchlab.attention.recurrent.RecurrentStep._leave_cached`).

For each lane ``b`` of ``B·H``: the key leaving the window (row ``i`` of the buffers, position ``j``) is
scored against the far state, :math:`e = \lVert v - r\rVert^2` with additive
:math:`r = \gamma S^\top\phi/(\gamma z^\top\phi + \varepsilon)` or delta :math:`r = \gamma S^\top\hat k`,
accumulated in float64; it takes the slot of least score (an empty slot first; ties: the oldest key)
unless it scores below every cached key; the key so pushed out (or the candidate itself) is copied out
to enter the state. Built once per machine by :func:`torch.utils.cpp_extension.load_inline` (a C++
compiler and ninja); where none works, :func:`available` is False and the step runs its torch twin
(the same choices, tested against each other and against the reference step).
"""

from __future__ import annotations

import functools

__all__ = ["available", "leave_cached"]

_SOURCE = r"""
#include <torch/extension.h>
#include <limits>
#include <cmath>

template <typename T>
static void leave(T* Kt, T* Phi, T* VS, double* score, int64_t* pos, bool* cached, const bool* real,
                  const double* gamma, T* out_phi, T* out_v1, T* enters, int64_t BH, int64_t D, int64_t N,
                  int64_t F, int64_t Dv, int64_t M2, int64_t K, int64_t i, int64_t j, int64_t c0, bool delta,
                  double eps, bool round_score) {
  const int64_t W = Dv + 1, R = N + M2;
  std::vector<double> r(W);
  for (int64_t b = 0; b < BH; ++b) {
    T* kt = Kt + b * D * N;
    T* phi = Phi + b * N * F;
    T* vs = VS + b * R * W;
    double* sc = score + b * K;
    int64_t* ps = pos + b * K;
    bool* ca = cached + b * K;
    T* o_phi = out_phi + b * F;
    T* o_v1 = out_v1 + b * W;
    enters[b] = T(0);
    if (!real[b * N + i]) {  // a pad leaving: nothing moves, nothing enters
      for (int64_t m = 0; m < F; ++m) o_phi[m] = T(0);
      for (int64_t c = 0; c < Dv + 1; ++c) o_v1[c] = T(0);
      continue;
    }
    // the candidate's score against the state (rows N .. N + M2 of VS), in float64
    const T* f = phi + i * F;
    double norm = 1;  // k̂ = φ/‖φ‖ in float64 (unit(): the least subnormal as the floor)
    if (delta) {
      double s = 0;
      for (int64_t m = 0; m < F; ++m) s += double(f[m]) * double(f[m]);
      norm = std::max(std::sqrt(s), std::numeric_limits<double>::min() * std::numeric_limits<double>::epsilon());
    }
    for (int64_t c = 0; c < W; ++c) r[c] = 0;
    for (int64_t m = 0; m < F; ++m) {
      const double x = delta ? double(f[m]) / norm : double(f[m]);
      const T* row = vs + (N + m) * W;
      for (int64_t c = 0; c < W; ++c) r[c] += x * double(row[c]);
    }
    if (gamma) for (int64_t c = 0; c < W; ++c) r[c] *= gamma[b];
    double e = 0;
    const T* v = vs + i * W;
    if (delta) {
      for (int64_t c = 0; c < Dv; ++c) { const double d = double(v[c]) - r[c]; e += d * d; }
    } else {
      double den = r[Dv] + eps;
      if (den == 0) den = 1;
      for (int64_t c = 0; c < Dv; ++c) { const double d = double(v[c]) - r[c] / den; e += d * d; }
    }
    // the least-scored slot (empty first, then the oldest of equal scores)
    double least = std::numeric_limits<double>::infinity();
    int64_t slot = -1;
    for (int64_t s = 0; s < K; ++s) {
      const double x = ca[s] ? sc[s] : -std::numeric_limits<double>::infinity();
      if (slot < 0 || x < least || (x == least && ps[s] < ps[slot])) { least = x; slot = s; }
    }
    const bool full = least > -std::numeric_limits<double>::infinity();
    const int64_t at = e < least ? i : c0 + slot;  // the row that enters the state
    for (int64_t m = 0; m < F; ++m) o_phi[m] = phi[at * F + m];
    for (int64_t c = 0; c < W; ++c) o_v1[c] = vs[at * W + c];
    enters[b] = full ? T(1) : T(0);
    if (at == i) continue;
    for (int64_t d = 0; d < D; ++d) kt[d * N + at] = kt[d * N + i];
    for (int64_t m = 0; m < F; ++m) phi[at * F + m] = f[m];
    for (int64_t c = 0; c < W; ++c) vs[at * W + c] = v[c];
    sc[slot] = round_score ? double(float(e)) : e;
    ps[slot] = j;
    ca[slot] = true;
  }
}

std::vector<torch::Tensor> leave_cached(torch::Tensor Kt, torch::Tensor Phi, torch::Tensor VS, torch::Tensor score,
                                        torch::Tensor pos, torch::Tensor cached, torch::Tensor real,
                                        c10::optional<torch::Tensor> gamma, int64_t M2, int64_t i, int64_t j,
                                        int64_t c0, bool delta, double eps) {
  const int64_t BH = Kt.size(0), D = Kt.size(1), N = Kt.size(2), F = Phi.size(2), Dv = VS.size(2) - 1;
  const int64_t K = score.size(1);
  auto out_phi = torch::empty({BH, 1, F}, Phi.options());
  auto out_v1 = torch::empty({BH, 1, Dv + 1}, VS.options());
  auto enters = torch::empty({BH, 1, 1}, VS.options());
  torch::Tensor g;
  if (gamma.has_value()) g = gamma->to(torch::kDouble).contiguous();
  AT_DISPATCH_FLOATING_TYPES(VS.scalar_type(), "leave_cached", [&] {
    leave<scalar_t>(Kt.data_ptr<scalar_t>(), Phi.data_ptr<scalar_t>(), VS.data_ptr<scalar_t>(),
                    score.data_ptr<double>(), pos.data_ptr<int64_t>(), cached.data_ptr<bool>(),
                    real.data_ptr<bool>(), g.defined() ? g.data_ptr<double>() : nullptr,
                    out_phi.data_ptr<scalar_t>(), out_v1.data_ptr<scalar_t>(), enters.data_ptr<scalar_t>(),
                    BH, D, N, F, Dv, M2, K, i, j, c0, delta, eps, VS.scalar_type() == torch::kFloat);
  });
  return {out_phi, out_v1, enters};
}
"""


@functools.cache
def _module():
    """The compiled module, or None where no compiler works (built once per machine, then loaded)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name="sketchlab_recurrent_cache", cpp_sources=_SOURCE, functions=["leave_cached"],
                           extra_cflags=["-O3"], verbose=False)
    except Exception:  # noqa: BLE001 - no compiler, no ninja, no headers: the torch twin runs
        return None


#: False forces the torch twin (the tests compare the two).
USE_COMPILED = True


def available() -> bool:
    """Whether the compiled choice is used (built, and not switched off by :data:`USE_COMPILED`)."""
    return USE_COMPILED and _module() is not None


def leave_cached(Kt, Phi, VS, score64, pos_cache, cached, real, gamma, M2: int, i: int, j: int, c0: int, *,
                 delta: bool, eps: float):
    """The compiled step 2 on contiguous CPU buffers (:class:`~sketchlab.attention.recurrent.RecurrentStep`'s;
    on another device the step runs its torch twin), in place: ``Kt [BH, D, N]``, ``Phi [BH, N, F]``, ``VS [BH, N + M2, Dv + 1]``, ``score64 [BH, K]``
    float64 (held rounded to float32 for a float32 state, as the reference stores them), ``pos_cache``,
    ``cached [BH, K]``, ``real [BH, N]``, ``gamma [BH, 1, 1]`` or None. Returns what enters the state:
    ``(φ [BH, 1, F], [v | 1] [BH, 1, Dv + 1], enters [BH, 1, 1] 0/1)``."""
    return _module().leave_cached(Kt, Phi, VS, score64, pos_cache, cached, real, gamma, M2, i, j, c0, delta, eps)
