r"""The fused one-token decoding step, compiled: one C++ call per token and layer for every mechanism
(fla's ``fused_recurrent``; DESIGN §7), and the LLoPS pair features of that token in one more.

:class:`~sketchlab.attention.recurrent.RecurrentStep` checks once (its state in ``from_state``, its far
parameters once per parameter version) and keeps its buffers; per token its :meth:`step` calls
:func:`step` here, which does in one pass over the ``B·H`` lanes what the torch twin (the rest of
``RecurrentStep.step``) does in a few dozen small tensor operations. Per lane ``b`` (a head of a batch
row), with ``P`` the token's position, ``i = s + P mod w`` its ring row, ``j = P − w`` the position
leaving the window:

1. ``γ`` (none; a fixed or per-head ``log γ``; input: :math:`\gamma = \sigma(b_\gamma + v^\top w_\gamma)`);
2. with a cache: the leaving key's score :math:`e = \lVert v_i - \gamma\,r(\phi_i)\rVert^2` against
   the far state before the decay (float64; additive :math:`r = S^\top\phi/(z^\top\phi + \varepsilon)`,
   delta :math:`r = S^\top\hat k`), its slot the least-scored one (an empty slot first; ties: the
   oldest) unless it scores below all: the key pushed out (or the candidate) enters the state;
   without a cache the key at ``j`` enters (if ``j >= s``; pure linear attention: the token itself);
3. one pass over the far state ``[S | z]`` ``[M, Dv + 1]``: decay, enter (additive
   :math:`[S|z] \mathrel{+}= \phi\,[v|1]^\top`; delta, after a first pass for :math:`u = \hat k^\top S`,
   :math:`S \mathrel{+}= \beta\,\hat k\,(v - u)^\top`, ``β`` per head or
   :math:`\sigma(b_\beta + v^\top w_\beta)`), and the far read :math:`(1-g)\,\phi(q)^\top[S|z]`;
4. the token's row written into the ring (and its sink row while ``P < s``), the masks' bias
   (``0 / −∞``; poly ``1 / 0``) with it;
5. the exact read: :math:`l_n = \mathrm{bias}_n + s\,q^\top k_n` over the ``N = s + w + K`` held keys,
   :math:`a_n = g\,e^{l_n - c}` (``c = max l``; poly :math:`a_n = g\,(s\,q^\top k_n)^p` on exact keys;
   delta: ``a`` normalised to ``g``), :math:`[n|d] = \sum_n a_n [v_n|1] + (1-g)\,\phi(q)^\top[S|z]`,
   :math:`o = n / (d + \varepsilon)` (delta: ``o = n`` with ``φ(q) → q̂``; pure linear attention:
   :math:`o = \phi(q)^\top S / (\phi(q)^\top z + \varepsilon)` or ``φ(q)ᵀS``).

Raw loops in the buffers' dtype (float32 or float64, accumulated in it as the torch twin's products
are; the cache's scores in float64 as the reference's), nothing allocated per token but the output.
Built once per machine by :func:`torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja);
where none works, :func:`available` is False and the step runs its torch twin (the tests hold the two
equal, and both equal to the reference step).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch

from .._checks import report_denominators
from .cache.recurrent import rescored
from .decayed.recurrent import token_gamma

__all__ = ["USE_COMPILED", "available", "build_directory", "lane_params", "pair_features", "step"]

_HEAD = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

enum : int64_t { DELTA = 1, LIFT = 2, POLY = 4, NORM_SUM = 8, CHECK_DEN = 16, RESCORED = 32, DECAY_LOG = 64,
                 DECAY_INPUT = 128, BETA_INPUT = 256 };

// the stride between the B*H lanes of x (numel BH*n, last axis contiguous), or -1
static int64_t lane_stride(const torch::Tensor& x, int64_t BH, int64_t n) {
  TORCH_CHECK(x.device().is_cpu(), "fused step: an input on ", x.device(), ": the compiled step reads CPU tensors");
  TORCH_CHECK(x.numel() == BH * n && x.dim() >= 1 && x.size(-1) == n, "fused step: an input of shape ", x.sizes(),
              " for ", BH, " lanes of ", n);
  if (n > 1 && x.stride(-1) != 1) return -1;
  int64_t st = -1, expect = -1;
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    if (x.size(d) == 1) continue;
    if (st < 0) { st = x.stride(d); expect = st * x.size(d); }
    else if (x.stride(d) != expect) return -1;
    else expect *= x.size(d);
  }
  return st < 0 ? n : st;
}

struct Lanes {  // an input read lane by lane (a contiguous copy only where its lanes are not evenly strided)
  torch::Tensor held;
  int64_t stride = 0;
  Lanes() {}  // an input not read (q, k of pure linear attention)
  Lanes(const torch::Tensor& x, int64_t BH, int64_t n) : held(x) {
    stride = lane_stride(x, BH, n);
    if (stride < 0) { held = x.contiguous(); stride = n; }
  }
  template <typename T> const T* at(int64_t b) const { return held.data_ptr<T>() + b * stride; }
};

#if defined(__x86_64__) || defined(__i386__)
static bool fast() {  // AVX2 and FMA on this CPU: the kernels compiled for them
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#define PICK(fn) (fast() ? avx2::fn : base::fn)
#else  // another ISA: the baseline kernels only
#define PICK(fn) (base::fn)
#endif
"""

