"""``sketchlab evaluate``: the recall measures of a causal LM — passkey retrieval and copy recall.

The model is a local transformers causal LM (``--model-dir DIR`` or ``--gguf FILE``); a directory
written by :func:`sketchlab.save_linearized` (or ``sketchlab linearize``'s ``--out/model``) loads as
the converted model, and ``--converted DIR`` applies such a save onto a teacher loaded from
``--model-dir``/``--gguf`` (:func:`sketchlab.load_linearized`). The passkey test
(:func:`sketchlab.passkey_accuracy`) always runs; copy recall (:func:`sketchlab.copy_recall`) runs on
``--text FILE``, held-out text tokenised by the model's tokenizer. The tables
(:func:`sketchlab.format_recall`) are printed and, with ``--out FILE.md``, written atomically
(``--json FILE`` the results as JSON).

Refused before the model runs (exit 2, one line): a missing file or directory, a ``--converted``
directory that is not a save (or given with a ``--model-dir`` that already is one), an output onto
an input, a ``--text`` shorter than ``--passage`` + the longest gap in tokens, a passkey length below
the prompt's minimum, a model that is not a causal LM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from ._common import Outputs, UsageError, add_common, int_list, positive_int, positive_int_list

__all__ = ["add_arguments", "run"]


def _depths(text: str) -> list[float]:
    """``"0.1,0.5"`` → ``[0.1, 0.5]``, each in ``[0, 1]`` (an argparse type)."""
    values = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {part.strip()!r} in "
                                             f"{text!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number in [0, 1], got {text!r}")
    return values


def _gaps(text: str) -> list[int]:
    """``"256,1024"`` → ``[256, 1024]``, each ``>= 0`` (an argparse type)."""
    values = int_list(text)
    bad = [v for v in values if v < 0]
    if bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {bad[0]} in {text!r}")
    return values


def add_arguments(sub) -> None:
    cmd = sub.add_parser("evaluate", help="recall of a causal LM, converted or not: passkey retrieval and copy recall")
    model = cmd.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-dir", help="a local transformers causal LM directory (save_pretrained), or a converted "
                                           "save (sketchlab linearize's --out/model)")
    model.add_argument("--gguf", help="a local GGUF file (e.g. SmolLM2), loaded with transformers' gguf_file=")
    cmd.add_argument("--converted", help="a save_linearized directory applied onto the model (the teacher of "
                                         "--model-dir/--gguf): evaluate the converted model")
    cmd.add_argument("--text", help="UTF-8 held-out text for copy recall (tokenised by the model's tokenizer; "
                                    "without it only the passkey test runs)")
    cmd.add_argument("--passkey-lengths", type=positive_int_list, default=[1024, 2048, 4096],
                     help="passkey prompt lengths in tokens, exactly (default 1024,2048,4096)")
    cmd.add_argument("--depths", type=_depths, default=[0.1, 0.5, 0.9],
                     help="depths of the key in the filler, in [0, 1] (default 0.1,0.5,0.9)")
    cmd.add_argument("--n", type=positive_int, default=5, help="passkey prompts (keys) per length and depth (default 5)")
    cmd.add_argument("--max-new-tokens", type=positive_int, default=8,
                     help="greedy tokens decoded after the passkey question (default 8)")
    cmd.add_argument("--gaps", type=_gaps, default=[256, 1024, 2048],
                     help="copy recall: tokens of other text between the two copies (default 256,1024,2048)")
    cmd.add_argument("--passage", type=positive_int, default=128, help="copy recall: tokens of the passage (default 128)")
    cmd.add_argument("--copy-n", type=positive_int, default=4, help="copy recall: draws per gap (default 4)")
    add_common(cmd, "seed")
    cmd.add_argument("--out", help="markdown file of the tables (written atomically; '-': standard output only)")
    cmd.add_argument("--json", help="JSON file of the results: every key, continuation and per-draw loss ('-': "
                                    "standard output)")
    add_common(cmd, "progress")


def _save_options(directory: Path) -> bool:
    """Whether ``directory`` holds a converted save (its conversion options)."""
    if (directory / "sketchlab_conversion.json").is_file():
        return True
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("sketchlab"), dict)


@contextlib.contextmanager
def _quiet_load(enabled: bool):
    """transformers' load report lists a converted save's maps as unexpected weights: they are loaded
    right after (load_linearized), so the report is kept quiet then."""
    if not enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def run(args) -> int:
    from ..convert import load_linearized
    from ..convert.linearize import tokenize_texts
    from ..evaluate import copy_recall, format_recall, passkey_accuracy
    from ..hf.pretrained import load_pretrained
    from .capture import transformers_progress

    source = Path(args.model_dir) if args.model_dir is not None else Path(args.gguf)
    if args.model_dir is not None and not (source / "config.json").is_file():
        raise UsageError(f"--model-dir {args.model_dir}: not a transformers model directory (no config.json)")
    if args.gguf is not None and not source.is_file():
        raise UsageError(f"--gguf {args.gguf}: no such file")
    saved = args.model_dir is not None and _save_options(source)
    if args.converted is not None:
        if not Path(args.converted).is_dir():
            raise UsageError(f"--converted {args.converted}: no such directory")
        if not _save_options(Path(args.converted)):
            raise UsageError(f"--converted {args.converted}: not a converted save (no sketchlab_conversion.json, no "
                             "'sketchlab' in config.json); give a sketchlab.save_linearized directory")
        if saved:
            raise UsageError(f"--model-dir {args.model_dir} is already a converted save; --converted applies a save "
                             "onto a teacher: drop one of them")
    if args.text is not None and not Path(args.text).is_file():
        raise UsageError(f"--text {args.text}: no such file")
    for option, values in (("--depths", args.depths), ("--passkey-lengths", args.passkey_lengths),
                           ("--gaps", args.gaps)):
        if len(set(values)) != len(values):
            raise UsageError(f"{option}: the values must be distinct, got {','.join(map(str, values))}")
    if args.passage < 2:
        raise UsageError(f"--passage must be at least 2 (its tokens 2 … passage are scored), got {args.passage}")
    outputs = Outputs({"--out": args.out, "--json": args.json}, stdout=("--out", "--json"),
                      inputs=[args.model_dir, args.gguf, args.converted, args.text])
    with transformers_progress(not args.no_progress), _quiet_load(saved or args.converted is not None):
        model, tokenizer = load_pretrained(args.model_dir, gguf=args.gguf)
    if saved:
        load_linearized(source, model)
    if args.converted is not None:
        load_linearized(args.converted, model)
    text_ids = None
    if args.text is not None:
        ids, _ = tokenize_texts(Path(args.text).read_text(encoding="utf-8"), tokenizer, seq_len=sys.maxsize)
        text_ids = ids[0]
        need = args.passage + max(args.gaps)
        if text_ids.numel() < need:
            raise ValueError(f"--text {args.text}: {text_ids.numel()} tokens; copy recall needs at least --passage + "
                             f"the longest of --gaps = {args.passage} + {max(args.gaps)} = {need}")
    passkey = passkey_accuracy(model, tokenizer, lengths=args.passkey_lengths, depths=args.depths, n=args.n,
                               seed=args.seed, max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
    copy = None
    if text_ids is not None:
        copy = copy_recall(model, text_ids, gaps=args.gaps, passage=args.passage, n=args.copy_n, seed=args.seed)
    name = str(source) + (f" + {args.converted}" if args.converted is not None else "")
    table = format_recall(passkey, copy, title=f"Recall of {name}")
    record = {"model": name, "passkey": passkey.as_dict(), "copy": None if copy is None else copy.as_dict()}
    if not outputs.stdout_taken:
        print(table, end="")
    outputs.write({"--out": table, "--json": json.dumps(record, indent=1, sort_keys=True) + "\n"})
    return 0
