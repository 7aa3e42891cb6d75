"""The LLoPS paper's Figure 2 on this machine: attention time vs sequence length.

One run, side by side: causal softmax (SDPA), exact polynomial attention (quadratic, blocked),
BASED's Taylor map (273 features) through the chunked linear-attention path, LLoPS at
m ∈ {64, 128, 256} and the sliding-window hybrid (``--window``, default 64 softmax keys + 4 sinks
+ the sketch beyond; ``--window 0`` leaves it out) (chunked PyTorch; under ``--device cuda`` also the fused Triton kernel and fla's
``chunk_linear_attn`` on materialised LLoPS features when importable). Forward and
forward+backward time, ratios to SDPA, achieved GFLOP/s against a matmul peak measured in the same
run, and peak memory. Writes ``analysis/results/attention_<device>.md`` and ``.png``.

    .venv/bin/python analysis/bench_attention.py                 # full run, ~5-10 min on 1 CPU thread
    .venv/bin/python analysis/bench_attention.py --quick         # smoke run, seconds

Peak memory (CPU) is the growth of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before each measurement, free heap returned with ``malloc_trim``) over
the resident set before it; on CUDA ``torch.cuda.max_memory_allocated``. The inputs q, k, v are
allocated before and not counted.

FLOP model (forward; "useful" FLOPs, multiply-add = 2): softmax and exact polynomial attention
``2·B·H·T(T+1)/2·(D + Dv)`` (the causal half of ``QKᵀ`` and ``AV``); chunked linear attention with
``M`` features and chunk ``C``: features (LLoPS ``2·2·B·H·T·D·t·p·M``, BASED ``2·2·B·H·T·D·16``) +
intra-chunk ``2·B·H·T·C·(M + Dv)`` + state update and read ``2·2·B·H·T·M·Dv``; the hybrid adds
its local band ``2·B·H·T·(w + C)·(D + Dv)`` (the band of ``w + C`` keys per chunk) and the sinks. Forward+backward
is counted as 3× forward (the usual estimate).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sketchlab.attention import AttentionOptions, linear_attention, poly_attention, softmax_attention  # noqa: E402
from sketchlab.attention.options import DEFAULT_BLOCK_CHUNKS, DEFAULT_CHUNK_SIZE  # noqa: E402
from sketchlab.featuremaps import LLoPSMap, TaylorMap  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402
from sketchlab.plots import save_figure  # noqa: E402

BASED_DIM = 16  # BASED projects to 16 dims: 1 + 16 + 16² = 273 Taylor features
SINGLE_RUN_S = 5.0  # a call longer than this is timed once (no warm-up, no repeats)


@dataclass
class Method:
    name: str
    fn: object  # (q, k, v) -> out
    flops: object  # (B, H, T, D, Dv) -> forward FLOPs
    kind: str  # "quadratic" or "linear"
    optional: bool = False  # a third-party or device-only path: dropped (with a message) if its warm-up fails
    paired: str | None = None  # timed in turns with this method (the hybrid with its pure path: one ratio)
    features: int | None = None  # the hybrid's m (its tile FLOP model's)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


LIBC = _libc()


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class Memory:
    """Peak memory of one call above what was resident before it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu_ok = device.type == "cpu" and Path("/proc/self/clear_refs").exists()

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.cpu_ok:
            if LIBC is not None:
                LIBC.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = _status("VmRSS")

    def stop(self) -> float:
        """Peak bytes above the start, or NaN where this platform cannot tell."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - self.base)
        if self.cpu_ok:
            return float(_status("VmHWM") - self.base)
        return math.nan


def matmul_peak(device, dtype, threads_note: str) -> float:
    """Best GFLOP/s of a 2048³ matmul (3 tries, after a warm-up)."""
    n = 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    clock = time.process_time if device.type == "cpu" else time.perf_counter  # as time_calls
    best = math.inf
    for _ in range(4):
        _sync(device)
        t0 = clock()
        a @ b
        _sync(device)
        best = min(best, clock() - t0)
    return 2 * n**3 / best / 1e9


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fns, device, *, backward: bool, budget_s: float, max_reps: int) -> list[float]:
    """Best time of each of ``fns`` (forward, or forward + backward of ``out.sum()``) over repeats, the calls
    taken in turns (one of each per round), so that the load of a shared machine, which drifts over a
    minute, falls on all of them alike and their ratio is not a draw of it.

    On CPU the time is this process's CPU time (``time.process_time``): with one torch thread it
    is the work done, and on a shared machine it leaves out the time other processes hold the
    core (wall time there swung by 1.5× between runs); on CUDA wall time after a synchronisation.
    A warm-up round first unless one call already takes over ``SINGLE_RUN_S`` (then warm-up
    effects are negligible and repeats too dear); then rounds until ``max_reps`` or
    ``budget_s`` per function spent. (With a 1 s limit the hybrid's 1.2 s call was one sample against the pure
    path's best of three: the ratio mixed a single draw of the noise with a minimum.)
    """
    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def once(fn):
        _sync(device)
        t0 = clock()
        if backward:
            out = fn()
            out.sum().backward()
        else:
            with torch.no_grad():
                fn()
        _sync(device)
        return clock() - t0

    first = [once(fn) for fn in fns]
    if max(first) > SINGLE_RUN_S:
        return first
    best, spent = [math.inf] * len(fns), 0.0
    for _ in range(max_reps):
        for i, fn in enumerate(fns):
            dt = once(fn)
            best[i], spent = min(best[i], dt), spent + dt
        if spent > budget_s * len(fns):
            break
    return best


def linear_flops(features_flops_per_token, M, C):
    def flops(B, H, T, D, Dv):
        return B * H * T * (features_flops_per_token(D) + 2 * C * (M + Dv) + 4 * M * Dv)
    return flops


def tile_macs(T: int, *, C: int, D: int, Dv: int, M: int, p: int, t: int = 1, window: int = 0, sinks: int = 0,
              block_chunks: int = DEFAULT_BLOCK_CHUNKS, local_block: int | None = None) -> dict:
    r"""Multiply-adds per query chunk (``C`` queries of one head) of the chunked torch path, tile by tile.

    The floor of a tile-based implementation: every GEMM the chunked cores run, at its full tile size
    (a masked ``C × C`` tile counts whole), plus the elementwise work as separate counts. Pure
    (``window = 0``) and hybrid alike:

    - features ``2·C·D·t·p·M`` (q and k: ``x @ Θ_flat``);
    - state update ``(N_e/N)·C·M·Dv`` (per key chunk ``φ(k)ᵀv``; the hybrid's block also reads the
      ``W_c = max(⌈w/C⌉, n_loc − 1)`` held window chunks: ``N_e = N + W_c``, ``N`` query chunks per block),
      the prefix of per-chunk states ``N_e·M·Dv`` (the 0/1 matrix times the ``N_e`` updates, per query
      chunk) and the state read ``C·M·Dv``;
    - pure: intra-chunk scores ``C·C·M`` and ``A·V`` ``C·C·Dv``;
    - hybrid: local logits over ``n_loc = ⌈(w + C − 1)/C⌉`` key chunks and the sinks
      ``C·(n_loc·C + sinks)·D``, the far part of the partly-far key chunks (``lag ≥ w``) through the
      features ``n_far·C·C·M`` and one ``A·V`` over the band ``C·(n_loc·C + sinks)·Dv``.

    Backward (hand-written cores; features by autograd): the state update and prefix recomputed, ``dP``,
    ``dφ(q)``, the prefix transposed, ``dφ(k)``, ``dv`` of the far state (``C·M·Dv`` or
    ``N_e·M·Dv`` each); per scored tile ``dA = dO·Vᵀ``, ``dV = Aᵀ·dO`` and, for the feature scores,
    ``dφ(q)``, ``dφ(k)`` (``C·C·M`` each), for the local logits ``dq``, ``dk`` (``C·(n_loc·C + sinks)·D``
    each); the features ``2·2·C·D·t·p·M`` (``dx`` and ``dΘ`` of q and k).

    ``local_block = b`` (a divisor of ``C``; not what the cores run today, which is ``b = C``) models a local
    part tiled in query sub-blocks of ``b`` rows with the state still per chunk of ``C``: each sub-block scores
    one band of ``n_loc = ⌈(w + b − 1)/b⌉`` key sub-blocks and the sinks and its ``n_far`` partly-far key
    sub-blocks through the features (``b × b`` each); the far keys between the chunk's state and a sub-block's
    band enter as per-sub-block state pieces (the same state-update multiply-adds, one elementwise add).

    Returns ``{"fwd": macs, "bwd": macs, "exp": exps, "n_loc", "n_far", "chunks_per_block"}`` (per query chunk;
    ``n_loc``, ``n_far`` in key tiles of ``local_block`` tokens).
    """
    b = C if local_block is None else local_block
    if b < 1 or C % b:
        raise ValueError(f"local_block must be a positive divisor of C={C}, got {local_block}")
    N = max(1, min(block_chunks, -(-T // C)))
    feat = 2 * C * D * t * p * M
    if window:
        n_loc = -(-(window + b - 1) // b)
        n_far = sum(1 for L in range(n_loc) if L * b + b - 1 >= window)
        Wc = max(-(-window // C), -(-(window + C - 1) // C) - 1)
    else:
        n_loc, n_far, Wc = 1, 1, 0
    Ne = N + Wc  # the hybrid's first block holds zero chunks in the window's place
    state_fwd = C * M * Dv * Ne / N + Ne * M * Dv + C * M * Dv
    state_bwd = (C * M * Dv * Ne / N + Ne * M * Dv) + 2 * C * M * Dv + Ne * M * Dv + 2 * C * M * Dv * Ne / N
    if not window:
        local_fwd, local_bwd, exps = C * C * (M + Dv), C * C * (Dv + Dv + 2 * M), 0
    else:
        band = n_loc * b + sinks  # keys of the local tile
        local_fwd = C * band * D + n_far * C * b * M + C * band * Dv
        local_bwd = C * band * Dv + C * band * Dv + n_far * 2 * C * b * M + 2 * C * band * D
        exps = C * band
    return {"fwd": feat + state_fwd + local_fwd, "bwd": 2 * feat + state_bwd + local_bwd, "exp": exps,
            "n_loc": n_loc, "n_far": n_far, "chunks_per_block": N}


def quadratic_flops(B, H, T, D, Dv):
    return 2 * B * H * T * (T + 1) / 2 * (D + Dv)


def build_methods(args, device, dtype, D, gen) -> list[Method]:
    C = args.chunk_size
    H = args.heads
    methods = [
        Method("softmax (SDPA)", lambda q, k, v: softmax_attention(q, k, v), quadratic_flops, "quadratic"),
        Method(f"exact poly p={args.p} (blocked)",
               lambda q, k, v: poly_attention(q * D**-0.25, k * D**-0.25, v, args.p), quadratic_flops, "quadratic"),
    ]
    proj = torch.randn(D, BASED_DIM, generator=gen) / math.sqrt(D)
    based_map = TaylorMap(H, D, proj=proj.expand(H, -1, -1), dtype=dtype).to(device)  # 273 features, proj learned
    n_based = 1 + BASED_DIM + BASED_DIM**2

    def op(fmap, **options):  # the op on fmap: sum-normalised, never self-tensored (the maps here are >= 0)
        o = AttentionOptions(normalize="sum", non_negative=False, chunk_size=C, **options)
        return lambda q, k, v: linear_attention(q, k, v, fmap, options=o)[0]

    based = op(based_map)

    methods.append(Method(f"BASED Taylor ({n_based} feat., chunked)", based,
                          linear_flops(lambda d: 4 * d * BASED_DIM, n_based, C), "linear"))
    for m in args.m:
        # equal factors Θ_{r,1} = Θ_{r,2}: features (θ·x)² ≥ 0, so normalize="sum" is safe
        base = torch.randn(H, 1, 1, D, m, generator=gen) / math.sqrt(D)
        theta = base.expand(-1, -1, args.p, -1, -1).contiguous().to(device=device, dtype=dtype).requires_grad_(True)
        pure = linear_flops(lambda d, m=m: 4 * d * args.p * m, m, C)
        lmap = LLoPSMap.over(theta)  # gradients reach theta
        methods.append(Method(f"LLoPS m={m} (chunked torch)", op(lmap, backend="torch"), pure, "linear"))
        if args.window:
            w, sinks = args.window, args.sinks
            methods.append(Method(
                f"LLoPS m={m} hybrid w={w}+{sinks} sinks (chunked torch)",
                op(lmap, backend="torch", window=w, sinks=sinks),
                lambda B, H, T, D, Dv, pure=pure: pure(B, H, T, D, Dv) + 2 * B * H * T * (w + C + sinks) * (D + Dv),
                "linear", paired=f"LLoPS m={m} (chunked torch)", features=m))
        if device.type == "cuda":
            try:
                from sketchlab.attention.triton import llops_attention_triton  # noqa: F401
                methods.append(Method(f"LLoPS m={m} (Triton)",
                                      op(lmap, backend="triton"),
                                      pure, "linear", optional=True))
            except ImportError as err:
                print(f"Triton kernel not importable ({err}); skipped", file=sys.stderr)
            try:
                from fla.ops.linear_attn import chunk_linear_attn

                from sketchlab.llops.maps import llops_feature_fn

                def fla(q, k, v, th=theta):
                    fq = llops_feature_fn(th)(q.transpose(1, 2))  # [B, H, T, M]
                    fk = llops_feature_fn(th)(k.transpose(1, 2))
                    out = chunk_linear_attn(fq.transpose(1, 2), fk.transpose(1, 2), v, normalize=True)
                    return out[0] if isinstance(out, tuple) else out

                methods.append(Method(f"LLoPS m={m} features + fla chunk_linear_attn", fla,
                                      pure, "linear", optional=True))
            except ImportError as err:
                print(f"fla not importable ({err}); skipped", file=sys.stderr)
    return methods


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--d", type=int, default=128, help="head dimension D (= Dv)")
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--m", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--window", type=int, default=64, help="the hybrid's window (0: no hybrid rows)")
    parser.add_argument("--sinks", type=int, default=4, help="the hybrid's attention sinks")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine multi-threaded small ops wait on "
                             "descheduled threads and the timings become noise)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=3.0, help="time spent repeating one measurement")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--quick", action="store_true", help="smoke run: T = 256, 512, m = 64, 128")
    parser.add_argument("--out", default=None, help="markdown output (default analysis/results/attention_<device>.md)")
    args = parser.parse_args(argv)
    if args.quick:
        args.T, args.m, args.max_reps, args.budget_s = [256, 512], [64, 128], 1, 0.2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    dtype = getattr(torch, args.dtype)
    out_md = Path(args.out) if args.out else ROOT / "analysis" / "results" / f"attention_{args.device}.md"
    if not out_md.parent.is_dir():
        parser.error(f"output directory {out_md.parent} does not exist")

    gen = torch.Generator().manual_seed(0)
    D, B, H = args.d, args.batch, args.heads
    peak = matmul_peak(device, dtype, f"{args.threads} thread(s)")
    print(f"matmul peak: {peak:.1f} GFLOP/s ({args.dtype}, {args.threads} thread(s), {device})", flush=True)
    methods = build_methods(args, device, dtype, D, gen)
    mem = Memory(device)
    # warm-up: every method once, forward and backward, at a small T (first-call costs: imports,
    # allocator growth, kernel selection) so that a single timed call at large T is meaningful
    small = [torch.randn(B, 128, H, D, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
             for _ in range(3)]
    kept = []
    for meth in methods:
        try:
            meth.fn(*small).sum().backward()
        except Exception as err:  # noqa: BLE001 - only optional (third-party / device) paths are dropped
            if not meth.optional:
                raise
            print(f"{meth.name}: warm-up failed ({type(err).__name__}: {err}); left out of this run", file=sys.stderr)
            continue
        kept.append(meth)
    methods = kept
    rows = []  # (method, T, fwd_s, bwd_s, fwd_mem, bwd_mem, flops)
    t_start = time.perf_counter()
    for T in args.T:
        q = (torch.randn(B, T, H, D, generator=gen)).to(device=device, dtype=dtype).requires_grad_(True)
        k = (torch.randn(B, T, H, D, generator=gen)).to(device=device, dtype=dtype).requires_grad_(True)
        v = (torch.randn(B, T, H, D, generator=gen)).to(device=device, dtype=dtype).requires_grad_(True)
        times = {}  # name -> (fwd, fwd+bwd): a paired method is timed in turns with its partner
        for meth in methods:
            if meth.paired is not None and meth.paired in times:
                continue
            group = [meth] + [m2 for m2 in methods if m2.paired == meth.name]
            calls = [lambda m2=m2: m2.fn(q, k, v) for m2 in group]
            fwds = time_calls(calls, device, backward=False, budget_s=args.budget_s, max_reps=args.max_reps)
            bwds = [math.nan] * len(group)
            if not args.no_backward:
                bwds = time_calls(calls, device, backward=True, budget_s=args.budget_s, max_reps=args.max_reps)
                for x in (q, k, v):
                    x.grad = None
            times.update({m2.name: (f, b) for m2, f, b in zip(group, fwds, bwds)})
            for m2, f, b in zip(group[1:], fwds[1:], bwds[1:]):
                print(f"T={T:6d} {m2.name}: hybrid/pure measured {f / fwds[0]:.3f} / {b / bwds[0]:.3f}, FLOP ratio "
                      f"hybrid/pure (tile model) {_model_ratio(args, m2.features, T, False):.3f} / "
                      f"{_model_ratio(args, m2.features, T, True):.3f}", flush=True)
        for meth in methods:
            call = lambda meth=meth: meth.fn(q, k, v)  # noqa: E731
            fwd, bwd = times[meth.name]
            mem.start()
            with torch.no_grad():
                call()
            fwd_mem = mem.stop()
            bwd_mem = math.nan
            if not args.no_backward:
                for x in (q, k, v):
                    x.grad = None
                mem.start()
                call().sum().backward()
                bwd_mem = mem.stop()
                for x in (q, k, v):
                    x.grad = None
            flops = meth.flops(B, H, T, D, D)
            rows.append((meth.name, T, fwd, bwd, fwd_mem, bwd_mem, flops))
            print(f"T={T:6d} {meth.name:45s} fwd {fwd:8.4f}s  fwd+bwd {bwd:8.4f}s  "
                  f"mem {fwd_mem / 2**20:8.1f} / {bwd_mem / 2**20:8.1f} MiB  {flops / fwd / 1e9:7.2f} GFLOP/s",
                  flush=True)
    wall = time.perf_counter() - t_start
    text = report(args, rows, peak, wall, device)
    with atomic_write(out_md) as tmp:
        tmp.write_text(text, encoding="utf-8")
    plot(rows, out_md.with_suffix(".png"), args)
    print(text)
    print(f"wrote {out_md} and {out_md.with_suffix('.png')}")
    return 0


def _fmt_mib(x):
    return "n/a" if math.isnan(x) else f"{x / 2**20:.1f}"


def report(args, rows, peak, wall, device) -> str:
    sdpa = {T: (f, b) for name, T, f, b, *_ in rows if name.startswith("softmax")}
    lines = [
        f"# Attention time vs sequence length ({device.type.upper()}) — the LLoPS paper's Figure 2",
        "",
        "Command: `" + " ".join([".venv/bin/python", "analysis/bench_attention.py", *sys.argv[1:]]) + "`",
        "",
        f"B = {args.batch}, H = {args.heads}, D = Dv = {args.d}, p = {args.p}, {args.dtype}, chunk C = "
        f"{args.chunk_size}, causal, {args.threads} torch thread(s); torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}; best of up to {args.max_reps} runs "
        f"(one run when a call takes over {SINGLE_RUN_S:g} s; repeats stop after {args.budget_s:g} s per method; "
        f"each hybrid timed in turns with its pure path, one call of each per round, so that their ratio sees the "
        f"same load), timed in "
        f"{'CPU time of the process (1 thread: the work done; the machine is shared)' if device.type == 'cpu' else 'wall time'}"
        f"; wall time of the whole run {wall:.0f} s.",
        f"Matmul peak measured in this run (2048³ {args.dtype}): **{peak:.1f} GFLOP/s**.",
        "Linear methods use normalize=\"sum\" on non-negative maps (LLoPS Θ with equal factors, features "
        "(θ·x)²; BASED's 1 + s + s²/2 > 0); exact polynomial attention scales q, k by D^-1/4.",
        "Memory: peak above the resident set before the call (inputs excluded); see the script's docstring.",
        "",
        "| method | T | fwd (s) | fwd / SDPA | fwd+bwd (s) | fwd+bwd / SDPA | fwd GFLOP/s | fwd % of peak "
        "| fwd peak MiB | fwd+bwd peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, T, f, b, fm, bm, flops in rows:
        sf, sb = sdpa.get(T, (math.nan, math.nan))
        gf = flops / f / 1e9
        lines.append(f"| {name} | {T} | {f:.4f} | {f / sf:.3f} | {b:.4f} | {b / sb:.3f} | {gf:.2f} | "
                     f"{100 * gf / peak:.1f} | {_fmt_mib(fm)} | {_fmt_mib(bm)} |")
    lines += ["", "## Checks (largest T)", ""]
    T_max, T_min = max(args.T), min(args.T)
    by = {(name, T): (f, b, fm, bm) for name, T, f, b, fm, bm, _ in rows}
    llops128 = next((n for n, T, *_ in rows if n.startswith("LLoPS m=128 (chunked")), None)
    based = next((n for n, T, *_ in rows if n.startswith("BASED")), None)
    if llops128 and based and ("softmax (SDPA)", T_max) in by:
        f_l, f_b, f_s = by[(llops128, T_max)][0], by[(based, T_max)][0], by[("softmax (SDPA)", T_max)][0]
        lines.append(f"- LLoPS m=128 chunked forward at T={T_max}: {f_l:.4f} s = **{f_l / f_s:.3f}× SDPA** "
                     f"(target ≤ 0.2×: {'met' if f_l / f_s <= 0.2 else 'NOT met'}), **{f_l / f_b:.3f}× BASED** "
                     f"(target ≤ 1: {'met' if f_l <= f_b else 'NOT met'}).")
    for m in args.m:
        pure = f"LLoPS m={m} (chunked torch)"
        hyb = next((n for n, *_ in rows if n.startswith(f"LLoPS m={m} hybrid")), None)
        if hyb is None:
            continue
        ratios = [(T, by[(hyb, T)][0] / by[(pure, T)][0], by[(hyb, T)][1] / by[(pure, T)][1])
                  for T in args.T if (hyb, T) in by and (pure, T) in by]
        text = ", ".join(f"T={T}: {f:.2f}× / {b:.2f}× (tile model {_model_ratio(args, m, T, False):.2f}× / "
                         f"{_model_ratio(args, m, T, True):.2f}×)" for T, f, b in ratios)
        worst = max(max(f, b) for _, f, b in ratios)
        lines.append(f"- {hyb} over pure LLoPS m={m}, forward / fwd+bwd, measured (FLOP ratio hybrid/pure of the "
                     f"tile model, the floor of a tile-based implementation): {text} "
                     f"(target ≤ 1.3×: {'met' if worst <= 1.3 else 'NOT met'} at every T).")
    if llops128 and ("softmax (SDPA)", T_max) in by and not args.no_backward:
        b_l, b_s = by[(llops128, T_max)][1], by[("softmax (SDPA)", T_max)][1]
        lines.append(f"- LLoPS m=128 chunked forward+backward at T={T_max}: **{b_l / b_s:.3f}× SDPA** "
                     f"(stretch target ≤ 0.10×: {'met' if b_l / b_s <= 0.10 else 'NOT met'}).")
    for name in dict.fromkeys(n for n, *_ in rows):
        if (name, T_min) in by and (name, T_max) in by:
            fm0, fm1 = by[(name, T_min)][2], by[(name, T_max)][2]
            bm0, bm1 = by[(name, T_min)][3], by[(name, T_max)][3]
            if not math.isnan(fm1):
                growth = max(fm1 / T_max / (fm0 / T_min), bm1 / T_max / (bm0 / T_min))
                verdict = "linear in T" if growth <= 1.5 else f"grows {growth:.1f}× faster than T"
                lines.append(f"- {name}: peak memory per token {fm0 / T_min / 1024:.1f} → {fm1 / T_max / 1024:.1f} KiB "
                             f"(forward), {bm0 / T_min / 1024:.1f} → {bm1 / T_max / 1024:.1f} KiB (fwd+bwd) from "
                             f"T={T_min} to T={T_max}: {verdict}.")
    if args.window:
        lines += ["", "## FLOP model of the hybrid against pure (multiply-adds per query chunk of one head)", "",
                  "Tile model (`tile_macs` in the script): every GEMM of the chunked cores at its full tile size "
                  "(masked tiles count whole), features included, backward as the hand-written cores run it; the "
                  "ratio is the floor a tile-based implementation can reach when the hybrid's GEMMs run as fast as "
                  "the pure path's and its elementwise work (masks, exp) is free.", "",
                  "| m | T | pure fwd MMAC | hybrid fwd MMAC | FLOP ratio hybrid/pure fwd | fwd+bwd | "
                  "exp per chunk | measured fwd | measured fwd+bwd |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in args.m:
            pure = f"LLoPS m={m} (chunked torch)"
            hyb = next((n for n, *_ in rows if n.startswith(f"LLoPS m={m} hybrid")), None)
            for T in args.T:
                a, b = _models(args, m, T)
                meas = ((f"{by[(hyb, T)][0] / by[(pure, T)][0]:.2f}", f"{by[(hyb, T)][1] / by[(pure, T)][1]:.2f}")
                        if hyb and (hyb, T) in by and (pure, T) in by else ("n/a", "n/a"))
                lines.append(f"| {m} | {T} | {a['fwd'] / 1e6:.2f} | {b['fwd'] / 1e6:.2f} | "
                             f"{_model_ratio(args, m, T, False):.3f} | {_model_ratio(args, m, T, True):.3f} | "
                             f"{b['exp']} | {meas[0]} | {meas[1]} |")
    lines.append("")
    return "\n".join(lines)


def _models(args, m: int, T: int):
    """The tile model of pure LLoPS and of the hybrid at this run's shapes (:func:`tile_macs`)."""
    shape = dict(C=args.chunk_size, D=args.d, Dv=args.d, M=m, p=args.p)
    return tile_macs(T, **shape), tile_macs(T, **shape, window=args.window, sinks=args.sinks)


def _model_ratio(args, m: int, T: int, backward: bool) -> float:
    """FLOP ratio hybrid/pure of the tile model, forward or forward+backward."""
    a, b = _models(args, m, T)
    if backward:
        return (b["fwd"] + b["bwd"]) / (a["fwd"] + a["bwd"])
    return b["fwd"] / a["fwd"]


def plot(rows, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(dict.fromkeys(n for n, *_ in rows))
    for ax, idx, title in ((axes[0], 2, "forward"), (axes[1], 3, "forward + backward")):
        for name in names:
            pts = [(T, r[idx]) for r in rows if r[0] == name for T in [r[1]] if not math.isnan(r[idx])]
            if pts:
                ax.loglog(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("seconds")
        ax.set_title(f"{title} (D={args.d}, p={args.p}, H={args.heads})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)  # atomic; closes the figure


if __name__ == "__main__":
    raise SystemExit(main())
