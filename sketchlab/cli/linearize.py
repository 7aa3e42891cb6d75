"""``sketchlab linearize``: swap a model's attention for sketched attention and train it in stages.

Two paths, each reading its own options (:data:`TOY`, :data:`PRETRAINED`; the other path's are refused):

* a pretrained transformers model (``--model-dir DIR`` or ``--gguf FILE``) on ``--text FILE``:
  :func:`sketchlab.linearize` (stage 0 the Θ fit, ``--fit-work``; stage 1 attention transfer,
  ``--transfer-steps``, ``--processes N``; stage 2 LoRA, ``--lora-steps``), the converted model saved
  under ``--out/model`` (:func:`sketchlab.load_linearized`), the report as ``--out/linearize.json`` and
  ``linearize.md`` (each stage beside window + sinks alone; ``--no-far`` keeps that model); a run over
  ``--max-memory`` (default: the available memory) is refused; the conversion's options are checked by
  its rules, a bad value refused naming its flag;
* sketchlab's toy MQAR checkpoint (positional ``CHECKPOINT``): :func:`sketchlab.linearize` given its path
  (:func:`sketchlab.convert.mqar.linearize_checkpoint`: capture → fit → export Θ → fine-tune), its memory
  within half of this machine's and its fit within :data:`FIT_WORK_BUDGET` multiply-adds.

Refused before any work (exit 2, one line): an ``--out`` that is or holds an input (any spelling or
link), files no ``linearize`` run writes, an unfinished run whose settings are not recorded, or another
run's output (the same settings rerun; the toy path resumes its fine-tuning). The run's files appear in
``--out`` together at the end (:func:`sketchlab.io.staged_directory`), each reported as ``wrote PATH``; a
run that fails leaves ``--out`` as it was (missing parents removed again), except the toy path's
fine-tuning checkpoints ``--out/finetune``, kept so that the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ._common import (
    Outputs,
    UsageError,
    add_common,
    available_memory,
    check_run_dir,
    decay_arg,
    finite_float,
    int_list,
    nonnegative_float,
    nonnegative_int,
    number_arg,
    positive_float,
    positive_int,
    write_text_atomic,
)

#: ``--fit-work``: a number > 0, ``inf`` allowed (no cap).
_fit_work = number_arg(float, lambda v: v > 0, "a number > 0 (multiply-adds per head; inf: no cap)")

#: What a ``sketchlab linearize`` output directory holds, per path (anything else belongs to something else).
TOY_FILES = ("capture.safetensors", "theta.safetensors", "finetune", "model", "linearize.json", "linearize.md")
PRETRAINED_FILES = ("model", "linearize.json", "linearize.md")

#: Work budget of the toy path's LLoPS fit: estimated multiply-adds over all heads
#: (:func:`sketchlab.llops.target.iteration_flops` per iteration, at most the default preset's
#: iterations and per-head cap). The default fit of the shipped 4-layer, 4-head checkpoint plans
#: about 1.1e11 (one to two minutes on one core); this is some five times that.
FIT_WORK_BUDGET = 5e11


class _Flag(NamedTuple):
    """How one option reaches its path's library call: under ``keyword`` (``""``: its own name; ``None``:
    the command reads it itself), as ``value(the flag's)``, and whether the run's identity holds it (a
    rerun with another value is refused)."""

    keyword: str | None = ""
    value: Callable = lambda given: given
    identity: bool = True


_AS_GIVEN, _NOT = _Flag(), (lambda given: not given)
_PROGRESS = _Flag("progress", _NOT, identity=False)
#: Each path's options, one row each (a new option: its ``add_argument`` and one row here); an option in one
#: table only is refused on the other path. The toy path: :func:`sketchlab.linearize` given the checkpoint's path
#: (:func:`sketchlab.convert.mqar.linearize_checkpoint`).
TOY = {**dict.fromkeys(("p", "m", "rank", "non_negative", "capture_sequences", "holdout", "steps", "lr", "warmup",
                        "transfer", "eval_sequences", "seed"), _AS_GIVEN),
       "normalize": _Flag(value=lambda given: given or "sum"), "batch_size": _Flag(value=lambda given: given or 32),
       "eval_every": _Flag(identity=False), "no_progress": _PROGRESS}
#: The --model-dir/--gguf path: :func:`sketchlab.linearize`.
PRETRAINED = {**dict.fromkeys(("attention", "p", "m", "rank", "window", "sinks", "local", "normalize", "gate_init",
                               "seq_len", "max_tokens", "transfer_steps", "transfer_lr", "lora_steps", "lora_rank",
                               "lora_lr", "seed", "cache", "decay", "state", "beta", "exact_layers", "fit_work",
                               "input_norm", "qk_conv"),
                              _AS_GIVEN),
              "text": _Flag(None, identity=False), "untied": _Flag("tied", lambda given: False if given else None),
              "holdout": _Flag(value=float), "processes": _Flag(identity=False), "no_fit": _Flag("fit", _NOT),
              "batch_size": _Flag(value=lambda given: given or 4), "no_far": _Flag("far", _NOT), "no_progress": _PROGRESS,
              "max_memory": _Flag("max_bytes", lambda given: available_memory() if given is None else int(given * 2**30),
                                  identity=False)}
TOY_ONLY = tuple(name for name in TOY if name not in PRETRAINED)
PRETRAINED_ONLY = tuple(name for name in PRETRAINED if name not in TOY)


def _call(table: dict, args) -> dict:
    """The library's keyword arguments from the flags ``args`` of a path's ``table``."""
    return {flag.keyword or name: flag.value(getattr(args, name)) for name, flag in table.items()
            if flag.keyword is not None}


def _identity(table: dict, args, *, as_called: bool) -> dict:
    """A run's identity from the flags ``args`` of a path's ``table``: each identity row's flag as given, or
    (``as_called``: the toy path, whose run records its library settings) as the library receives it."""
    return {flag.keyword or name if as_called else name: flag.value(getattr(args, name)) if as_called
            else getattr(args, name) for name, flag in table.items() if flag.identity}


def _gate_init(text: str):
    """``--gate-init``: ``mass``, ``search`` or a finite number (an argparse type)."""
    if text in ("mass", "search"):
        return text
    try:
        return finite_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'mass', 'search' or a finite number, got {text!r}") from None


def add_arguments(sub) -> None:
    cmd = sub.add_parser("linearize", help="swap a model's attention for sketched attention, train it in stages")
    cmd.add_argument("checkpoint", nargs="?",
                     help="toy path: softmax TransformerLM directory (model.safetensors + config.json with its MQAR task)")
    cmd.add_argument("--model-dir", help="a local transformers model directory (LLaMA/Qwen2/Mistral, GPT-2, BERT families)")
    cmd.add_argument("--gguf", help="a local GGUF file (e.g. SmolLM2), loaded with transformers' gguf_file=")
    cmd.add_argument("--text", help="UTF-8 training text (the last --holdout of it is held out)")
    cmd.add_argument("--attention", default="llops",
                     help="feature map: llops, hedgehog, taylor, psf, exact, ... (default llops)")
    cmd.add_argument("--window", type=nonnegative_int, default=64, help="exact local keys (0: pure linear; default 64)")
    cmd.add_argument("--sinks", type=nonnegative_int, default=None,
                     help="attention sinks, the first tokens kept exact (default 4 with a window, 0 with --window 0; "
                          "more than 0 needs a window)")
    cmd.add_argument("--local", choices=("softmax", "poly"), default="softmax", help="the exact part inside the window")
    cmd.add_argument("--gate-init", type=_gate_init, default=None,
                     help="the hybrid's initial gate logits: a number (sigmoid of it weighs the window, the rest the "
                          "sketch), 'mass' (per head, the far part's share of the denominator matched to the teacher's "
                          "softmax share beyond the window) or 'search' (per head, the least-error logit near it); default: 0 for hedgehog, search for "
                          "the other maps (sketchlab.linearize's gate_init)")
    cmd.add_argument("--untied", action="store_true",
                     help="LLoPS as the untied map (p signed factors) instead of the tied non-negative (x·θ)^p map "
                          "(the tied map needs an even p; an odd p is always untied)")
    cmd.add_argument("--input-norm", action="store_true",
                     help="each map on per-head layer-normalised q, k with a learnable affine (trained with the maps; "
                          "bounds LLoPS's (x·θ)^p as PolySketchFormer's learned sketch does)")
    cmd.add_argument("--cache", type=int, default=0, metavar="K",
                     help="long-context memory: up to K far keys kept exact (a sparse cache; needs a window, a causal "
                          "model; default 0)")
    cmd.add_argument("--decay", type=decay_arg, default=None,
                     help="a decaying far state: 'head' (learned per head), 'input' (from the current value) or a "
                          "fixed decay per step in (0, 1] (default: none)")
    cmd.add_argument("--state", default="additive", help="the far state: 'additive' (default) or 'delta' (delta rule)")
    cmd.add_argument("--beta", default="head",
                     help="the delta rule's write strength: 'head' (learned per head; default) or 'input'")
    cmd.add_argument("--qk-conv", type=int, default=0, metavar="K",
                     help="a causal depthwise convolution of width K on q and k (0: none; 4 in DeltaNet), started as "
                          "the identity and trained with the maps (a causal model)")
    cmd.add_argument("--exact-layers", type=int_list, default=[], metavar="I,J",
                     help="layers (0-based, comma-separated) kept the teacher's softmax attention")
    add_common(cmd, "p", "m")
    cmd.add_argument("--out", required=True,
                     help="output directory (created with its parents; never an input; the same run there is "
                          "resumed, another refused)")
    cmd.add_argument("--rank", type=positive_int, default=1, help="CP rank t of Θ (default 1)")
    cmd.add_argument("--seq-len", type=positive_int, default=512,
                     help="tokens per training sequence (default 512); transfer at the longest context the model "
                          "will run at")
    cmd.add_argument("--max-tokens", type=positive_int, default=None, help="tokens of --text used in all (default all)")
    add_common(cmd, "holdout")
    cmd.add_argument("--transfer-steps", type=nonnegative_int, default=100, help="attention-transfer steps per layer")
    cmd.add_argument("--transfer-lr", type=positive_float, default=1e-2,
                     help="learning rate of the attention-transfer stage (default 1e-2)")
    cmd.add_argument("--processes", type=positive_int, default=1, metavar="N",
                     help="processes of the attention-transfer stage (at most one per layer): this one and N-1 "
                          "spawned workers with --threads threads each, the same result as 1 (default 1)")
    cmd.add_argument("--lora-steps", type=nonnegative_int, default=0, help="LoRA steps (0: no LoRA stage)")
    cmd.add_argument("--lora-rank", type=positive_int, default=8, help="rank of the LoRA adapters (default 8)")
    cmd.add_argument("--lora-lr", type=positive_float, default=1e-4, help="learning rate of the LoRA stage (default 1e-4)")
    cmd.add_argument("--no-fit", action="store_true", help="skip stage 0 (start the maps from their initialisation)")
    cmd.add_argument("--fit-work", type=_fit_work, default=None, metavar="FLOPS",
                     help="the stage-0 Θ fit's effort: at most this many multiply-adds per head (default 3.5e9, "
                          "stage 0 in minutes on SmolLM2; inf: the fit's full schedule, ~27 min there)")
    cmd.add_argument("--no-far", action="store_true",
                     help="the far part off: window + sinks (and --cache) alone, every gate logit at 40 "
                          "(sigmoid = 1), no fit, no transfer; the control a hybrid must beat (LoRA still runs)")
    cmd.add_argument("--max-memory", type=positive_float, default=None, metavar="GIB",
                     help="refuse a run whose estimated memory (printed up front) exceeds this many GiB "
                          "(default: this machine's available memory now)")
    # toy path
    cmd.add_argument("--non-negative", action="store_true",
                     help="toy path: self-tensored map φ⊗φ: Θ of degree p/2 (even p), non-negative kernel")
    cmd.add_argument("--normalize", choices=("sum", "none"), default=None, help="attention normalisation")
    cmd.add_argument("--capture-sequences", type=positive_int, default=4,
                     help="toy path: task sequences captured for the fit")
    cmd.add_argument("--steps", type=nonnegative_int, default=100, help="toy path: fine-tuning steps (0: step 0 only)")
    cmd.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (toy default 32, real 4)")
    cmd.add_argument("--lr", type=positive_float, default=1e-3, help="toy path: fine-tuning learning rate")
    cmd.add_argument("--warmup", type=nonnegative_int, default=10,
                     help="toy path: linear learning-rate warm-up steps of the fine-tuning (default 10)")
    cmd.add_argument("--transfer", type=nonnegative_float, default=0.0,
                     help="toy path: weight of the attention-transfer loss against softmax attention (0 = off)")
    cmd.add_argument("--eval-sequences", type=positive_int, default=512,
                     help="toy path: held-out sequences for every accuracy (default 512)")
    cmd.add_argument("--eval-every", type=nonnegative_int, default=0, help="toy path: held-out evaluation every N steps")
    add_common(cmd, "seed")
    cmd.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    add_common(cmd, "progress")


def run(args) -> int:
    import torch

    sources = [name for name, value in (("CHECKPOINT", args.checkpoint), ("--model-dir", args.model_dir),
                                        ("--gguf", args.gguf)) if value is not None]
    if len(sources) != 1:
        raise UsageError(f"give exactly one of CHECKPOINT (toy model), --model-dir or --gguf, got {sources or 'none'}")
    toy = args.checkpoint is not None
    _refuse_other_path_options(args, PRETRAINED_ONLY if toy else TOY_ONLY, "CHECKPOINT (the toy model)" if toy
                               else sources[0])
    torch.set_num_threads(args.threads)
    if toy:
        return _run_toy(args)
    return _run_pretrained(args)


def _refuse_other_path_options(args, names, source: str) -> None:
    """Refuse (exit 2) the options of ``names`` that differ from their defaults: this path ignores them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser.add_subparsers())
    defaults = vars(parser.parse_args(["linearize", "--out", "-"]))
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) != defaults[name]]
    if given:
        raise UsageError(f"{', '.join(given)}: not read by the path of {source}; drop "
                         f"{'it' if len(given) == 1 else 'them'} (the toy CHECKPOINT path and the --model-dir/--gguf "
                         "path take different options, see --help)")


