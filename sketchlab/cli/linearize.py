"""``sketchlab linearize``: swap a model's attention for sketched attention and train it in stages.

Two paths:

* a pretrained transformers model (``--model-dir DIR`` or ``--gguf FILE``) on a text file
  (``--text FILE``): :func:`sketchlab.linearize` — stage 0 (LLoPS Θ from the kernel fit on the
  model's own post-RoPE q/k), stage 1 (attention transfer, ``--transfer-steps``), stage 2 (LoRA,
  ``--lora-steps``); the converted model is saved under ``--out/model`` (reload it with
  :func:`sketchlab.load_linearized`), the report as ``--out/linearize.json`` and ``linearize.md``;
* sketchlab's toy MQAR checkpoint (positional ``CHECKPOINT``): :func:`sketchlab.tasks.linearize`
  (capture → fit → export Θ → fine-tune), as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from ._common import UsageError, positive_int, write_text_atomic


def _nonnegative_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def add_arguments(sub) -> None:
    cmd = sub.add_parser("linearize", help="swap a model's attention for sketched attention, train it in stages")
    cmd.add_argument("checkpoint", nargs="?",
                     help="toy path: softmax TransformerLM directory (model.safetensors + config.json with its MQAR task)")
    cmd.add_argument("--model-dir", help="a local transformers model directory (LLaMA/Qwen2/Mistral, GPT-2, BERT families)")
    cmd.add_argument("--gguf", help="a local GGUF file (e.g. SmolLM2), loaded with transformers' gguf_file=")
    cmd.add_argument("--text", help="UTF-8 training text (the last --holdout of it is held out)")
    cmd.add_argument("--attention", default="llops",
                     help="feature map: llops, hedgehog, taylor, psf, exact, ... (default llops)")
    cmd.add_argument("--window", type=_nonnegative_int, default=64, help="exact local keys (0: pure linear; default 64)")
    cmd.add_argument("--sinks", type=_nonnegative_int, default=4, help="attention sinks (default 4)")
    cmd.add_argument("--local", choices=("softmax", "poly"), default="softmax", help="the exact part inside the window")
    cmd.add_argument("--gate-init", type=float, default=0.0,
                     help="initial gate logit: sigmoid of it weighs the window, the rest the sketch (default 0: 1/2)")
    cmd.add_argument("--p", type=positive_int, default=2, help="degree of the attention kernel (default 2)")
    cmd.add_argument("--m", type=positive_int, default=64, help="features (default 64)")
    cmd.add_argument("--out", required=True, help="output directory (created; its parent must exist)")
    cmd.add_argument("--rank", type=positive_int, default=1, help="CP rank t of Θ (default 1)")
    cmd.add_argument("--seq-len", type=positive_int, default=512, help="tokens per training sequence (default 512)")
    cmd.add_argument("--max-tokens", type=positive_int, default=None, help="tokens of --text used in all (default all)")
    cmd.add_argument("--holdout", type=float, default=0.25, help="fraction of captured tokens/sequences held out (default 0.25)")
    cmd.add_argument("--transfer-steps", type=_nonnegative_int, default=100, help="attention-transfer steps per layer")
    cmd.add_argument("--transfer-lr", type=_positive_float, default=1e-2)
    cmd.add_argument("--lora-steps", type=_nonnegative_int, default=0, help="LoRA steps (0: no LoRA stage)")
    cmd.add_argument("--lora-rank", type=positive_int, default=8)
    cmd.add_argument("--lora-lr", type=_positive_float, default=1e-4)
    cmd.add_argument("--no-fit", action="store_true", help="skip stage 0 (start the maps from their initialisation)")
    # toy path
    cmd.add_argument("--non-negative", action="store_true",
                     help="toy path: self-tensored map φ⊗φ: Θ of degree p/2 (even p), non-negative kernel")
    cmd.add_argument("--normalize", choices=("sum", "none"), default=None, help="attention normalisation")
    cmd.add_argument("--capture-sequences", type=int, default=4, help="toy path: task sequences captured for the fit")
    cmd.add_argument("--steps", type=int, default=100, help="toy path: fine-tuning steps (0: step 0 only)")
    cmd.add_argument("--batch-size", type=int, default=None, help="sequences per step (toy default 32, real 4)")
    cmd.add_argument("--lr", type=float, default=1e-3, help="toy path: fine-tuning learning rate")
    cmd.add_argument("--warmup", type=int, default=10)
    cmd.add_argument("--transfer", type=float, default=0.0,
                     help="toy path: weight of the attention-transfer loss against softmax attention (0 = off)")
    cmd.add_argument("--eval-sequences", type=int, default=512)
    cmd.add_argument("--eval-every", type=int, default=0, help="toy path: held-out evaluation every N steps")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    cmd.add_argument("--no-progress", action="store_true", help="no progress output")


def run(args) -> int:
    import torch

    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    sources = [name for name, value in (("CHECKPOINT", args.checkpoint), ("--model-dir", args.model_dir),
                                        ("--gguf", args.gguf)) if value is not None]
    if len(sources) != 1:
        raise UsageError(f"give exactly one of CHECKPOINT (toy model), --model-dir or --gguf, got {sources or 'none'}")
    torch.set_num_threads(args.threads)
    if args.checkpoint is not None:
        return _run_toy(args)
    return _run_pretrained(args)


def _run_toy(args) -> int:
    from ..tasks import linearize

    res = linearize(
        args.checkpoint, p=args.p, m=args.m, out=args.out, rank=args.rank, non_negative=args.non_negative,
        normalize=args.normalize or "sum", capture_sequences=args.capture_sequences, holdout=args.holdout,
        steps=args.steps, batch_size=args.batch_size or 32, lr=args.lr, warmup=args.warmup, transfer=args.transfer,
        eval_sequences=args.eval_sequences, eval_every=args.eval_every, seed=args.seed,
        progress=not args.no_progress,
    )
    print(f"{args.out}: softmax teacher {res.teacher_accuracy:.4f}, LLoPS step 0 {res.step0_accuracy:.4f}, "
          f"after {res.steps} steps {res.final_accuracy:.4f} (exact degree-{args.p} polynomial attention at step 0: "
          f"{res.poly_accuracy:.4f}); summary in {args.out}/linearize.md")
    return 0


def _run_pretrained(args) -> int:
    from ..convert.linearize import linearize
    from ..convert.convert import save_linearized
    from ..convert.pretrained import load_pretrained

    if args.text is None:
        raise UsageError("--text is required with --model-dir / --gguf")
    text_path = Path(args.text)
    if not text_path.is_file():
        raise UsageError(f"--text {args.text}: no such file")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out}: its parent directory does not exist")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory")
    source = Path(args.gguf) if args.gguf else Path(args.model_dir)
    if not (0 < args.holdout < 1):
        raise UsageError(f"--holdout must lie in (0, 1), got {args.holdout}")
    text = text_path.read_text(encoding="utf-8")
    model, tokenizer = load_pretrained(args.model_dir, gguf=args.gguf)
    model, report = linearize(
        model, text, tokenizer=tokenizer, attention=args.attention, p=args.p, m=args.m, rank=args.rank,
        window=args.window, sinks=args.sinks, local=args.local, normalize=args.normalize, gate_init=args.gate_init,
        seq_len=args.seq_len,
        max_tokens=args.max_tokens, holdout=float(args.holdout), fit=not args.no_fit,
        transfer_steps=args.transfer_steps, transfer_lr=args.transfer_lr, lora_steps=args.lora_steps,
        lora_rank=args.lora_rank, lora_lr=args.lora_lr, batch_size=args.batch_size or 4, seed=args.seed,
        progress=not args.no_progress)
    out.mkdir(exist_ok=True)
    save_linearized(model, out / "model")
    tokenizer.save_pretrained(out / "model")
    summary = report.as_dict()
    summary["source"] = str(source)
    write_text_atomic(str(out / "linearize.json"), json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n")
    write_text_atomic(str(out / "linearize.md"), _markdown(summary))
    metric = "perplexity" if summary["settings"]["family"] != "bert" else "embedding cosine"
    last = summary["stages"][-1]
    print(f"{out}: held-out {metric}: teacher {summary['teacher_metric']:.4g}, "
          + ", ".join(f"{s['name']} {s['metric']:.4g}" for s in summary["stages"])
          + f"; converted model in {out / 'model'} (sketchlab.load_linearized); stage {last['name']} done")
    return 0


def _markdown(summary: dict) -> str:
    s = summary["settings"]
    metric = "perplexity" if s["family"] != "bert" else "mean sentence-embedding cosine to the teacher"
    lines = [f"# Linearised {summary['source']}", "",
             f"{s['family']} family; attention {s['attention']} p={s['p']} m={s['m']} rank {s['rank']}, window "
             f"{s['window']} + {s['sinks']} sinks ({s['local']}); {s['sequences']} sequences of {s['seq_len']} tokens, "
             f"{s['held_out']} held out.", "",
             f"| stage | held-out {metric} | mean attention-output error | seconds |", "|---|---|---|---|",
             f"| teacher | {summary['teacher_metric']:.4g} | 0 | – |"]
    for st in summary["stages"]:
        err = st["layer_error"]
        mean = "–" if not err else f"{sum(err) / len(err):.4f}"
        lines.append(f"| {st['name']} | {st['metric']:.4g} | {mean} | {st['seconds']:.1f} |")
    return "\n".join(lines) + "\n"