#: The kernels, compiled twice: for AVX2 + FMA (``KATTR`` a target attribute) and for the baseline ISA.
_KERNELS = r"""
template <typename T>
KATTR static inline void axpy(T* __restrict__ y, const T a, const T* __restrict__ x, int64_t n) {  // y += a x
  for (int64_t c = 0; c < n; ++c) y[c] += a * x[c];
}

template <typename T>
KATTR static inline void scal(T* __restrict__ y, const T a, int64_t n) {  // y *= a
  for (int64_t c = 0; c < n; ++c) y[c] *= a;
}

template <typename T>
KATTR static void unit(const T* x, T* out, int64_t n) {  // x/max(|x|, least subnormal), as ops.delta.beta.unit
  T s = 0;
  for (int64_t m = 0; m < n; ++m) s += x[m] * x[m];
  const T nrm = std::max(std::sqrt(s), std::numeric_limits<T>::min() * std::numeric_limits<T>::epsilon());
  for (int64_t m = 0; m < n; ++m) out[m] = x[m] / nrm;
}

template <typename T>
KATTR static void step_impl(int64_t& nbad, int64_t& nzero, const Lanes& q, const Lanes& k, const Lanes& v, const Lanes& pq, const Lanes& pk,
                         torch::Tensor& Kt_, torch::Tensor& Phi_, torch::Tensor& VS_, torch::Tensor& ok_,
                         torch::Tensor& real_, torch::Tensor& bias_, const torch::Tensor& lane_,
                         double* score, int64_t* pos, bool* cached, int64_t K, torch::Tensor& out_,
                         int64_t P, int64_t w, int64_t s, int64_t flags, int64_t degree, double scale_, double eps_) {
  const int64_t BH = VS_.size(0), D = Kt_.size(1), N = Kt_.size(2), F = Phi_.size(2), Dv = VS_.size(2) - 1;
  const int64_t W = Dv + 1, R = VS_.size(1), M2 = R - N, LP = lane_.size(1);
  const bool delta = flags & DELTA, lift = flags & LIFT, poly = flags & POLY;
  const T scale = T(scale_), eps = T(eps_);
  const T NEG = -std::numeric_limits<T>::infinity();
  T* Kt = Kt_.data_ptr<T>(); T* Phi = Phi_.data_ptr<T>(); T* VS = VS_.data_ptr<T>();
  bool* ok = ok_.data_ptr<bool>(); bool* real = real_.data_ptr<bool>(); T* bias = bias_.data_ptr<T>();
  const T* lanes = lane_.data_ptr<T>(); T* out = out_.data_ptr<T>();
  thread_local std::vector<T> buf;
  thread_local std::vector<double> rdbl;
  buf.resize(std::max<int64_t>(N, 1) + 2 * M2 + 3 * W);
  rdbl.resize(W);
  T* lg = buf.data();                   // [N] logits, then the exact keys' weights
  T* fq = lg + std::max<int64_t>(N, 1);  // [M2] phi(q) as read (lifted; delta: unit), times (1 - g) in a hybrid
  T* fe = fq + M2;                      // [M2] the entering key's features (lifted; delta: unit)
  T* r = fe + M2;                       // [W] the read [n | d]
  T* u = r + W;                         // [W] delta: u = k^T (gamma S)
  T* ve = u + W;                        // [W] the entering [v | 1]
  const int64_t i = w ? s + P % w : -1, j = P - w, c0 = s + w;
  const bool leaves = j >= s;
  for (int64_t b = 0; b < BH; ++b) {
    T* kt = Kt + b * D * N;
    T* phi = Phi + b * N * F;
    T* vs = VS + b * R * W;
    T* S = vs + N * W;  // [M2, W]: [S | z]
    bool* okb = ok + b * N;
    bool* rb = real + b * N;
    T* bb = bias + b * N;
    const T* lp = lanes + b * LP;  // g, log g, 1 - g, decay (log gamma or input bias), beta (or input bias), w_gamma, w_beta
    const T* vb = v.at<T>(b);
    // 1. gamma
    bool has_gamma = false;
    T gamma = 1;
    if (flags & DECAY_LOG) { has_gamma = true; gamma = std::exp(lp[3]); }
    else if (flags & DECAY_INPUT) {
      T x = lp[3];
      const T* wg = lp + 5;
      T dot = 0;
      for (int64_t c = 0; c < Dv; ++c) dot += vb[c] * wg[c];
      x += dot;
      has_gamma = true;
      gamma = std::exp(std::min(x, T(0)) - std::log1p(std::exp(-std::abs(x))));  // exp(log sigmoid(x))
    }
    // 2. what enters the far state: (features f [F], [v | 1]) or nothing
    const T* ef = nullptr;
    const T* ev = nullptr;
    int64_t at = -1, slot = -1;
    double e = 0;
    if (K) {
      if (leaves && rb[i]) {
        double* sc = score + b * K;
        int64_t* ps = pos + b * K;
        bool* ca = cached + b * K;
        const T* f = phi + i * F;
        double nrm = 1;
        if (delta) {
          double q2 = 0;
          for (int64_t m = 0; m < F; ++m) q2 += double(f[m]) * double(f[m]);
          nrm = std::max(std::sqrt(q2), std::numeric_limits<double>::min() * std::numeric_limits<double>::epsilon());
        }
        double* rd = rdbl.data();
        for (int64_t c = 0; c < W; ++c) rd[c] = 0;
        for (int64_t m = 0; m < F; ++m) {
          const double x = delta ? double(f[m]) / nrm : double(f[m]);
          const T* row = S + m * W;
          for (int64_t c = 0; c < W; ++c) rd[c] += x * double(row[c]);
        }
        if (has_gamma) for (int64_t c = 0; c < W; ++c) rd[c] *= double(gamma);
        const T* vi = vs + i * W;
        if (delta) {
          for (int64_t c = 0; c < Dv; ++c) { const double d = double(vi[c]) - rd[c]; e += d * d; }
        } else {
          double den = rd[Dv] + eps_;
          if (den == 0) den = 1;
          for (int64_t c = 0; c < Dv; ++c) { const double d = double(vi[c]) - rd[c] / den; e += d * d; }
        }
        double least = std::numeric_limits<double>::infinity();
        for (int64_t t = 0; t < K; ++t) {
          const double x = ca[t] ? sc[t] : -std::numeric_limits<double>::infinity();
          if (slot < 0 || x < least || (x == least && ps[t] < ps[slot])) { least = x; slot = t; }
        }
        at = e < least ? i : c0 + slot;  // the row that enters the state
        if (least > -std::numeric_limits<double>::infinity()) { ef = phi + at * F; ev = vs + at * W; }
      }
    } else if (w) {
      if (leaves && rb[i]) { ef = phi + i * F; ev = vs + i * W; }
    } else if (leaves) {  // pure linear attention: the token itself
      ef = pk.at<T>(b);
      for (int64_t c = 0; c < Dv; ++c) ve[c] = vb[c];
      ve[Dv] = 1;
      ev = ve;
    }
    // the read's far row: phi(q) (lifted; delta: unit), times (1 - g) with a window
    const T* pqb = pq.at<T>(b);
    if (lift) for (int64_t a = 0; a < F; ++a) for (int64_t c = 0; c < F; ++c) fq[a * F + c] = pqb[a] * pqb[c];
    else for (int64_t m = 0; m < M2; ++m) fq[m] = pqb[m];
    if (delta) unit(fq, fq, M2);
    if (w) for (int64_t m = 0; m < M2; ++m) fq[m] *= lp[2];
    // 3. decay, enter, far read
    for (int64_t c = 0; c < W; ++c) r[c] = 0;
    if (ef) {
      if (lift) for (int64_t a = 0; a < F; ++a) for (int64_t c = 0; c < F; ++c) fe[a * F + c] = ef[a] * ef[c];
      else for (int64_t m = 0; m < M2; ++m) fe[m] = ef[m];
    }
    if (delta) {
      T beta = 0;
      if (ef) {
        unit(fe, fe, M2);
        if (flags & BETA_INPUT) {
          const T* wb = lp + 5 + Dv;
          T dot = 0;
          for (int64_t c = 0; c < Dv; ++c) dot += ev[c] * wb[c];
          beta = T(1) / (T(1) + std::exp(-(lp[4] + dot)));
        } else {
          beta = lp[4];
        }
        for (int64_t c = 0; c < W; ++c) u[c] = 0;
      }
      for (int64_t m = 0; m < M2; ++m) {
        T* row = S + m * W;
        if (has_gamma) scal(row, gamma, W);
        if (ef) axpy(u, fe[m], row, Dv);
      }
      if (ef) for (int64_t c = 0; c < Dv; ++c) u[c] = ev[c] - u[c];
      for (int64_t m = 0; m < M2; ++m) {
        T* row = S + m * W;
        if (ef) axpy(row, fe[m] * beta, u, Dv);
        axpy(r, fq[m], row, W);
      }
    } else {
      for (int64_t m = 0; m < M2; ++m) {
        T* row = S + m * W;
        if (has_gamma) scal(row, gamma, W);
        if (ef) axpy(row, fe[m], ev, W);
        axpy(r, fq[m], row, W);
      }
    }
    T* ob = out + b * Dv;
    if (!w) {  // pure linear attention: the far read alone
      if (delta || !(flags & NORM_SUM)) { for (int64_t c = 0; c < Dv; ++c) ob[c] = r[c]; continue; }
      if ((flags & CHECK_DEN) && r[Dv] <= 0) { ++nbad; nzero += r[Dv] == 0; }
      const T den = r[Dv] + eps;
      for (int64_t c = 0; c < Dv; ++c) ob[c] = r[c] / den;
      continue;
    }
    const T on = poly ? T(1) : T(0);  // the bias of an exact key (softmax: log 1)
    // the cache: the candidate takes its slot (the row that entered was read above)
    if (K && at >= 0) {
      if (at != i) {
        double* sc = score + b * K;
        const T* f = phi + i * F;
        const T* vi = vs + i * W;
        for (int64_t d = 0; d < D; ++d) kt[d * N + at] = kt[d * N + i];
        for (int64_t m = 0; m < F; ++m) phi[at * F + m] = f[m];
        for (int64_t c = 0; c < W; ++c) vs[at * W + c] = vi[c];
        sc[slot] = std::is_same<T, float>::value ? double(float(e)) : e;
        pos[b * K + slot] = j;
        cached[b * K + slot] = true;
        okb[at] = true;
        bb[at] = on;
      }
    }
    if (K && (flags & RESCORED) && std::is_same<T, float>::value) {
      double* sc = score + b * K;
      for (int64_t t = 0; t < K; ++t) sc[t] = double(float(sc[t]));  // stored rounded, as the reference's
    }
    // 4. the token's row (and its sink row while P < s)
    const T* kb = k.at<T>(b);
    const T* pkb = pk.at<T>(b);
    for (int64_t d = 0; d < D; ++d) kt[d * N + i] = kb[d];
    for (int64_t m = 0; m < F; ++m) phi[i * F + m] = pkb[m];
    for (int64_t c = 0; c < Dv; ++c) vs[i * W + c] = vb[c];
    rb[i] = true;
    okb[i] = P >= s;
    bb[i] = okb[i] ? on : (poly ? T(0) : NEG);
    if (P < s) {
      for (int64_t d = 0; d < D; ++d) kt[d * N + P] = kb[d];
      for (int64_t c = 0; c < Dv; ++c) vs[P * W + c] = vb[c];
      okb[P] = true;
      bb[P] = on;
    }
    // 5. the exact read
    const T* qb = q.at<T>(b);
    for (int64_t n = 0; n < N; ++n) lg[n] = 0;
    for (int64_t d = 0; d < D; ++d) axpy(lg, qb[d], kt + d * N, N);
    const T g = lp[0];
    if (poly) {
      T sum = 0;
      for (int64_t n = 0; n < N; ++n) {
        lg[n] = T(std::pow(scale * lg[n], T(degree))) * bb[n];
        sum += lg[n];
      }
      const T f = delta ? g / sum : g;
      for (int64_t n = 0; n < N; ++n) lg[n] *= f;
    } else {
      T c = NEG;
      for (int64_t n = 0; n < N; ++n) { lg[n] = bb[n] + scale * lg[n]; c = std::max(c, lg[n]); }
      if (delta) {
        T sum = 0;
        for (int64_t n = 0; n < N; ++n) { lg[n] = std::exp(lg[n] - c); sum += lg[n]; }
        const T f = g / sum;
        for (int64_t n = 0; n < N; ++n) lg[n] *= f;
      } else {
        const T sh = c - lp[1];
        for (int64_t n = 0; n < N; ++n) lg[n] = std::exp(lg[n] - sh);  // g e^{l - c}
      }
    }
    for (int64_t n = 0; n < N; ++n) axpy(r, lg[n], vs + n * W, W);
    if (delta) { for (int64_t c = 0; c < Dv; ++c) ob[c] = r[c]; continue; }
    if ((flags & CHECK_DEN) && r[Dv] <= 0) { ++nbad; nzero += r[Dv] == 0; }
    const T den = r[Dv] + eps;
    for (int64_t c = 0; c < Dv; ++c) ob[c] = r[c] / den;
  }
}

template <typename T>
KATTR static void pair_impl(const Lanes& q, const Lanes& k, const T* flat, int64_t koff, int64_t D, int64_t t, int64_t p,
                      int64_t M, T* oq, T* ok, int64_t BH) {
  const int64_t J = t * p * M;
  thread_local std::vector<T> buf;
  buf.resize(2 * J + M);
  T* pq = buf.data();
  T* pk = pq + J;
  T* tmp = pk + J;
  for (int64_t b = 0; b < BH; ++b) {
    const T* x = q.at<T>(b);
    const T* y = k.at<T>(b);
    const T* fq = flat + b * D * J;
    const T* fk = flat + (b + koff) * D * J;
    // [q; k] @ theta_flat, by blocks of columns whose sums stay in registers over d (4 AVX registers a side)
    constexpr int64_t BLK = 128 / sizeof(T);
    int64_t j0 = 0;
    for (; j0 + BLK <= J; j0 += BLK) {
      T aq[BLK], ak[BLK];
      for (int64_t c = 0; c < BLK; ++c) { aq[c] = 0; ak[c] = 0; }
      for (int64_t d = 0; d < D; ++d) {
        const T a = x[d], e = y[d];
        const T* __restrict__ rq = fq + d * J + j0;
        const T* __restrict__ rk = fk + d * J + j0;
        for (int64_t c = 0; c < BLK; ++c) { aq[c] += a * rq[c]; ak[c] += e * rk[c]; }
      }
      for (int64_t c = 0; c < BLK; ++c) { pq[j0 + c] = aq[c]; pk[j0 + c] = ak[c]; }
    }
    if (j0 < J) {  // the last columns
      for (int64_t c = j0; c < J; ++c) { pq[c] = 0; pk[c] = 0; }
      for (int64_t d = 0; d < D; ++d) {
        axpy(pq + j0, x[d], fq + d * J + j0, J - j0);
        axpy(pk + j0, y[d], fk + d * J + j0, J - j0);
      }
    }
    for (int64_t side = 0; side < 2; ++side) {  // the p-fold products, summed over rank t
      const T* pr = side ? pk : pq;
      T* __restrict__ o = (side ? ok : oq) + b * M;
      for (int64_t m = 0; m < M; ++m) o[m] = 0;
      for (int64_t rr = 0; rr < t; ++rr) {
        const T* __restrict__ f0 = pr + rr * p * M;
        T* __restrict__ prod = tmp;
        for (int64_t m = 0; m < M; ++m) prod[m] = f0[m];
        for (int64_t jj = 1; jj < p; ++jj) {
          const T* __restrict__ fj = f0 + jj * M;
          for (int64_t m = 0; m < M; ++m) prod[m] *= fj[m];
        }
        for (int64_t m = 0; m < M; ++m) o[m] += prod[m];
      }
    }
  }
}

"""