def _recorded_settings(out: Path) -> dict | None:
    """The settings of the ``linearize`` run in ``out``: its ``linearize.json`` or, for an unfinished toy
    run, its latest fine-tuning checkpoint's; ``None`` when neither is there or readable."""
    try:
        summary = json.loads((out / "linearize.json").read_text(encoding="utf-8"))
        return {**summary.get("settings", {}), **summary.get("cli", {})}
    except (OSError, ValueError, AttributeError):
        pass
    for state in sorted((out / "finetune" / "checkpoints").glob("*/state.json"), reverse=True):
        try:
            settings = json.loads(state.read_text(encoding="utf-8"))["identity"]["run_info"]["linearize"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(settings, dict):
            return settings
    return None


def _out_is_not_an_input_file(out: str, *files) -> None:
    """An ``--out`` that is an input file (any spelling, symlink or hard link), named with it."""
    for given in files:
        if given is not None and os.path.exists(out) and os.path.exists(given) and os.path.samefile(out, given):
            raise ValueError(f"--out: output directory {out!r} is the input {str(given)!r} (the same file): writing "
                             "there would destroy the data being read; choose another output directory")


def _check_run_dir(out: Path, known: tuple, wanted: dict) -> None:
    """Refuse an ``--out`` that holds anything but a ``linearize`` run of the same settings (``wanted``:
    option → value; ``checkpoint`` and ``source`` compare by real path)."""
    check_run_dir(out, command="linearize", kind=" of this kind", known=known, recorded=_recorded_settings,
                  wanted=wanted, paths=("checkpoint", "source"))


def _toy_budget(args) -> None:
    """Memory and work of the toy path from its sizes, before any work (``ValueError`` naming the
    size, the budget and the way out)."""
    from types import SimpleNamespace

    from ..convert.theta import _fit_plan
    from ..llops.fit_als import QUALITY
    from ..tasks import MQARConfig, load_checkpoint
    from .train import estimate_bytes, memory_budget

    teacher, extra = load_checkpoint(args.checkpoint)
    cfg = teacher.config
    try:
        T = int(MQARConfig(**extra["task"]).seq_len)
    except (KeyError, TypeError):
        return  # the library names the missing task
    L, H, D = cfg.n_layers, cfg.n_heads, cfg.head_dim
    S, n = args.capture_sequences, args.capture_sequences * T
    budget = memory_budget()
    # q, k, v float32 as captured, q, k float64 for the fit; the float64 softmax scores of the captured sequences
    need = {"the captured q, k, v and their float64 copies": 28 * L * H * n * D,
            "the softmax scores of the captured sequences": 8 * S * H * T * T}
    student = SimpleNamespace(d_model=cfg.d_model, n_layers=L, n_heads=H, vocab_size=cfg.vocab_size, seq_len=T,
                              mlp_ratio=cfg.mlp_ratio, attention="llops", m=args.m, non_negative=args.non_negative,
                              dim=None, p=args.p)
    need["one fine-tuning batch"] = estimate_bytes(SimpleNamespace(**vars(student), batch_size=args.batch_size or 32))
    need["one evaluation batch"] = estimate_bytes(SimpleNamespace(**vars(student), batch_size=min(args.eval_sequences, 64)))
    p_theta = args.p // 2 if args.non_negative else args.p
    n_fit = max(1, round(n * (1 - args.holdout)))
    # the ALS factor partials [B, t, p, n, m] and normal matrices with their LU [B, m, t·d, t·d]
    need["the LLoPS fit's partials and normal matrices"] = 8 * L * H * (
        args.rank * p_theta * n_fit * args.m + 2 * args.m * (args.rank * D) ** 2)
    what, nbytes = max(need.items(), key=lambda kv: kv[1])
    if nbytes > budget:
        raise ValueError(
            f"linearize: {what} need about {nbytes / 2**30:.3g} GiB (capture_sequences={S} of {T} tokens, "
            f"batch_size={args.batch_size or 32}, p={args.p}, m={args.m}, rank={args.rank}, L={L}, H={H}, D={D}), over the memory budget of {budget / 2**30:.3g} "
            "GiB (half of this machine's memory): lower --capture-sequences, --batch-size, --m, --rank or --p")
    plan = _fit_plan(p_theta, args.m, args.rank, D, n_fit, QUALITY["default"].work, None)  # stage 0's one rule
    per, work = plan["per_iteration"], L * H * plan["work"]
    if work > FIT_WORK_BUDGET:
        raise ValueError(
            f"linearize: the LLoPS fit needs about {work:.3g} multiply-adds ({L * H} heads, one iteration "
            f"{per:.3g} at p={p_theta}, m={args.m}, rank={args.rank}, {n_fit} fitting tokens), over the work budget "
            f"of {FIT_WORK_BUDGET:.3g}: lower --p, --m, --rank or --capture-sequences")


def _run_toy(args) -> int:
    from ..convert.linearize import linearize

    out = Path(args.out)
    outputs = Outputs({}, directories={"--out": args.out}, inputs=[args.checkpoint], staged=["--out"])
    _check_run_dir(out, TOY_FILES, {"checkpoint": args.checkpoint, **_identity(TOY, args, as_called=True)})
    _toy_budget(args)
    with outputs.parents_created():  # the run's files appear in --out together at the end (the library stages them)
        res = linearize(args.checkpoint, out=args.out, **_call(TOY, args))
    outputs.announce(*(out / name for name in ("capture.safetensors", "theta.safetensors", "model/model.safetensors",
                                               "model/config.json", "linearize.json", "linearize.md")))
    print(f"{args.out}: softmax teacher {res.teacher_accuracy:.4f}, LLoPS step 0 {res.step0_accuracy:.4f}, "
          f"after {res.steps} steps {res.final_accuracy:.4f} (exact degree-{args.p} polynomial attention at step 0: "
          f"{res.poly_accuracy:.4f}); summary in {args.out}/linearize.md")
    return 0


def _pretrained_settings(args) -> dict:
    """What identifies a real-model run (recorded as ``cli`` in its ``linearize.json``)."""
    return {"source": os.path.realpath(args.gguf or args.model_dir), "text": os.path.realpath(args.text),
            **_identity(PRETRAINED, args, as_called=False)}


def _by_the_rule(flags: str, check, *args, **kwargs):
    """``check(*args, **kwargs)``, the library's rule, its refusal a ``UsageError`` naming the ``flags`` (exit 2)."""
    try:
        return check(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{flags}: {err}") from None


def _check_memory_flags(args, *, causal: bool = True, model=None) -> None:
    """``--cache``, ``--decay``, ``--state``, ``--beta`` (and, with the loaded ``model``, its causality and
    ``--exact-layers``) checked by the conversion's own rules, a refusal naming the flags (exit 2)."""
    from ..convert.convert import _check_exact_layers, _check_memory
    from ..convert.families import attention_sites

    if model is not None:
        family, sites = attention_sites(model)
        causal = all(site.causal for site in sites)
        _by_the_rule(f"--exact-layers {','.join(map(str, args.exact_layers))}", _check_exact_layers, args.exact_layers,
                     len(sites), family)
    _by_the_rule(f"--cache {args.cache}, --decay {'(none)' if args.decay is None else args.decay}, --state "
                 f"{args.state}, --beta {args.beta} (--window {args.window}{'' if causal else ', an encoder'})",
                 _check_memory, args.cache, args.decay, args.state, args.beta, args.window, args.sinks, args.local,
                 args.normalize, causal=causal, qk_conv=args.qk_conv)


def _read_text(given: str) -> str:
    """The ``--text`` file's text, or a ``UsageError`` naming the cause: missing, a directory,
    unreadable, binary (NUL bytes), not UTF-8 (the offending byte and offset, the way to convert it),
    or empty / whitespace only."""
    path = Path(given)
    if not os.path.lexists(path):
        raise UsageError(f"--text {given}: no such file")
    if path.is_dir():
        raise UsageError(f"--text {given}: is a directory; give a UTF-8 text file")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UsageError(f"--text {given}: cannot be read ({err.strerror or err})") from None
    nul = raw.find(b"\0")
    if nul >= 0:
        raise UsageError(f"--text {given}: a binary file (NUL byte at offset {nul}), not text; give a UTF-8 text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"--text {given}: not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start}); convert it, "
                         "e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        raise UsageError(f"--text {given}: holds no text ({'empty' if not text else 'whitespace only'}); give text to "
                         "train on")
    return text


