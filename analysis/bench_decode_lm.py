"""Whole-model decoding on the CPU: SmolLM2-135M-Instruct against itself converted, greedy ``generate()``.

Models (each in a fresh process, so its resident memory is its own):

* ``teacher`` — the model as loaded (transformers' SDPA attention, its ``DynamicCache``);
* ``converted`` — ``convert_attention(attention=--map, m=--m, window=64, sinks=4, cache=188,
  decay="input")``: window + sinks + the sparse exact cache + the input-decayed far state, decoding
  through the lean steps (``SketchStateCache`` → ``LayerDecoder`` → ``RecurrentStep``);
* ``converted+exact`` — the same with layers ``--exact`` (18, 20) kept exact (``KVDecoder``).

The converted models are untrained (maps and gates at their initial values): this measures speed and
memory, not quality (quality: ``analysis/results/memory_lm.md``; the tokens of the lean path equal the
full-forward reference's on tiny random models: ``tests/test_convert_decode.py``). Prompts: ``L``
random token ids (seeded); ``--new`` tokens generated greedily (``min_new_tokens`` = ``max_new_tokens``).

Reported per model and prompt length: decode tokens/s (the ``new − 1`` tokens after the first, timed by
a logits processor called once per generated token), the prefill's seconds, the decoding state's bytes
(the teacher's KV cache; ``SketchStateCache.state_bytes()``) and the process's resident memory after
``generate()`` and at its peak (``VmRSS``, ``ru_maxrss``); the ratio to the teacher's tokens/s.
Writes ``analysis/results/decode_lm.md``.

    .venv/bin/python analysis/bench_decode_lm.py                      # L = 1k, 4k, 16k
    .venv/bin/python analysis/bench_decode_lm.py --lengths 256 --new 8 --out /tmp/x.md   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sketchlab.io import atomic_write  # noqa: E402

MODELS = ("teacher", "converted", "converted+exact")


def rss_bytes() -> int:
    """The process's resident memory now (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one(args) -> dict:
    """Load, convert, generate once: the measurements of one model at one prompt length."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from sketchlab.attention.ops import fused_recurrent
    from sketchlab.convert import convert_attention
    from sketchlab.hf.pretrained import load_pretrained, smollm2_gguf

    torch.set_num_threads(args.threads)
    compiled = fused_recurrent.available()  # built (or loaded) before any timing
    model, _ = load_pretrained(gguf=smollm2_gguf())
    model.eval()
    if args.model != "teacher":
        exact = [int(x) for x in args.exact.split(",")] if args.model == "converted+exact" else []
        convert_attention(model, attention=args.map, m=args.m, window=64, sinks=4, cache=188, decay="input",
                          exact_layers=exact)
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    stamps = []

    cpu_stamps = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.process_time())
            return scores

    t0, c0 = time.perf_counter(), time.process_time()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                         do_sample=False, logits_processor=LogitsProcessorList([Clock()]),
                         return_dict_in_generate=True, pad_token_id=0)
    cpu = time.process_time() - c0
    cache = out.past_key_values
    if hasattr(cache, "state_bytes"):
        state = cache.state_bytes()
    else:
        state = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))
    n = len(stamps)
    return {"model": args.model, "length": args.length, "new": n, "prefill_s": stamps[0] - t0,
            "tok_s": (n - 1) / (stamps[-1] - stamps[0]), "tok_s_cpu": (n - 1) / (cpu_stamps[-1] - cpu_stamps[0]),
            "cpu_s": cpu, "state": state, "rss": rss_bytes(),
            "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "compiled": compiled,
            "tokens": out.sequences[0, args.length:].tolist()}


def render(rows, args, cmd, load) -> str:
    """The results file's text for the rows so far."""
    teacher = {r["length"]: r["tok_s"] for r in rows if r["model"] == "teacher"}
    teacher_cpu = {r["length"]: r["tok_s_cpu"] for r in rows if r["model"] == "teacher"}
    import torch

    lines = ["# Whole-model decoding: SmolLM2-135M-Instruct, teacher against converted (CPU)", "",
             f"Command: `{cmd}`", "",
             f"Greedy `generate()` of {args.new} new tokens after a prompt of L random token ids, batch 1, "
             f"{args.threads} torch thread(s), float32; torch {torch.__version__}, "
             f"{platform.processor() or platform.machine()}; each model and length in a fresh process. Converted: "
             f"`convert_attention(attention={args.map!r}, m={args.m}, window=64, sinks=4, cache=188, decay='input')` "
             f"(untrained: speed and memory only), `+exact`: layers {args.exact} kept exact. Decode tokens/s: the "
             f"{args.new - 1} tokens after the first, timed by a logits processor (once per token), by the wall clock "
             "and by the process's CPU time (a shared machine: the CPU time is the steadier measure). The decoding "
             f"step compiled (attention/ops/fused_recurrent.py): {all(r['compiled'] for r in rows)}. Machine load "
             f"before: {'/'.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} CPUs (a shared machine).", "",
             "| model | prompt L | decode tokens/s | × teacher | by CPU time | × teacher by CPU time | prefill s | "
             "decoding state MiB | RSS after MiB | peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['length']} | {r['tok_s']:.2f} | {r['tok_s'] / teacher[r['length']]:.2f} | "
                     f"{r['tok_s_cpu']:.2f} | {r['tok_s_cpu'] / teacher_cpu[r['length']]:.2f} | {r['prefill_s']:.1f} | "
                     f"{r['state'] / 2**20:.2f} | {r['rss'] / 2**20:.0f} | "
                     f"{r['peak'] / 2**20:.0f} |")
    lines += ["", "## Checks", ""]
    for model in args.models.split(","):
        if model == "teacher":
            continue
        ratios = {r["length"]: r["tok_s"] / teacher[r["length"]] for r in rows if r["model"] == model}
        by_cpu = {r["length"]: r["tok_s_cpu"] / teacher_cpu[r["length"]] for r in rows if r["model"] == model}
        ok = "yes" if all(x > 1 for x in ratios.values()) else "NO"
        ok_cpu = "yes" if all(x > 1 for x in by_cpu.values()) else "NO"
        lines.append(f"- {model}: faster than the teacher at every prompt length measured: **{ok}** by the wall clock, "
                     f"**{ok_cpu}** by CPU time "
                     f"({', '.join(f'L={L}: {x:.2f}×' for L, x in ratios.items())}; by CPU time "
                     f"{', '.join(f'L={L}: {x:.2f}×' for L, x in by_cpu.items())}).")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--map", default="hedgehog")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--exact", default="18,20")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=str(ROOT / "analysis" / "results" / "decode_lm.md"))
    ap.add_argument("--model", help=argparse.SUPPRESS)  # internal: one run in this process
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return 0
    cmd = "python analysis/bench_decode_lm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load = os.getloadavg()
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        for model in args.models.split(","):
            run = subprocess.run([sys.executable, __file__, "--model", model, "--length", str(L), "--new", str(args.new),
                                  "--threads", str(args.threads), "--map", args.map, "--m", str(args.m),
                                  "--exact", args.exact], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{model} at L={L} failed:\n{run.stderr[-3000:]}")
            rows.append(json.loads(line[7:]))
            r = rows[-1]
            with atomic_write(Path(args.out)) as tmp:  # after every row: a long run keeps what it measured
                tmp.write_text(render(rows, args, cmd, load), encoding="utf-8")
            print(f"L={L:6d} {model:16s} {r['tok_s']:7.2f} tok/s  prefill {r['prefill_s']:7.1f} s  state "
                  f"{r['state'] / 2**20:8.2f} MiB  RSS {r['rss'] / 2**20:7.0f} MiB (peak {r['peak'] / 2**20:7.0f})",
                  flush=True)
    print(render(rows, args, cmd, load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