_ENTRIES = r"""
std::tuple<torch::Tensor, int64_t, int64_t> step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor phi_q,
    torch::Tensor phi_k, torch::Tensor Kt, torch::Tensor Phi, torch::Tensor VS, torch::Tensor ok,
    torch::Tensor real, torch::Tensor bias, torch::Tensor lane, c10::optional<torch::Tensor> score,
    c10::optional<torch::Tensor> pos, c10::optional<torch::Tensor> cached, int64_t P, int64_t w, int64_t s,
    int64_t flags, int64_t degree, double scale, double eps) {
  const int64_t BH = VS.size(0), D = Kt.size(1), F = Phi.size(2), Dv = VS.size(2) - 1;
  TORCH_CHECK(q.scalar_type() == VS.scalar_type() && v.scalar_type() == VS.scalar_type() &&
              phi_q.scalar_type() == VS.scalar_type() && phi_k.scalar_type() == VS.scalar_type() &&
              k.scalar_type() == VS.scalar_type(), "fused step: inputs in the buffers' dtype");
  TORCH_CHECK(Kt.is_contiguous() && Phi.is_contiguous() && VS.is_contiguous() && bias.is_contiguous() &&
              lane.is_contiguous() && ok.is_contiguous() && real.is_contiguous() && ok.scalar_type() == torch::kBool &&
              real.scalar_type() == torch::kBool && Kt.scalar_type() == VS.scalar_type() &&
              Phi.scalar_type() == VS.scalar_type() && bias.scalar_type() == VS.scalar_type() &&
              lane.scalar_type() == VS.scalar_type(), "fused step: the buffers as RecurrentStep lays them out");
  TORCH_CHECK(!score.has_value() || (score->is_contiguous() && pos->is_contiguous() && cached->is_contiguous() &&
              score->scalar_type() == torch::kDouble && pos->scalar_type() == torch::kLong &&
              cached->scalar_type() == torch::kBool), "fused step: the cache's buffers as RecurrentStep lays them out");
  const Lanes lq = w ? Lanes(q, BH, D) : Lanes(), lk = w ? Lanes(k, BH, D) : Lanes();
  const Lanes lv(v, BH, Dv), lpq(phi_q, BH, F), lpk(phi_k, BH, F);
  auto out = torch::empty({BH, 1, Dv}, VS.options());
  const int64_t K = score.has_value() ? score->size(1) : 0;
  double* sc = K ? score->data_ptr<double>() : nullptr;
  int64_t* ps = K ? pos->data_ptr<int64_t>() : nullptr;
  bool* ca = K ? cached->data_ptr<bool>() : nullptr;
  int64_t nbad = 0, nzero = 0;
  AT_DISPATCH_FLOATING_TYPES(VS.scalar_type(), "fused_step", [&] {
    PICK(step_impl<scalar_t>)(
        nbad, nzero, lq, lk, lv, lpq, lpk, Kt, Phi, VS, ok, real, bias, lane, sc, ps, ca, K, out, P, w, s, flags, degree,
        scale, eps);
  });
  return {out, nbad, nzero};
}

std::vector<torch::Tensor> pair_features(torch::Tensor q, torch::Tensor k, torch::Tensor flat, int64_t koff,
                                         int64_t t, int64_t p) {
  const int64_t D = flat.size(1), J = flat.size(2), M = J / (t * p), BH = flat.size(0) - koff;
  TORCH_CHECK(q.scalar_type() == flat.scalar_type() && k.scalar_type() == flat.scalar_type() && flat.is_contiguous(),
              "pair features: q, k in the map's dtype");
  const Lanes lq(q, BH, D), lk(k, BH, D);
  auto oq = torch::empty({BH, 1, M}, flat.options());
  auto okk = torch::empty({BH, 1, M}, flat.options());
  AT_DISPATCH_FLOATING_TYPES(flat.scalar_type(), "pair_features", [&] {
    PICK(pair_impl<scalar_t>)(
        lq, lk, flat.data_ptr<scalar_t>(), koff, D, t, p, M, oq.data_ptr<scalar_t>(), okk.data_ptr<scalar_t>(), BH);
  });
  return {oq, okk};
}
"""

