"""The hybrid's local GEMMs in two tilings, per block: today's ``C × C`` tiles against query sub-blocks of ``b``.

Decides whether tiling the local part of the sliding-window hybrid in query sub-blocks of ``b = C/2``
rows (one band of ``n_loc·b`` keys per sub-block, the far tile only ``b × b``: the tile model's
``local_block``, see ``tile_macs`` in ``bench_attention.py``) would pay on this machine before the
cores are rewritten for it. Times, on random data of one steady block (``N`` chunks of ``C``
queries, ``B·H`` heads, ``D = Dv = M``; window ``w``, no sinks: they cost the same in both), every
GEMM of the local and partly-far part that the hand-written cores run, forward and backward,
and the softmax pass over the local logits:

- today (``b = C``, lag-major as ``ops.additive.chunk_hybrid._HybridCore``): per key-chunk lag ``L < n_loc`` the
  logits ``q·k_Lᵀ`` and ``A_L·v_L``; the far tile ``φ(q)·φ(k_L)ᵀ`` of the partly-far lags;
  backward ``dA = dO·v_Lᵀ``, ``dv_L += W_Lᵀ·dO``, ``dq += dl·k_L``, ``dk_L += dlᵀ·q`` and the far
  tile's ``dφ(q)``, ``dφ(k)``;
- sub-blocks (``b``): the band ``k, v`` of the ``n_loc`` key sub-blocks copied once per sub-block
  (``band copy``), one logits GEMM and one ``A·V`` over the band, the far tile ``b × b``;
  backward one GEMM each for ``dA``, ``dv_band``, ``dq``, ``dk_band``, the band gradients folded
  back onto the key sub-blocks (``n_loc`` strided adds each, counted in ``fold``), the far tile's
  two gradients. The bands and their gradients go to buffers allocated once (the cores would
  allocate them per block: a fresh 3 MB tensor costs page faults that vary 0.4–2.4 ms from run to
  run here), so the sub-blocks' times are a lower bound. ``--overlap`` also times the band GEMMs on an overlapping ``as_strided`` view of
  token-major ``k, v`` (no copy; does the GEMM copy it itself?).

CPU time of the process, 1 thread, the two tilings' pieces timed in turns, best of ``--rounds`` (in
turns, as inside a core, where other work runs between two GEMMs: timed in a tight loop, with their
inputs left in cache, both tilings' GEMMs run faster and the band's logits faster than today's).

    .venv/bin/python analysis/bench_hybrid_tiles.py --out analysis/results/attention_hybrid_tiles.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sketchlab.io import atomic_write  # noqa: E402


def _band_lags(window: int, b: int) -> tuple[int, list[int]]:
    """Key tiles of ``b`` back with a local key (``n_loc``) and those with a far key (lag ``>= w``)."""
    n_loc = -(-(window + b - 1) // b)
    return n_loc, [L for L in range(n_loc) if L * b + b - 1 >= window]


def today_pieces(N: int, BH: int, C: int, D: int, window: int, gen: torch.Generator) -> dict:
    """Closures of today's per-lag GEMMs (chunk-major ``[chunks, B·H, C, ·]``) and their multiply-adds."""
    n_loc, far = _band_lags(window, C)
    Ne = N + n_loc - 1
    q, fq, dO = (torch.randn(N, BH, C, D, generator=gen) for _ in range(3))
    k, v, fk = (torch.randn(Ne, BH, C, D, generator=gen) for _ in range(3))
    A = torch.randn(n_loc, N, BH, C, C, generator=gen)
    F = torch.randn(len(far), N, BH, C, C, generator=gen)
    num, dq, dfq = (torch.zeros(N, BH, C, D) for _ in range(3))
    dk, dv, dfk = (torch.zeros(Ne, BH, C, D) for _ in range(3))
    kk = [slice(n_loc - 1 - L, n_loc - 1 - L + N) for L in range(n_loc)]
    flat = lambda x: x.reshape(-1, *x.shape[-2:])  # noqa: E731  [chunks·B·H, rows, cols]

    def logits():
        for L in range(n_loc):
            torch.matmul(q, k[kk[L]].mT, out=A[L])

    def far_tile():
        for i, L in enumerate(far):
            torch.matmul(fq, fk[kk[L]].mT, out=F[i])

    def av():
        for L in range(n_loc):
            flat(num).baddbmm_(flat(A[L]), flat(v[kk[L]]))

    def bwd():
        dA = torch.empty_like(A)
        for L in range(n_loc):
            torch.matmul(dO, v[kk[L]].mT, out=dA[L])
            flat(dv[kk[L]]).baddbmm_(flat(A[L]).mT, flat(dO))
        for L in range(n_loc):
            torch.baddbmm(flat(dq), flat(dA[L]), flat(k[kk[L]]), beta=0 if L == 0 else 1, out=flat(dq))
            flat(dk[kk[L]]).baddbmm_(flat(dA[L]).mT, flat(q))
        for i, L in enumerate(far):
            flat(dfq).baddbmm_(flat(F[i]), flat(fk[kk[L]]))
            flat(dfk[kk[L]]).baddbmm_(flat(F[i]).mT, flat(fq))

    def softmax():
        torch.softmax(A, -1)

    macs_f = N * BH * (2 * n_loc * C * C * D + len(far) * C * C * D)
    macs_b = N * BH * (4 * n_loc * C * C * D + 2 * len(far) * C * C * D)
    return dict(logits=logits, far=far_tile, av=av, bwd=bwd, softmax=softmax, macs_fwd=macs_f, macs_bwd=macs_b,
                n_loc=n_loc, n_far=len(far))


