"""``sketchlab capture``: dump Q/K/V ``[L, H, n, d]`` from a local transformers model directory or GGUF file.

Refused before any work (exit 2, one line): an ``--out`` that is (by any spelling or link) the text,
the token-id file or a file of the model directory; a capture whose q, k, v would exceed the memory
budget (half of this machine's memory), estimated from the model's ``config.json`` and
``--max-tokens``. The dump's files are reported as ``wrote PATH``; a bar on stderr shows the stages.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ._common import Outputs, positive_int

#: ``config.json`` names of (layers, heads, width, head size) across the families capture reads.
_CONFIG_KEYS = (("num_hidden_layers", "n_layer", "n_layers"), ("num_attention_heads", "n_head", "n_heads"),
                ("hidden_size", "n_embd", "d_model"), ("head_dim",))


def add_arguments(sub) -> None:
    cmd = sub.add_parser("capture", help="dump Q/K/V [L, H, n, d] from a local transformers model directory or GGUF file")
    model = cmd.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-dir", help="directory written by save_pretrained (no download)")
    model.add_argument("--gguf", help="a GGUF file (weights and tokenizer; e.g. SmolLM2's), read by transformers' gguf_file=")
    src = cmd.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="UTF-8 text file, tokenised by the model's tokenizer (the directory's or the GGUF's)")
    src.add_argument("--token-ids", help="file of integer token ids, one sequence per line (no tokenizer needed)")
    cmd.add_argument("--out", required=True,
                     help="output dump (.safetensors, .pt, .npz or .npy; parents created); written through a "
                          "symlink, never onto an input")
    cmd.add_argument("--max-tokens", type=positive_int, default=512, help="tokens captured in all (default 512)")
    cmd.add_argument("--seq-len", type=positive_int, default=512,
                     help="longest sequence: longer text is cut into as many sequences as it needs "
                          "(default 512; at most the model's position limit)")
    cmd.add_argument("--point", choices=("auto", "attention", "projections"), default="auto",
                     help="where: what the attention receives (post-RoPE; the default) or the projection outputs "
                          "(pre-RoPE)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def estimate_bytes(model_dir: Path, max_tokens: int, config: dict | None = None) -> tuple[int, str] | None:
    """Bytes of the captured q, k, v (float32, ``3·L·H·n·d·4``, key/value heads repeated to ``H``)
    for ``max_tokens`` tokens, from ``model_dir/config.json`` (or the given ``config`` dict), with
    the shape it assumed; ``None`` when the config does not say."""
    if config is None:
        if model_dir is None:
            return None  # a GGUF whose metadata could not be read: capture_pretrained names the problem
        try:
            config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # capture_pretrained names the problem
    if not isinstance(config, dict):
        return None
    config = {**config.get("text_config", {}), **config} if isinstance(config.get("text_config"), dict) else config
    values = []
    for names in _CONFIG_KEYS:
        found = next((config[n] for n in names if isinstance(config.get(n), int) and config[n] > 0), None)
        values.append(found)
    L, H, width, d = values
    if d is None and H and width:
        d = width // H
    if not (L and H and d):
        return None
    return 3 * L * H * max_tokens * d * 4, f"L={L}, H={H}, d={d}"


def _gguf_config(path: Path) -> dict | None:
    """The model config a GGUF file's metadata gives transformers (``None`` when it cannot be read:
    the load names the problem)."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True).to_dict()
    except Exception:  # noqa: BLE001 - any unreadable file: capture_pretrained reports it with its path
        return None


@contextlib.contextmanager
def transformers_progress(enabled: bool):
    """Within the block, transformers' own progress bars (e.g. "Loading weights") follow ``--no-progress``."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the optional extra: the library names it
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


def run(args) -> int:
    from tqdm.auto import tqdm

    from ..capture import capture_pretrained
    from ..io import dump_files, save_qk
    from .train import memory_budget

    if args.gguf is not None:
        gguf = Path(args.gguf)
        if not gguf.is_file():  # before the bar: bad input stays one line
            raise FileNotFoundError(f"--gguf {gguf}: no such file")
        model_dir, model_files, config = None, [gguf], _gguf_config(gguf)
    else:
        model_dir = Path(args.model_dir)
        model_files = [f for f in model_dir.iterdir() if f.is_file()] if model_dir.is_dir() else []
        config = None
        if not (model_dir / "config.json").is_file():  # before the bar: bad input stays one line
            raise FileNotFoundError(f"{model_dir}: not a transformers model directory (no config.json)")
    outputs = Outputs({"--out": args.out}, inputs=[args.text, args.token_ids, *model_files], dumps=("--out",))
    for option, path in (("--text", args.text), ("--token-ids", args.token_ids)):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{option} {path}: no such file")
    estimate = estimate_bytes(model_dir, args.max_tokens, config)
    if estimate is not None and estimate[0] > memory_budget():
        raise ValueError(
            f"capture: q, k, v of {args.max_tokens} tokens ({estimate[1]}, float32) need about "
            f"{estimate[0] / 2**30:.3g} GiB, over the memory budget of {memory_budget() / 2**30:.3g} GiB (half of "
            "this machine's memory): lower --max-tokens")
    with transformers_progress(not args.no_progress), \
            tqdm(total=2, desc="capture", unit="stage", disable=args.no_progress) as bar:
        bar.set_postfix_str("load the model and run it")
        dump = capture_pretrained(args.model_dir, gguf=args.gguf, text=args.text, token_ids=args.token_ids,
                                  max_tokens=args.max_tokens, seq_len=args.seq_len, point=args.point)
        bar.update()
        bar.set_postfix_str("write the dump")
        meta = {key: value for key, value in dump.meta.items() if key != "layout"}
        with outputs.parents_created():
            dump.path = save_qk(Path(args.out), dump.q, dump.k, dump.v, meta=meta)
        bar.update()
    outputs.announce(*(dump_files(args.out) or [args.out]))
    L, H, n, d = dump.q.shape
    segments = len(json.loads(dump.meta["tokens"]))
    print(f"{dump.path}: q, k{', v' if dump.v is not None else ''} of shape [L={L}, H={H}, n={n}, d={d}] "
          f"in {segments} sequence(s) ({dump.meta['captured']})")
    return 0