_SOURCE = (_HEAD + "#if defined(__x86_64__) || defined(__i386__)\nnamespace avx2 {\n"
           + _KERNELS.replace("KATTR", '__attribute__((target("avx2,fma")))') + "}\n#endif\n"
           + "namespace base {\n" + _KERNELS.replace("KATTR", "") + "}\n" + _ENTRIES)


#: A build lock older than this (seconds) was left by a build that was killed: the build takes ~1.5 min.
STALE_LOCK_S = 900


def build_directory() -> Path:
    """Where the extension is built and cached: ``$TORCH_EXTENSIONS_DIR`` (else ``~/.cache/torch_extensions``)
    ``/sketchlab_fused_recurrent-torch<version>``. A build killed midway leaves its ``lock`` file there, on which
    torch's next build would wait forever: a lock older than :data:`STALE_LOCK_S` is removed first."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    where = Path(root) / f"sketchlab_fused_recurrent-torch{torch.__version__}"
    where.mkdir(parents=True, exist_ok=True)
    lock = where / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass
    return where


@functools.cache
def _module():
    """The compiled module, or None where no compiler works (built once per machine, then loaded)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name="sketchlab_fused_recurrent", cpp_sources=_SOURCE, functions=["step", "pair_features"],
                           extra_cflags=["-O3", "-ffp-contract=off"], build_directory=str(build_directory()),
                           verbose=False)
    except Exception:  # noqa: BLE001 - no compiler, no ninja, no headers: the torch twin runs
        return None


