"""Decoding one token at a time: LLoPS's recurrent state and each long-context memory mechanism against
softmax attention with a KV cache, through the public call and through the lean step.

One attention layer (B = 1, H heads, D = Dv), context lengths 1k … 32k, side by side in one run:

* ``SDPA + KV cache`` — the new token's query against the cached ``K, V [B, H, L, D]`` through
  ``torch.nn.functional.scaled_dot_product_attention``, the new key/value appended (the cache is
  preallocated, as serving stacks do, so the append is a copy into it).
* ``SDPA, contiguous K, V (no append)`` — the same query against a contiguous ``K, V`` of the
  context only: a lower bound on any KV-cache step (nothing appended, no strided view).
* each mechanism (DESIGN §6, §7): pure LLoPS linear attention, the hybrid (``--window`` keys +
  sinks), and the hybrid with a sparse exact cache of ``--cache`` far keys (188: window + sinks +
  cache = 256 exact keys), a data-dependent decay (``decay="input"``), the delta rule, the gated delta
  rule (delta + input decay) and the delta rule with the cache. Its state comes from one prefill call
  on the context; then two rows:
  ``public call`` — one :func:`sketchlab.attention.linear_attention` call per token (two LLoPS maps) with
  ``initial_state``/``output_final_state`` (its per-call checks included), and ``lean step`` — one
  :meth:`sketchlab.attention.recurrent.RecurrentStep.step` per token (the LLoPS features of q and
  k computed each token, ``llops_pair_features``, inside the timing; the map is non-negative, so the
  step skips the denominator check), under ``torch.inference_mode``; on the CPU both are one compiled
  call each (``attention/ops/fused_recurrent.py``; the report says whether it built).

Reported: tokens/s (best of ``--reps`` runs of ``--steps`` steps, by the wall clock and by the
process's CPU time), the ratio to SDPA with a KV cache and to the faster SDPA row, the step's
multiply-adds (``step_macs``) and its time ÷ its arithmetic at the matmul rate measured in the same
run (a ``1024 × 1024`` float32 GEMM, best of 5), and the state's bytes (the KV cache's
``2·B·H·L·D·4``; the public state's tensors; the lean step's buffers). Writes ``analysis/results/decode.md``.

    .venv/bin/python analysis/bench_decode.py            # ~5 min on 1 CPU thread (prefills at 32k)
    .venv/bin/python analysis/bench_decode.py --quick    # smoke run
    .venv/bin/python analysis/bench_decode.py --profile  # where a memory row's public call goes -> decode_profile.md
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sketchlab.attention import (  # noqa: E402
    AttentionOptions,
    FarParams,
    linear_attention,  # noqa: E402
)
from sketchlab.attention.ops import fused_recurrent  # noqa: E402
from sketchlab.attention.ops.pair_features import llops_pair_features  # noqa: E402
from sketchlab.attention.recurrent import RecurrentStep  # noqa: E402
from sketchlab.featuremaps import LLoPSMap  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402
from sketchlab.llops.maps import llops_is_non_negative  # noqa: E402


def best_rate(step, steps: int, reps: int) -> tuple[float, float]:
    """Tokens/s: best over ``reps`` runs of ``steps`` calls of ``step(i)``, by the wall clock and by
    the process's CPU time (one thread: its time on a core, which other jobs on a shared machine
    stretch far less than the wall clock)."""
    wall = cpu = math.inf
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(steps):
            step(i)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return steps / wall, steps / cpu


def matmul_rate(n: int = 1024, reps: int = 5) -> float:
    """Multiply-adds per second of one float32 ``[n, n] @ [n, n]`` GEMM on this thread (best of ``reps``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(reps):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return n ** 3 / best


def step_macs(options: AttentionOptions, H: int, D: int, M: int, theta_shape) -> int:
    """Multiply-adds of one decoding step of one layer (a multiply alone counted as one): the LLoPS features
    of q and k (``2·H·D·t·p·M``), the far read (``H·M·(Dv+1)``), the key entering the state (additive
    ``H·M·(Dv+1)``; delta ``2·H·M·Dv``), the decay (``H·M·(Dv+1)``), the exact part (logits ``H·N·D`` and
    the weighted values ``H·N·(Dv+1)``, ``N = sinks + window + cache``), the cache's score of the leaving
    key (``H·M·(Dv+1)``) and its re-scoring every ``rescore`` tokens (``H·K·M·(Dv+1)/rescore``)."""
    _, t, p, _, _ = theta_shape
    o, Dv = options, D
    N = o.sinks + o.window + o.cache if o.window else 0
    macs = 2 * H * D * t * p * M + H * M * (Dv + 1)
    macs += 2 * H * M * Dv if o.state == "delta" else H * M * (Dv + 1)
    macs += H * M * (Dv + 1) if o.decay not in (None, 1.0) else 0
    macs += H * N * D + H * N * (Dv + 1)
    if o.cache:
        macs += H * M * (Dv + 1) + H * o.cache * M * (Dv + 1) // o.rescore
    return macs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--L", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1024, 2048, 4096, 8192, 16384, 32768], help="context lengths")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--cache", type=int, default=188, help="far keys kept exact by the cache rows")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: L = 256, 1024, 16 steps")
    parser.add_argument("--out", default=str(ROOT / "analysis" / "results" / "decode.md"))
    parser.add_argument("--profile", action="store_true",
                        help="profile one decoded token of each memory row (cProfile, CPU time) at the first --L "
                             "and write decode_profile.md beside --out")
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
    lmap = LLoPSMap.over(theta)  # the op's map of this Θ
    new = torch.randn(args.steps, B, 1, H, D, generator=gen)  # the decoded tokens' q = k = v (timing only)
    hybrid = dict(normalize="sum", non_negative=False, backend="torch", window=args.window, sinks=args.sinks)
    w, s, K = args.window, args.sinks, args.cache
    variants = [  # label, options, target × SDPA of the public call (the lean step's: 50×)
        (f"LLoPS m={M} state", AttentionOptions(normalize="sum", backend="torch"), 10),
        (f"LLoPS m={M} hybrid w={w}+{s} state", AttentionOptions(**hybrid), 10),
        (f"hybrid w={w}+{s} + cache K={K}", AttentionOptions(**hybrid, cache=K), 5),
        (f"hybrid w={w}+{s} + decay='input'", AttentionOptions(**hybrid, decay="input"), 5),
        (f"hybrid w={w}+{s} + delta state", AttentionOptions(**hybrid, state="delta"), 5),
        (f"hybrid w={w}+{s} + gated delta (decay='input')", AttentionOptions(**hybrid, state="delta", decay="input"), 5),
        (f"hybrid w={w}+{s} + delta state + cache K={K}", AttentionOptions(**hybrid, state="delta", cache=K), 5),
    ]
    targets = {label: target for label, _, target in variants}
    if args.profile:
        return profile(args, variants, theta, new, Path(args.out).with_name("decode_profile.md"))
    compiled = fused_recurrent.available()  # built (or loaded) before any timing
    rate = matmul_rate()
    pair = llops_pair_features(theta, theta, B)
    non_negative = llops_is_non_negative(theta)  # the lean step need not check its denominators
    load_before = os.getloadavg()
    rows = []  # (method, path, L, tok/s, tok/s by CPU time, MACs or None, bytes)
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

        with torch.inference_mode():
            r_kv = best_rate(sdpa_step, args.steps, args.reps)
        kv_bytes = 2 * B * H * L * D * 4
        rows.append(("SDPA + KV cache", "", L, *r_kv, None, kv_bytes))
        kc, vc = ctx[1].transpose(1, 2).contiguous(), ctx[2].transpose(1, 2).contiguous()  # [B, H, L, D]

        def sdpa_bound(i, kc=kc, vc=vc):
            F.scaled_dot_product_attention(new[i].transpose(1, 2), kc, vc)

        with torch.inference_mode():
            rows.append(("SDPA, contiguous K, V (no append)", "", L, *best_rate(sdpa_bound, args.steps, args.reps),
                         None, kv_bytes))
        for label, options, _ in variants:
            params = FarParams(options, H, D) if options.memory else None
            call = dict(options=options, params=params)
            with torch.no_grad():
                _, state0 = linear_attention(*ctx, lmap, output_final_state=True, **call)
                holder = {"state": state0}

                def public_step(i, holder=holder, call=call):
                    x = new[i]
                    _, holder["state"] = linear_attention(x, x, x, lmap, initial_state=holder["state"],
                                                          output_final_state=True, **call)

                rows.append((label, "public call", L, *best_rate(public_step, args.steps, args.reps), None,
                             holder["state"].nbytes))
            lean = RecurrentStep.from_state(state0, options=options, params=params, non_negative=non_negative)
            heads = [x.transpose(1, 2).reshape(B * H, 1, D) for x in new]  # [B·H, 1, D]

            def lean_step(i, lean=lean):
                x = heads[i]
                fq, fk = pair(x, x)
                lean.step(x, x, x, fq, fk)

            with torch.inference_mode():
                r = best_rate(lean_step, args.steps, args.reps)
            rows.append((label, "lean step", L, *r, step_macs(options, H, D, M, theta.shape), lean.nbytes))
        for name, path, LL, r, rc, _, nb in rows[-2 - 2 * len(variants):]:
            print(f"L={LL:6d} {name:52s} {path:11s} {r:9.1f} tok/s (CPU time: {rc:9.1f})  state {nb / 2**20:8.3f} MiB",
                  flush=True)
    wall = time.perf_counter() - t_start
    load_after = os.getloadavg()
    kv, kv_cpu, best, best_cpu = {}, {}, {}, {}
    for name, _, L, r, rc, _, _ in rows:
        if name.startswith("SDPA"):
            best[L], best_cpu[L] = max(best.get(L, 0.0), r), max(best_cpu.get(L, 0.0), rc)
            if name == "SDPA + KV cache":
                kv[L], kv_cpu[L] = r, rc
    cmd = " ".join([".venv/bin/python", "analysis/bench_decode.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# Decoding: tokens/s and state memory vs context length (CPU)",
        "",
        f"Command: `{cmd}`",
        "",
        f"One attention layer, B = 1, H = {H}, D = Dv = {D}, LLoPS m = {M} (p = 2, rank 1), float32, "
        f"{args.threads} torch thread(s); torch {torch.__version__}, {platform.processor() or platform.machine()}; "
        f"best of {args.reps} runs of {args.steps} decoded tokens; wall time {wall:.0f} s. Each state comes from one "
        "prefill call on the context. `public call`: one `linear_attention` call per token with "
        "`initial_state`/`output_final_state` (the public API, its per-call checks included; the memory rows pass one "
        "`AttentionOptions` and its `FarParams`). `lean step`: `RecurrentStep.step` per token "
        "(`sketchlab.attention.recurrent`; the LLoPS features of q and k computed each token, "
        "`llops_pair_features`, inside the timing; the map non-negative, so no denominator check; under "
        "`torch.inference_mode`). **Compiled step: "
        f"{'yes' if compiled else 'NO (the torch twin)'}** (the whole step and the features as one C++ call each, "
        "`sketchlab/attention/ops/fused_recurrent.py`; else their torch twins). SDPA runs under "
        "`torch.inference_mode` too.",
        "",
        f"Matmul rate measured in this run (float32 1024×1024 GEMM, one thread, CPU time): **{rate / 1e9:.1f} G "
        "multiply-adds/s**. `MACs`: the lean step's multiply-adds (`step_macs`); `÷ arithmetic`: its CPU time per "
        "token ÷ (MACs ÷ that rate).",
        "",
        f"Machine load (1/5/15-min load average, {os.cpu_count()} CPUs): before "
        f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)}. "
        "A shared machine: other jobs slow every row (SDPA too), so compare the ratios within one run; "
        "by CPU time: the process's CPU time over the same runs (one thread).",
        "",
        "| method | path | context L | tokens/s | × SDPA + KV cache | × best SDPA | tokens/s by CPU time | "
        "× SDPA + KV by CPU time | MACs | ÷ arithmetic | state MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, path, L, r, rc, macs, nb in rows:
        arith = "" if macs is None else f"{rate / macs / rc:.1f}"
        lines.append(f"| {name} | {path} | {L} | {r:.1f} | {r / kv[L]:.2f} | {r / best[L]:.2f} | {rc:.1f} | "
                     f"{rc / kv_cpu[L]:.2f} | {'' if macs is None else macs} | {arith} | {nb / 2**20:.3f} |")
    L_max, L_min = max(args.L), min(args.L)
    lines += ["", "## Checks", ""]
    lines.append("Verdicts by CPU time (the process's time on its core: on this shared machine the wall clock also counts "
                 "the time other jobs held the core, and swings several-fold between rows); the wall-clock ratio beside it.")
    lines.append("")
    for name in targets:
        for path in ("public call", "lean step"):
            sel = [(L, r, rc, macs, nb) for n, pth, L, r, rc, macs, nb in rows if n == name and pth == path]
            _, r, rc, macs, _ = next(x for x in sel if x[0] == L_max)
            target = targets[name] if path == "public call" else 50
            sizes = {nb for *_, nb in sel}
            x_cpu = rc / kv_cpu[L_max]
            line = (f"- {name}, {path}, at L={L_max}: **{x_cpu:.1f}× SDPA + KV cache** tokens/s by CPU time (target ≥ "
                    f"{target}×: {'met' if x_cpu >= target else 'NOT met'}; by the wall clock {r / kv[L_max]:.1f}×; "
                    f"× best SDPA {rc / best_cpu[L_max]:.1f}×); state "
                    f"{'constant' if len(sizes) == 1 else 'varies'} in L "
                    f"({', '.join(f'{x / 2**20:.3f}' for x in sorted(sizes))} MiB) vs the KV cache's "
                    f"{2 * B * H * L_min * D * 4 / 2**20:.1f} → {2 * B * H * L_max * D * 4 / 2**20:.1f} MiB")
            if path == "lean step":
                worst = max(rate / m / c for _, _, c, m, _ in sel)
                first = min((L for L, _, rc, *_ in sel if all(c2 >= kv_cpu[L2] for L2, _, c2, *_ in sel if L2 >= L)),
                            default=None)
                line += (f"; time ÷ arithmetic ≤ **{worst:.1f}×** at every L (target ≤ 20×: "
                         f"{'met' if worst <= 20 else 'NOT met'}); as fast as SDPA + KV cache from L = "
                         f"{first if first is not None else 'never'} on (by CPU time)")
            lines.append(line + ".")
    lines += ["", "Where a memory row's public call goes (its fixed per-call cost: the entry's checks, the LLoPS "
              "features, the decoding step `ops/cache/recurrent.decode`): `analysis/results/decode_profile.md` "
              "(`--profile`).", ""]
    text = "\n".join(lines)
    with atomic_write(out_md) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out_md}")
    return 0


