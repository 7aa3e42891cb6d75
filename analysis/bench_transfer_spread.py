"""Stage 1 (attention transfer) on one process against ``processes=2``, side by side, on a small random Llama.

The teacher (a random ``LlamaConfig`` model with GQA, float32) is recorded once; then, alternating,
``attention_transfer(..., processes=1)`` and ``processes=2`` train copies of the same converted layers
(Hedgehog hybrid, window 64 + 4 sinks) with one thread per process, and a ``processes=2`` call with
``steps=0`` times the fixed cost of the spread (spawning the worker, its imports, the gloo group, the
recording moved to shared memory, the broadcasts). Wall-clock seconds, medians over ``--repeats``; the
two results are checked to be bitwise equal. Writes ``analysis/results/transfer_spread.md``.

    nice -n 19 .venv/bin/python analysis/bench_transfer_spread.py            # ~4 min of CPU
    nice -n 19 .venv/bin/python analysis/bench_transfer_spread.py --quick    # smoke run

The ratio needs two free cores: on a shared, busy machine the second process competes for them, and
the figure says more about the load than about the spread.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sketchlab.io import atomic_write  # noqa: E402


def setup(args):
    import transformers

    from sketchlab.convert import convert_attention
    from sketchlab.convert.linearize import teacher_attention

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                                   intermediate_size=2 * args.hidden, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 1000, (args.sequences, args.seq_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    layers = teacher_attention(model, ids, mask, batch_size=2)
    sketches = convert_attention(model, attention="hedgehog", m=args.m, window=64, sinks=4)
    return sketches, layers, mask


def cpu(who) -> float:
    use = resource.getrusage(who)
    return use.ru_utime + use.ru_stime


def timed(sketches, layers, mask, train_idx, args, processes, steps):
    """``({"wall", "cpu here", "cpu workers"}, trained sketches, curves)``: wall-clock seconds of the call,
    CPU seconds of this process and of its (joined) workers during it."""
    from sketchlab.convert.linearize import attention_transfer

    mine = copy.deepcopy(sketches)
    c_self, c_children, t = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    curves = attention_transfer(mine, layers, mask, train_idx, steps=steps, batch_size=args.batch_size,
                                processes=processes)
    took = {"wall": time.perf_counter() - t, "cpu here": cpu(resource.RUSAGE_SELF) - c_self,
            "cpu workers": cpu(resource.RUSAGE_CHILDREN) - c_children}
    return took, mine, curves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8, help="query heads (KV heads: half)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sequences", type=int, default=8, help="recorded sequences (all but 2 trained on)")
    ap.add_argument("--m", type=int, default=32, help="Hedgehog features")
    ap.add_argument("--steps", type=int, default=200, help="transfer steps per layer")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 layers, 5 steps, 1 repeat")
    ap.add_argument("--out", default=str(ROOT / "analysis" / "results" / "transfer_spread.md"))
    args = ap.parse_args()
    if args.quick:
        args.layers, args.steps, args.repeats = 4, 5, 1
    torch.set_num_threads(1)
    t = time.perf_counter()
    sketches, layers, mask = setup(args)
    record = time.perf_counter() - t
    nbytes = sum(t.numel() * t.element_size() for io in layers for t in (io.q, io.k, io.v, io.out))
    train_idx = torch.arange(args.sequences - 2)
    names = ("1 process", "2 processes", "2 processes, 0 steps (fixed cost)")
    runs = {name: [] for name in names}
    equal = True
    for r in range(args.repeats):
        t1, one, c1 = timed(sketches, layers, mask, train_idx, args, 1, args.steps)
        t2, two, c2 = timed(sketches, layers, mask, train_idx, args, 2, args.steps)
        t0, _, _ = timed(sketches, layers, mask, train_idx, args, 2, 0)
        for name, took in zip(names, (t1, t2, t0)):
            runs[name].append(took)
        equal &= c1 == c2 and all(torch.equal(a, b) for x, y in zip(one, two)
                                  for a, b in zip(x.parameters(), y.parameters()))
        print(f"repeat {r}: " + "; ".join(f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in took.items())
                                         for name, took in zip(names, (t1, t2, t0))), flush=True)
    med = {name: {k: statistics.median(t[k] for t in runs[name]) for k in runs[name][0]} for name in names}
    for m in med.values():  # each process on a core of its own: the longer of the two CPU times (the worker
        # trains alongside this process, from its start: tests/test_linearize_spread.py checks the overlap)
        m["own cores"] = max(m["cpu here"], m["cpu workers"])
    base = med["1 process"]
    try:
        load = os.getloadavg()
        load_text = f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end"
    except OSError:
        load_text = "load average unavailable"
    lines = [
        "# Attention transfer spread over processes", "",
        f"`{' '.join(['analysis/bench_transfer_spread.py', *sys.argv[1:]])}` on {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, one thread per process; {load_text}.", "",
        f"Random Llama: {args.layers} layers, hidden {args.hidden}, {args.heads} query / {args.heads // 2} KV "
        f"heads, float32; {args.sequences} recorded sequences of {args.seq_len} tokens "
        f"({nbytes / 2**20:.1f} MiB of teacher q, k, v and outputs, recorded in {record:.1f} s), "
        f"{args.sequences - 2} trained on; Hedgehog hybrid (m = {args.m}, window 64 + 4 sinks); {args.steps} "
        f"Adam steps per layer, batch {args.batch_size}. Seconds of the `attention_transfer` call, medians of "
        f"{args.repeats} alternating runs: wall clock; CPU of this process and of the spawned worker (its start-up "
        "included: imports of torch, sketchlab, torch.optim); and *own cores*, the larger of the two CPU times, "
        "what the wall clock would be with each process on a core of its own (the two processes train at the "
        "same time, the worker from its start-up on, as `tests/test_linearize_spread.py` checks; before that fix "
        "the worker trained only after this process's share, and the wall clock was the sum).", "",
        "| run | wall | CPU here | CPU worker | own cores | wall vs 1 process | own cores vs 1 process |",
        "|---|---|---|---|---|---|---|",
        *(f"| {name} | {m['wall']:.2f} | {m['cpu here']:.2f} | {m['cpu workers']:.2f} | {m['own cores']:.2f} | "
          f"{m['wall'] / base['wall']:.2f}× | {m['own cores'] / base['own cores']:.2f}× |"
          for name, m in med.items()),
        "",
        f"The two runs' trained parameters and loss curves are bitwise equal: {'yes' if equal else 'NO'}.", "",
        f"Speed-up of the spread: {base['wall'] / med['2 processes']['wall']:.2f}× in wall clock here, "
        f"{base['own cores'] / med['2 processes']['own cores']:.2f}× with a core per process (ideal 2× less the "
        "worker's start-up, which a larger model amortises: on SmolLM2's 30 layers one layer's transfer takes tens "
        "of seconds to minutes). This machine's two cores are shared with other jobs (the load average above), so "
        "the second process rarely has a core of its own and the wall-clock ratio says more about the load than "
        "about the spread; the CPU columns do not depend on it, except through cache and memory-bandwidth "
        "contention.", "",
        f"The worker's start-up is c = {med['2 processes, 0 steps (fixed cost)']['cpu workers']:.1f} CPU seconds "
        "(the 0-step row). With T the single-process CPU time of the stage, two processes on cores of their own take "
        "about T/2 + c (the worker's share plus its start-up, the longer of the two): the spread pays once T > 2c "
        f"(≈ {2 * med['2 processes, 0 steps (fixed cost)']['cpu workers']:.0f} s) and approaches 2× as T grows "
        f"(T = 100 s: {100 / (50 + med['2 processes, 0 steps (fixed cost)']['cpu workers']):.2f}×; "
        "SmolLM2's stage 1 takes hours here).", ""]
    text = "\n".join(lines)
    with atomic_write(args.out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