#: False forces the torch twins (the tests compare the two).
USE_COMPILED = True


def available() -> bool:
    """Whether the compiled step is used (built, and not switched off by :data:`USE_COMPILED`)."""
    return USE_COMPILED and _module() is not None


def lane_params(rs) -> tuple[torch.Tensor, int]:
    """A :class:`~sketchlab.attention.recurrent.RecurrentStep`'s far parameters as the compiled step takes them
    (made in its ``_parameters``, once per parameter version): ``lane [B·H, 5 + 2·Dv]`` in the buffers' dtype,
    per lane ``[g, log g, 1 − g, log γ or b_γ, β or b_β, w_γ (Dv), w_β (Dv)]``, and the step's flags."""
    BH, Dv = rs.BH, rs.Dv
    lane = rs.VS.new_zeros(BH, 5 + 2 * Dv)
    lane[:, 0], lane[:, 1], lane[:, 2] = rs.g.view(BH), rs.log_g.view(BH), rs.one_g.view(BH)
    flags = (1 if rs.delta else 0) | (2 if rs.lift else 0) | (4 if rs.o.local == "poly" else 0)
    flags |= (8 if rs.normalize == "sum" else 0) | (16 if rs.check_den else 0)
    d = rs.decay
    if isinstance(d, tuple):
        flags |= 128
        lane[:, 3], lane[:, 5:5 + Dv] = d[1].view(BH), d[2].view(BH, Dv)
    elif d is not None:
        flags |= 64
        lane[:, 3] = d.view(BH)
    if rs.delta:
        b = rs.beta
        if isinstance(b, tuple):
            flags |= 256
            lane[:, 4], lane[:, 5 + Dv:] = b[0].view(BH), b[1].view(BH, Dv)
        else:
            lane[:, 4] = b.view(BH)
    return lane, flags