#: The calls a memory row's token passes through (function names; the file decides where each is).
PROFILED = ("linear_attention", "_route", "check_qkv", "check_all_finite", "check_theta",
            "check_llops_kernel_range", "llops_feature_fn", "_flat", "feats", "memory_call", "check_memory_call",
            "check_memory_state", "check_far_params", "run", "decode", "recall_score", "local_weights")


def profile(args, variants, theta, new, out_md: Path) -> int:
    """Per decoded token, the CPU time inside each call of :data:`PROFILED` (cumulative, under cProfile,
    so inflated by the profiler's own cost: compare the calls with one another) for each memory row."""
    import cProfile
    import pstats

    B, H, D = 1, args.heads, args.d
    L = args.L[0]
    lmap = LLoPSMap.over(theta)
    gen = torch.Generator().manual_seed(1)
    ctx = [torch.randn(B, L, H, D, generator=gen) * D**-0.25 for _ in range(3)]
    n = 2 * args.steps
    load = os.getloadavg()
    lines = ["# Decoding with the memory mechanisms: where one token's time goes (CPU)", "",
             "Command: `" + " ".join([".venv/bin/python", "analysis/bench_decode.py", *sys.argv[1:]]) + "`", "",
             f"Context L = {L}, B = 1, H = {H}, D = Dv = {D}, m = {args.m}, float32, {args.threads} thread(s); "
             f"{n} decoded tokens per row under cProfile with the process's CPU time as its clock (load average "
             f"{'/'.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} CPUs). ms per token: the unprofiled "
             "CPU time, then each call's cumulative time under the profiler (its callees included; the "
             "profiler inflates small calls).", ""]
    for label, options, _ in variants:
        if not options.memory:
            continue
        params = FarParams(options, H, D)
        with torch.no_grad():
            _, state = linear_attention(*ctx, lmap, options=options, params=params, output_final_state=True)
            holder = {"state": state}

            def steps(count, holder=holder, options=options, params=params):
                for i in range(count):
                    x = new[i % len(new)]
                    _, holder["state"] = linear_attention(x, x, x, lmap, options=options, params=params,
                                                          initial_state=holder["state"], output_final_state=True)

            steps(8)
            c0 = time.process_time()
            steps(n)
            plain = (time.process_time() - c0) / n
            prof = cProfile.Profile(time.process_time)
            prof.enable()
            steps(n)
            prof.disable()
        spent = {}
        for (path, _, fn), entry in pstats.Stats(prof).stats.items():
            if fn in PROFILED and "sketchlab" in path:
                key = f"`{Path(path).name}:{fn}`"
                spent[key] = spent.get(key, 0.0) + entry[3] / n
        lines += [f"## {label}", "", f"Unprofiled: **{plain * 1e3:.2f} ms** CPU per token.", "",
                  "| call | ms per token (profiled, cumulative) |", "|---|---:|"]
        lines += [f"| {k} | {v * 1e3:.2f} |" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])]
        lines.append("")
        print(f"{label}: {plain * 1e3:.2f} ms/token", flush=True)
    with atomic_write(out_md) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {out_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
