"""Decoding one token at a time: LLoPS's recurrent state against softmax attention with a KV cache.

One attention layer (B = 1, H heads, D = Dv), context lengths 1k … 32k, side by side in one run:

* ``SDPA + KV cache`` — the new token's query against the cached ``K, V [B, H, L, D]`` through
  ``torch.nn.functional.scaled_dot_product_attention``, the new key/value appended (the cache is
  preallocated, as serving stacks do, so the append is a copy into it).
* ``SDPA, contiguous K, V (no append)`` — the same query against a contiguous ``K, V`` of the
  context only: a lower bound on any KV-cache step (nothing appended, no strided view); the
  ratios below are against the faster of the two SDPA rows.
* ``LLoPS state`` — :func:`sketchlab.attention.llops_attention` on the one new token with
  ``initial_state`` / ``output_final_state`` (the :class:`AttentionState` of the context, made by
  one chunked prefill call), pure (``window=0``) and the hybrid (``--window`` keys + sinks).

Reported: tokens/s (best of ``--reps`` runs of ``--steps`` steps), the state's bytes (the KV
cache's ``2·B·H·L·D·4``; the LLoPS state's tensors) and the ratio to SDPA. Writes
``analysis/results/decode.md``.

    .venv/bin/python analysis/bench_decode.py            # ~2-4 min on 1 CPU thread
    .venv/bin/python analysis/bench_decode.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sketchlab.attention import llops_attention  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402


def best_rate(step, steps: int, reps: int) -> float:
    """Tokens/s: best over ``reps`` runs of ``steps`` calls of ``step(i)``."""
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        best = min(best, time.perf_counter() - t0)
    return steps / best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--L", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1024, 2048, 4096, 8192, 16384, 32768], help="context lengths")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: L = 256, 1024, 16 steps")
    parser.add_argument("--out", default=str(ROOT / "analysis" / "results" / "decode.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.L, args.steps, args.reps = [256, 1024], 16, 1
    torch.set_num_threads(args.threads)
    out_md = Path(args.out)
    if not out_md.parent.is_dir():
        parser.error(f"output directory {out_md.parent} does not exist")
    gen = torch.Generator().manual_seed(0)
    B, H, D, M = 1, args.heads, args.d, args.m
    # equal factors: features (θ·x)² >= 0, so normalize="sum" is safe
    theta = (torch.randn(H, 1, 1, D, M, generator=gen) / math.sqrt(D)).expand(-1, -1, 2, -1, -1).contiguous()
    new = torch.randn(args.steps, B, 1, H, D, generator=gen)  # the decoded tokens' q = k = v (timing only)
    rows = []
    t_start = time.perf_counter()
    for L in args.L:
        ctx = [torch.randn(B, L, H, D, generator=gen) * D**-0.25 for _ in range(3)]
        # SDPA with a preallocated KV cache [B, H, L + steps, D]
        cache_k = torch.zeros(B, H, L + args.steps, D)
        cache_v = torch.zeros(B, H, L + args.steps, D)
        cache_k[:, :, :L] = ctx[1].transpose(1, 2)
        cache_v[:, :, :L] = ctx[2].transpose(1, 2)

        def sdpa_step(i, L=L, ck=cache_k, cv=cache_v):
            x = new[i].transpose(1, 2)  # [B, H, 1, D]
            ck[:, :, L + i] = x[:, :, 0]
            cv[:, :, L + i] = x[:, :, 0]
            F.scaled_dot_product_attention(x, ck[:, :, :L + i + 1], cv[:, :, :L + i + 1])

        with torch.no_grad():
            rate = best_rate(sdpa_step, args.steps, args.reps)
        kv_bytes = 2 * B * H * L * D * 4
        rows.append(("SDPA + KV cache", L, rate, kv_bytes))
        kc, vc = ctx[1].transpose(1, 2).contiguous(), ctx[2].transpose(1, 2).contiguous()  # [B, H, L, D]

        def sdpa_bound(i, kc=kc, vc=vc):
            F.scaled_dot_product_attention(new[i].transpose(1, 2), kc, vc)

        with torch.no_grad():
            rows.append(("SDPA, contiguous K, V (no append)", L, best_rate(sdpa_bound, args.steps, args.reps), kv_bytes))
        for label, opts in (("LLoPS m=%d state" % M, {}),
                            (f"LLoPS m={M} hybrid w={args.window}+{args.sinks} state",
                             {"window": args.window, "sinks": args.sinks})):
            with torch.no_grad():
                _, state0 = llops_attention(*ctx, theta, theta, backend="torch", output_final_state=True, **opts)
                holder = {"state": state0}

                def llops_step(i, holder=holder, opts=opts):
                    x = new[i]
                    _, holder["state"] = llops_attention(x, x, x, theta, theta, backend="torch",
                                                         initial_state=holder["state"], output_final_state=True,
                                                         **opts)

                holder["state"] = state0
                rate = best_rate(llops_step, args.steps, args.reps)
            rows.append((label, L, rate, state0.nbytes))
        for name, LL, r, nb in rows[-4:]:
            print(f"L={LL:6d} {name:40s} {r:9.1f} tok/s  state {nb / 2**20:8.3f} MiB", flush=True)
    wall = time.perf_counter() - t_start
    sdpa = {}
    for name, L, r, _ in rows:
        if name.startswith("SDPA"):
            sdpa[L] = max(sdpa.get(L, 0.0), r)  # the faster SDPA variant
    lines = [
        "# Decoding: tokens/s and state memory vs context length (CPU)",
        "",
        "Command: `" + " ".join([".venv/bin/python", "analysis/bench_decode.py", *sys.argv[1:]]) + "`",
        "",
        f"One attention layer, B = 1, H = {H}, D = Dv = {D}, LLoPS m = {M} (p = 2, rank 1), float32, "
        f"{args.threads} torch thread(s); torch {torch.__version__}, {platform.processor() or platform.machine()}; "
        f"best of {args.reps} runs of {args.steps} decoded tokens; wall time {wall:.0f} s. The LLoPS state comes "
        "from one chunked prefill call on the context; each step is one `llops_attention` call on one token "
        "with `initial_state`/`output_final_state` (the public API, its per-call checks included).",
        "",
        "| method | context L | tokens/s | × best SDPA | state MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, L, r, nb in rows:
        lines.append(f"| {name} | {L} | {r:.1f} | {r / sdpa[L]:.2f} | {nb / 2**20:.3f} |")
    L_max = max(args.L)
    lines += ["", "## Checks", ""]
    for name in dict.fromkeys(n for n, *_ in rows if not n.startswith("SDPA")):
        r = next(r for n, L, r, _ in rows if n == name and L == L_max)
        sizes = {nb for n, L, _, nb in rows if n == name}
        lines.append(f"- {name} at L={L_max}: **{r / sdpa[L_max]:.1f}× the faster SDPA** tokens/s (target ≥ 10×: "
                     f"{'met' if r / sdpa[L_max] >= 10 else 'NOT met'}); state "
                     f"{'constant' if len(sizes) == 1 else 'varies'} in L ({', '.join(f'{s / 2**20:.3f}' for s in sorted(sizes))} MiB) "
                     f"vs the KV cache's {2 * B * H * min(args.L) * D * 4 / 2**20:.1f} → {2 * B * H * L_max * D * 4 / 2**20:.1f} MiB.")
    lines.append("")
    text = "\n".join(lines)
    with atomic_write(out_md) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