def step(rs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi_q: torch.Tensor,
         phi_k: torch.Tensor) -> torch.Tensor:
    r"""One token of :meth:`RecurrentStep.step <sketchlab.attention.recurrent.RecurrentStep.step>`, compiled
    (the steps 1–5 of the module's notes): the step's CPU buffers move on by one token in place.

    Parameters
    ----------
    rs : RecurrentStep
        Laid out by ``from_state``, its far parameters current (``rs._parameters()`` just ran: ``rs.lane``,
        ``rs.flags`` from :func:`lane_params`); buffers float32 or float64 on the CPU.
    q, k : Tensor ``[B, H, 1, D]`` or ``[B·H, 1, D]``
    v : Tensor ``[B, H, 1, Dv]`` or ``[B·H, 1, Dv]``
    phi_q, phi_k : Tensor ``[B, H, 1, F]`` or ``[B·H, 1, F]``
        The token's features (a memory state's: already self-tensored where the layer says so). Any dtype
        (converted to the buffers' and back); lanes evenly strided are read in place, others copied.

    Returns
    -------
    Tensor ``[B·H, 1, Dv]`` in ``v``'s dtype: :math:`o = n/(d + \varepsilon)` (delta: ``n``). The cache's
    re-scoring (every ``rescore`` positions, ``K·M·(Dv + 1)`` float64 multiply-adds per lane) stays one
    batched torch product here, as in the twin. Denominators ``<= 0`` of signed features are counted in the
    call and reported as the twin reports them.
    """
    in_dtype, work = v.dtype, rs.work
    if in_dtype != work:
        q, k, v, phi_q, phi_k = (x.to(work) for x in (q, k, v, phi_q, phi_k))
    P, w, s, K = rs.offset, rs.w, rs.s, rs.K
    flags = rs.flags
    cache = (None, None, None)
    if K:
        cache = (rs.score64, rs.pos_cache, rs.cached)
        if P % rs.o.rescore == 0 and bool(rs.cached.any()):  # re-score the cached keys (the choice reads them)
            rs.score64.copy_(rescored(rs, token_gamma(rs.decay, v.reshape(rs.BH, 1, rs.Dv))))
            flags |= 32  # stored rounded after the choice
    out, bad, zero = _module().step(q, k, v, phi_q, phi_k, rs.Kt, rs.Phi, rs.VS, rs.ok, rs.real, rs.bias, rs.lane, *cache,
                              P, w, s, flags, rs.degree or 0, rs.scale, rs.o.eps)
    rs.offset = P + 1
    if rs.holes and P >= s:
        rs.holes.discard(s + P % w)
    if K and not rs.cache_full:
        rs.cache_full = bool(rs.cached.all())
    if bad:
        report_denominators((bad, zero), rs.BH, "linear_attention",
                            rs.o.denominator_check)
    return out if in_dtype == work else out.to(in_dtype)


def pair_features(q: torch.Tensor, k: torch.Tensor, flat: torch.Tensor, koff: int, t: int, p: int):
    """The compiled LLoPS pair features (:func:`sketchlab.attention.ops.pair_features.llops_pair_features`, on the CPU
    in its Θ's dtype when :func:`available`): ``q, k [B·H, 1, D]``, ``flat [(1|2)·B·H, D, t·p·M]`` (the key side's
    lanes from ``koff``) → ``(φ_Q(q), φ_K(k))``, ``[B·H, 1, M]`` each."""
    return tuple(_module().pair_features(q, k, flat, koff, t, p))
