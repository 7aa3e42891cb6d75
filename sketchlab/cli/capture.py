"""``sketchlab capture``: dump Q/K/V ``[L, H, n, d]`` from a local transformers model directory."""

from __future__ import annotations

import json
from pathlib import Path

from ._common import check_outputs, positive_int


def add_arguments(sub) -> None:
    cmd = sub.add_parser("capture", help="dump Q/K/V [L, H, n, d] from a local transformers model directory")
    cmd.add_argument("--model-dir", required=True, help="directory written by save_pretrained (no download)")
    src = cmd.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="UTF-8 text file, tokenised by the directory's tokenizer")
    src.add_argument("--token-ids", help="file of integer token ids, one sequence per line (no tokenizer needed)")
    cmd.add_argument("--out", required=True,
                     help="output dump (.safetensors, .pt, .npz or .npy); written through a symlink, never onto an input")
    cmd.add_argument("--max-tokens", type=positive_int, default=512, help="tokens captured in all (default 512)")
    cmd.add_argument("--seq-len", type=positive_int, default=512,
                     help="longest sequence: longer text is cut into as many sequences as it needs "
                          "(default 512; at most the model's position limit)")
    cmd.add_argument("--point", choices=("auto", "attention", "projections"), default="auto",
                     help="where: what the attention receives (post-RoPE; the default) or the projection outputs "
                          "(pre-RoPE)")


def run(args) -> int:
    from ..capture import capture_pretrained

    model_dir = Path(args.model_dir)
    model_files = [f for f in model_dir.iterdir() if f.is_file()] if model_dir.is_dir() else []
    check_outputs({"--out": args.out}, inputs=[args.text, args.token_ids, *model_files], dumps=("--out",))
    dump = capture_pretrained(args.model_dir, text=args.text, token_ids=args.token_ids, max_tokens=args.max_tokens,
                              seq_len=args.seq_len, point=args.point, path=args.out)
    L, H, n, d = dump.q.shape
    segments = len(json.loads(dump.meta["tokens"]))
    print(f"{dump.path}: q, k{', v' if dump.v is not None else ''} of shape [L={L}, H={H}, n={n}, d={d}] "
          f"in {segments} sequence(s) ({dump.meta['captured']})")
    return 0