def sub_block_pieces(N: int, BH: int, C: int, D: int, window: int, b: int, gen: torch.Generator,
                     overlap: bool) -> dict:
    """Closures of the sub-block tiling's band GEMMs (sub-block-major ``[subs, B·H, b, ·]``) and their
    multiply-adds; ``k`` (``[subs + n_loc − 1, B·H, b, D]``, sub-block ``s + n_loc − 1`` the queries' own) and its
    band ``band_k`` (``[subs, B·H, n_loc·b, D]``) for the tests."""
    n_loc, far = _band_lags(window, b)
    Ns = N * C // b
    Ne = Ns + n_loc - 1
    U = n_loc * b
    q, fq, dO = (torch.randn(Ns, BH, b, D, generator=gen) for _ in range(3))
    k, v, fk = (torch.randn(Ne, BH, b, D, generator=gen) for _ in range(3))
    W = torch.randn(Ns, BH, b, U, generator=gen)
    F = torch.randn(len(far), Ns, BH, b, b, generator=gen)
    num = torch.zeros(Ns, BH, b, D)
    dq, dfq = torch.zeros(Ns, BH, b, D), torch.zeros(Ns, BH, b, D)
    dk, dv, dfk = (torch.zeros(Ne, BH, b, D) for _ in range(3))
    kk = [slice(n_loc - 1 - L, n_loc - 1 - L + Ns) for L in range(n_loc)]

    kb, vb, gb = (torch.empty(Ns, BH, U, D) for _ in range(3))  # buffers allocated once (see the docstring)

    def band(x, out):  # [Ns, BH, U, D]: key sub-blocks s − n_loc + 1 … s, oldest first
        return torch.cat([x[kk[L]] for L in range(n_loc - 1, -1, -1)], 2, out=out)

    band(k, kb), band(v, vb)

    def fold(dst, g):  # the band's gradient back onto its key sub-blocks
        for j, L in enumerate(range(n_loc - 1, -1, -1)):
            dst[kk[L]] += g[:, :, j * b:(j + 1) * b]

    out = dict(
        band_copy=lambda: (band(k, kb), band(v, vb)),
        logits=lambda: torch.matmul(q, kb.mT, out=W),
        far=lambda: [torch.matmul(fq, fk[kk[L]].mT, out=F[i]) for i, L in enumerate(far)],
        av=lambda: torch.matmul(W, vb, out=num),
        softmax=lambda: torch.softmax(W, -1),
        n_loc=n_loc, n_far=len(far), k=k, band_k=kb)

    def bwd():
        dW = W.new_empty(W.shape)
        torch.matmul(dO, vb.mT, out=dW)
        fold(dv, torch.matmul(W.mT, dO, out=gb))
        torch.matmul(dW, kb, out=dq)
        fold(dk, torch.matmul(dW.mT, q, out=gb))
        for i, L in enumerate(far):
            dfq.view(-1, b, D).baddbmm_(F[i].view(-1, b, b), fk[kk[L]].reshape(-1, b, D))
            dfk[kk[L]] += F[i].mT @ fq

    out["bwd"] = bwd
    out["fold"] = lambda: (fold(dv, vb), fold(dk, kb))
    out["macs_fwd"] = Ns * BH * (2 * b * U * D + len(far) * b * b * D)
    out["macs_bwd"] = Ns * BH * (4 * b * U * D + 2 * len(far) * b * b * D)
    if overlap:  # token-major per head, the band as an overlapping view (stride b·D between sub-blocks)
        kt, vt = torch.randn(BH, Ne * b, D, generator=gen), torch.randn(BH, Ne * b, D, generator=gen)
        qt = q.permute(1, 0, 2, 3).contiguous()  # [BH, Ns, b, D]
        Wt = W.permute(1, 0, 2, 3).contiguous()
        view = lambda x: x.as_strided((BH, Ns, U, D), (x.stride(0), b * D, D, 1))  # noqa: E731
        out["logits_overlap_view"] = lambda: torch.matmul(qt, view(kt).mT)
        out["av_overlap_view"] = lambda: torch.matmul(Wt, view(vt))
    return out