def _run_pretrained(args) -> int:
    from ..convert.convert import check_layout
    from ..convert.linearize import _check_far, linearize
    from ..convert.saved import save_linearized
    from ..hf.pretrained import load_pretrained
    from ..io import staged_directory
    from .capture import transformers_progress
    if args.text is None:
        raise UsageError("--text is required with --model-dir / --gguf")
    text = _read_text(args.text)
    if args.holdout <= 0:
        raise UsageError(f"--holdout must lie in (0, 1) with --model-dir / --gguf, got {args.holdout}")
    if isinstance(args.gate_init, str) and args.window == 0:
        raise UsageError(f"--gate-init {args.gate_init} sets the hybrid's gates: --window 0 (pure linear attention) has none")
    # the library's rules, named by the flags here; the resolved number of sinks is what the run records
    args.sinks = _by_the_rule(f"--window {args.window}, --sinks {'(default)' if args.sinks is None else args.sinks}, "
                              f"--local {args.local}, --normalize {args.normalize or '(default)'}", check_layout,
                              args.window, args.sinks, args.local, args.normalize)[1]
    if args.untied and args.attention != "llops":
        raise UsageError(f"--untied is an LLoPS option; --attention {args.attention} has no tied form")
    _by_the_rule(f"--no-far with --window {args.window}"
                 + (f", --gate-init {args.gate_init}" if args.gate_init is not None else ""), _check_far,
                 not args.no_far, args.window, args.gate_init)
    _check_memory_flags(args, causal=True)  # the model's causality and layer count: once it is loaded
    out = Path(args.out)
    source = Path(args.gguf) if args.gguf else Path(args.model_dir)
    _out_is_not_an_input_file(args.out, args.gguf, args.text)
    outputs = Outputs({}, directories={"--out": args.out}, inputs=[args.model_dir, args.gguf, args.text],
                      staged=["--out"])
    wanted = _pretrained_settings(args)
    _check_run_dir(out, PRETRAINED_FILES, wanted)
    with transformers_progress(not args.no_progress):
        model, tokenizer = load_pretrained(args.model_dir, gguf=args.gguf)
    _check_memory_flags(args, model=model)
    model, report = linearize(model, text, tokenizer=tokenizer, **_call(PRETRAINED, args))
    summary = report.as_dict()
    summary["source"] = str(source)
    summary["cli"] = wanted
    with outputs.parents_created(), staged_directory(out, last=("linearize.json",)) as stage, \
            transformers_progress(not args.no_progress):  # its "Writing model shards" bar too
        save_linearized(model, stage / "model")
        tokenizer.save_pretrained(stage / "model")
        write_text_atomic(str(stage / "linearize.json"),
                          json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n")
        write_text_atomic(str(stage / "linearize.md"), _markdown(summary))
    outputs.announce(*sorted(p for p in (out / "model").rglob("*") if p.is_file()),
                     out / "linearize.json", out / "linearize.md")
    encoder = _is_encoder(summary["settings"])
    metric = "sentence-embedding cosine (neighbour agreement)" if encoder else "perplexity"
    last = summary["stages"][-1]
    floor = [s for s in summary["stages"] if s.get("window_only_metric") is not None]
    print(f"{out}: held-out {metric}: teacher {summary['teacher_metric']:.4g}, "
          + ", ".join(f"{s['name']} {_value(s)}" for s in summary["stages"])
          + (f"; window + sinks alone {_value(floor[-1], 'window_only_')} (the floor the far part must beat: "
             f"{'beaten' if floor[-1].get('far_helps') else 'NOT beaten, the sketch makes it worse'} after "
             f"{floor[-1]['name']})" if floor else "")
          + ("; far part off (--no-far)" if not summary["settings"].get("far", True) else "")
          + f"; converted model in {out / 'model'} (sketchlab.load_linearized); stage {last['name']} done"
          + "".join(f"; stage {s['name']} made layers {s['kept_initial']} worse: they keep their maps from before it"
                    for s in summary["stages"] if s.get("kept_initial")))
    return 0


def _is_encoder(settings: dict) -> bool:
    from ..hf.families import FAMILY_TABLE

    entry = FAMILY_TABLE.get(settings.get("family"))
    return bool(entry is not None and entry.encoder)


def _value(stage: dict, prefix: str = "") -> str:
    """A stage's held-out metric (``prefix="window_only_"``: window + sinks alone's), with an encoder's
    neighbour agreement in brackets."""
    metric, agreement = stage.get(prefix + "metric"), stage.get(prefix + "nn_agreement")
    if metric is None:
        return "–"
    return f"{metric:.4g}" + (f" ({agreement:.3f})" if agreement is not None else "")


def _memory_line(s: dict) -> str:
    """The long-context memory and the exact layers of a run's settings, in words (older runs: none)."""
    decay = s.get("decay")
    parts = [f"cache {s.get('cache', 0)}", f"decay {'none' if decay is None else decay}",
             f"state {s.get('state', 'additive')}" + (f" (β {s.get('beta')})" if s.get("state") == "delta" else "")]
    exact = s.get("exact_layers") or []
    return ("Long-context memory: " + ", ".join(parts) + "; exact layers: "
            + (", ".join(map(str, exact)) if exact else "none") + ".")


def _markdown(summary: dict) -> str:
    s = summary["settings"]
    encoder = _is_encoder(s)
    metric = ("mean sentence-embedding cosine to the teacher (nearest-neighbour agreement)" if encoder
              else "perplexity")
    unit = "sentences (one line each)" if s.get("sentences") else f"sequences of {s['seq_len']} tokens"
    mean = lambda err: "–" if not err else f"{sum(err) / len(err):.4f}"  # noqa: E731
    lines = [f"# Linearised {summary['source']}", "",
             f"{s['family']} family; attention {s['attention']} p={s['p']} m={s['m']} rank {s['rank']}, window "
             f"{s['window']} + {s['sinks']} sinks ({s['local']}){', input norm' if s.get('input_norm') else ''}"
             f"{'' if s.get('far', True) else ', far part off'}; "
             f"{s['sequences']} {unit}, {s['held_out']} held out.", "",
             _memory_line(s), "",
             f"| stage | held-out {metric} | mean attention-output error | window + sinks alone | far part helps | "
             "seconds |", "|---|---|---|---|---|---|",
             f"| teacher | {summary['teacher_metric']:.4g} | 0 | – | – | – |"]
    for st in summary["stages"]:
        helps = st.get("far_helps")
        lines.append(f"| {st['name']} | {_value(st)} | {mean(st['layer_error'])} | {_value(st, 'window_only_')} "
                     f"(error {mean(st.get('window_only_layer_error'))}) | "
                     f"{'–' if helps is None else 'yes' if helps else '**no**'} | {st['seconds']:.1f} |")
    lines += ["", "*Window + sinks alone*: the same converted model with every gate logit at 40 (sigmoid = 1 in "
              "float32: the far part's weight 0), on the same held-out " + ("sentences" if encoder else "sequences")
              + " — the floor the sketched far part must beat (`far helps`: the stage's value beats it). "
              "`--no-far` (`linearize(far=False)`) keeps that model."]
    for st in summary["stages"]:
        if st.get("kept_initial"):
            trained = st["layer_error_trained"]
            lines += ["", f"Stage {st['name']} made the held-back attention error of layers {st['kept_initial']} worse "
                      f"({', '.join(f'{trained[i]:.4g}' for i in st['kept_initial'][:6])} after it): those layers keep "
                      "what they had before the stage (the table's error and perplexity are with them)."]
    return "\n".join(lines) + "\n"
