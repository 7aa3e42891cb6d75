"""Decoding one token at a time: LLoPS's recurrent state (and each long-context memory mechanism)
against softmax attention with a KV cache.

One attention layer (B = 1, H heads, D = Dv), context lengths 1k … 32k, side by side in one run:

* ``SDPA + KV cache`` — the new token's query against the cached ``K, V [B, H, L, D]`` through
  ``torch.nn.functional.scaled_dot_product_attention``, the new key/value appended (the cache is
  preallocated, as serving stacks do, so the append is a copy into it).
* ``SDPA, contiguous K, V (no append)`` — the same query against a contiguous ``K, V`` of the
  context only: a lower bound on any KV-cache step (nothing appended, no strided view); the
  ratios below are against the faster of the two SDPA rows.
* ``LLoPS state`` — :func:`sketchlab.attention.functional.llops_attention` on the one new token with
  ``initial_state`` / ``output_final_state`` (the :class:`AttentionState` of the context, made by
  one chunked prefill call), pure (``window=0``) and the hybrid (``--window`` keys + sinks).
* the memory mechanisms (DESIGN §7), each the hybrid plus one option of one
  :class:`~sketchlab.attention.AttentionOptions` passed to the same ``llops_attention`` call (with
  its :class:`~sketchlab.attention.FarParams`; the state a :class:`MemoryState` made by one prefill
  call): a sparse exact cache of ``--cache`` far keys (188: window + sinks + cache = 256 exact keys),
  a data-dependent decay (``decay="input"``), the delta-rule state, and the delta state with the
  cache.

Reported: tokens/s (best of ``--reps`` runs of ``--steps`` steps), the state's bytes (the KV
cache's ``2·B·H·L·D·4``; the LLoPS state's tensors) and the ratio to SDPA; the load average of
the machine before and after (a shared machine: every row slows under load, SDPA too). Writes
``analysis/results/decode.md``.

    .venv/bin/python analysis/bench_decode.py            # ~6-10 min on 1 CPU thread (prefills at 32k)
    .venv/bin/python analysis/bench_decode.py --quick    # smoke run
    .venv/bin/python analysis/bench_decode.py --profile  # where a memory row's token goes -> decode_profile.md
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

from sketchlab.attention import AttentionOptions, FarParams  # noqa: E402
from sketchlab.attention.functional import llops_attention  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402


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
    new = torch.randn(args.steps, B, 1, H, D, generator=gen)  # the decoded tokens' q = k = v (timing only)
    hybrid = dict(normalize="sum", non_negative=False, backend="torch", window=args.window, sinks=args.sinks)
    w, s, K = args.window, args.sinks, args.cache
    variants = [  # label, options (None: the keywords of the rows before the memory options), target × SDPA
        (f"LLoPS m={M} state", None, {}, 10),
        (f"LLoPS m={M} hybrid w={w}+{s} state", None, {"window": w, "sinks": s}, 10),
        (f"hybrid w={w}+{s} + cache K={K}", AttentionOptions(**hybrid, cache=K), None, 5),
        (f"hybrid w={w}+{s} + decay='input'", AttentionOptions(**hybrid, decay="input"), None, 5),
        (f"hybrid w={w}+{s} + delta state", AttentionOptions(**hybrid, state="delta"), None, 5),
        (f"hybrid w={w}+{s} + delta state + cache K={K}", AttentionOptions(**hybrid, state="delta", cache=K), None, 5),
    ]
    targets = {label: target for label, _, _, target in variants}
    if args.profile:
        return profile(args, variants, theta, new, Path(args.out).with_name("decode_profile.md"))
    load_before = os.getloadavg()
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
        rows.append(("SDPA + KV cache", L, *rate, kv_bytes))
        kc, vc = ctx[1].transpose(1, 2).contiguous(), ctx[2].transpose(1, 2).contiguous()  # [B, H, L, D]

        def sdpa_bound(i, kc=kc, vc=vc):
            F.scaled_dot_product_attention(new[i].transpose(1, 2), kc, vc)

        with torch.no_grad():
            rows.append(("SDPA, contiguous K, V (no append)", L, *best_rate(sdpa_bound, args.steps, args.reps),
                         kv_bytes))
        for label, options, opts, _ in variants:
            if options is None:  # the keyword call of the rows before the options object
                call = dict(backend="torch", **opts)
            else:
                params = FarParams(options, H, D) if options.memory else None
                call = dict(options=options, params=params)
            with torch.no_grad():
                _, state0 = llops_attention(*ctx, theta, theta, output_final_state=True, **call)
                holder = {"state": state0}

                def llops_step(i, holder=holder, call=call):
                    x = new[i]
                    _, holder["state"] = llops_attention(x, x, x, theta, theta, initial_state=holder["state"],
                                                         output_final_state=True, **call)

                rate = best_rate(llops_step, args.steps, args.reps)
            rows.append((label, L, *rate, holder["state"].nbytes))
        for name, LL, r, rc, nb in rows[-2 - len(variants):]:
            print(f"L={LL:6d} {name:48s} {r:9.1f} tok/s (CPU time: {rc:9.1f})  state {nb / 2**20:8.3f} MiB",
                  flush=True)
    wall = time.perf_counter() - t_start
    load_after = os.getloadavg()
    sdpa, sdpa_cpu = {}, {}
    for name, L, r, rc, _ in rows:
        if name.startswith("SDPA"):
            sdpa[L] = max(sdpa.get(L, 0.0), r)  # the faster SDPA variant
            sdpa_cpu[L] = max(sdpa_cpu.get(L, 0.0), rc)
    lines = [
        "# Decoding: tokens/s and state memory vs context length (CPU)",
        "",
        "Command: `" + " ".join([".venv/bin/python", "analysis/bench_decode.py", *sys.argv[1:]]) + "`",
        "",
        f"One attention layer, B = 1, H = {H}, D = Dv = {D}, LLoPS m = {M} (p = 2, rank 1), float32, "
        f"{args.threads} torch thread(s); torch {torch.__version__}, {platform.processor() or platform.machine()}; "
        f"best of {args.reps} runs of {args.steps} decoded tokens; wall time {wall:.0f} s. The LLoPS state comes "
        "from one chunked prefill call on the context; each step is one `llops_attention` call on one token "
        "with `initial_state`/`output_final_state` (the public API, its per-call checks included). The memory "
        "rows pass one `AttentionOptions` (normalize='sum', non_negative=False, backend='torch', the hybrid's "
        f"window and sinks, and the mechanism) and its `FarParams` (initial values) to the same call; their state "
        "is a `MemoryState`.",
        "",
        f"Machine load (1/5/15-min load average, {os.cpu_count()} CPUs): before "
        f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)}. "
        "A shared machine: other jobs slow every row (SDPA too), so compare the ratios within one run.",
        "",
        "",
        "tokens/s: by the wall clock; by CPU time: by the process's CPU time over the same runs (one thread).",
        "",
        "| method | context L | tokens/s | × best SDPA | tokens/s by CPU time | × best SDPA by CPU time | state MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, L, r, rc, nb in rows:
        lines.append(f"| {name} | {L} | {r:.1f} | {r / sdpa[L]:.2f} | {rc:.1f} | {rc / sdpa_cpu[L]:.2f} | "
                     f"{nb / 2**20:.3f} |")
    L_max = max(args.L)
    lines += ["", "## Checks", ""]
    for name in dict.fromkeys(n for n, *_ in rows if not n.startswith("SDPA")):  # noqa: B007
        r, rc = next((r, rc) for n, L, r, rc, _ in rows if n == name and L == L_max)
        sizes = {nb for n, L, _, _, nb in rows if n == name}
        target = targets[name]
        lines.append(f"- {name} at L={L_max}: **{r / sdpa[L_max]:.1f}× the faster SDPA** tokens/s (target ≥ {target}×: "
                     f"{'met' if r / sdpa[L_max] >= target else 'NOT met'}; by CPU time {rc / sdpa_cpu[L_max]:.1f}×); state "
                     f"{'constant' if len(sizes) == 1 else 'varies'} in L ({', '.join(f'{s / 2**20:.3f}' for s in sorted(sizes))} MiB) "
                     f"vs the KV cache's {2 * B * H * min(args.L) * D * 4 / 2**20:.1f} → {2 * B * H * L_max * D * 4 / 2**20:.1f} MiB.")
    lines += ["", "Where a memory row's token goes (its fixed per-call cost: the entry's checks, the LLoPS features, "
              "the decoding step `memory_decode.decode`): `analysis/results/decode_profile.md` (`--profile`).", ""]
    text = "\n".join(lines)
    with atomic_write(out_md) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out_md}")
    return 0


#: The calls a memory row's token passes through (function names; the file decides where each is).
PROFILED = ("llops_attention", "call_options", "check_qkv", "check_all_finite", "check_theta",
            "check_llops_kernel_range", "llops_feature_fn", "_flat", "feats", "memory_call", "_check_call",
            "check_memory_state", "_check_params", "run", "decode", "_score", "_local_weights")


def profile(args, variants, theta, new, out_md: Path) -> int:
    """Per decoded token, the CPU time inside each call of :data:`PROFILED` (cumulative, under cProfile,
    so inflated by the profiler's own cost: compare the calls with one another) for each memory row."""
    import cProfile
    import pstats

    B, H, D = 1, args.heads, args.d
    L = args.L[0]
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
    for label, options, _, _ in variants:
        if options is None or not options.memory:
            continue
        params = FarParams(options, H, D)
        with torch.no_grad():
            _, state = llops_attention(*ctx, theta, theta, options=options, params=params, output_final_state=True)
            holder = {"state": state}

            def steps(count, holder=holder, options=options, params=params):
                for i in range(count):
                    x = new[i % len(new)]
                    _, holder["state"] = llops_attention(x, x, x, theta, theta, options=options, params=params,
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