def time_in_turns(fns: dict, rounds: int) -> dict:
    """Best CPU time (s) of each closure, all called once per round in turn (one warm-up round)."""
    best = {name: float("inf") for name in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            if r:
                best[name] = min(best[name], time.process_time() - t0)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16, help="chunks per block (the cores' default)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--sub-block", type=int, default=32)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2, help="B·H")
    parser.add_argument("--dim", type=int, default=128, help="D = Dv = M")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--overlap", action="store_true", help="also the band GEMMs on an overlapping view")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    C, b = args.chunk_size, args.sub_block
    small = {name: getattr(args, name.replace("-", "_")) for name in ("chunks", "chunk-size", "heads", "dim", "rounds")}
    bad = {name: v for name, v in small.items() if v < 1}
    if bad:
        print("error: " + ", ".join(f"--{name} must be >= 1, got {v}" for name, v in bad.items()), file=sys.stderr)
        return 2
    if b < 1 or C % b or args.window < 1:
        print(f"error: --sub-block must divide --chunk-size={C} and --window be >= 1, got {b}, {args.window}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    N, BH, D, w = args.chunks, args.heads, args.dim, args.window
    old = today_pieces(N, BH, C, D, w, gen)
    new = sub_block_pieces(N, BH, C, D, w, b, gen, args.overlap)
    timed = {("today", k): f for k, f in old.items() if callable(f)}
    timed.update({("sub", k): f for k, f in new.items() if callable(f) and k != "fold"})
    timed[("sub", "fold")] = new["fold"]
    t0 = time.time()
    best = time_in_turns(timed, args.rounds)
    ms = {key: 1e3 * s for key, s in best.items()}
    fwd_old = ms["today", "logits"] + ms["today", "far"] + ms["today", "av"]
    fwd_new = ms["sub", "band_copy"] + ms["sub", "logits"] + ms["sub", "far"] + ms["sub", "av"]
    rows = [("band copy of k, v", None, ms["sub", "band_copy"]),
            ("local logits", ms["today", "logits"], ms["sub", "logits"]),
            ("far tile φ(q)·φ(k)ᵀ", ms["today", "far"], ms["sub", "far"]),
            ("A·V", ms["today", "av"], ms["sub", "av"]),
            ("**forward GEMMs (+ band copy)**", fwd_old, fwd_new),
            ("softmax pass over the local logits", ms["today", "softmax"], ms["sub", "softmax"]),
            ("backward GEMMs (sub-blocks: + fold)", ms["today", "bwd"], ms["sub", "bwd"]),
            ("  of which the fold of the band gradients", None, ms["sub", "fold"])]
    if args.overlap:
        rows += [("logits on an overlapping view (no band copy)", None, ms["sub", "logits_overlap_view"]),
                 ("A·V on an overlapping view (no band copy)", None, ms["sub", "av_overlap_view"])]
    fmt = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    total_old = fwd_old + ms["today", "softmax"] + ms["today", "bwd"]
    total_new = fwd_new + ms["sub", "softmax"] + ms["sub", "bwd"]
    lines = [
        "# The hybrid's local GEMMs per block: C × C tiles against query sub-blocks",
        "",
        f"Command: `.venv/bin/python analysis/bench_hybrid_tiles.py{' '.join([''] + (argv or sys.argv[1:]))}`",
        "",
        f"One steady block: {N} chunks of C = {C} queries, B·H = {BH}, D = Dv = M = {D}, window w = {w} (no sinks: "
        f"they cost the same in both); today n_loc = {old['n_loc']} key chunks of {C}, {old['n_far']} partly far; "
        f"sub-blocks of b = {b}: a band of {new['n_loc']}·{b} keys, {new['n_far']} far tile(s) of {b} × {b}. CPU "
        f"time, 1 thread, best of {args.rounds} rounds, pieces timed in turns; torch {torch.__version__}, "
        f"{platform.machine()}; wall time {time.time() - t0:.0f} s.",
        "",
        "| piece | today (b = C) ms | sub-blocks ms |",
        "|---|---:|---:|",
        *[f"| {name} | {fmt(a)} | {fmt(c)} |" for name, a, c in rows],
        f"| **total (forward GEMMs, softmax, backward GEMMs)** | {total_old:.3f} | {total_new:.3f} |",
        "",
        f"Multiply-adds per block: forward {old['macs_fwd'] / 1e6:.1f} M → {new['macs_fwd'] / 1e6:.1f} M, backward "
        f"{old['macs_bwd'] / 1e6:.1f} M → {new['macs_bwd'] / 1e6:.1f} M; achieved forward "
        f"{2 * old['macs_fwd'] / fwd_old / 1e6:.1f} → {2 * new['macs_fwd'] / fwd_new / 1e6:.1f} GFLOP/s.",
        f"Saved per block: {fwd_old - fwd_new + ms['today', 'softmax'] - ms['sub', 'softmax']:.3f} ms forward, "
        f"{total_old - total_new:.3f} ms forward + backward.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        with atomic_write(args.out) as tmp:
            tmp.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
