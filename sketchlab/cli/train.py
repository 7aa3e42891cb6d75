"""``sketchlab train``: train a small transformer on MQAR with any registered attention (resumable, DDP-ready).

Writes under ``--out``: ``checkpoints/step-N/`` (resumable state, see :mod:`sketchlab.tasks.train`),
and at the end ``model.safetensors`` + ``config.json`` (a :func:`sketchlab.tasks.load_checkpoint`
directory) and ``train.json`` (settings, losses per step, held-out accuracy per evaluation). Running
the same command again resumes an interrupted run; a different configuration is refused. Under
``torchrun --nproc_per_node N -m sketchlab.cli -- train ...`` the same command trains with
DistributedDataParallel (gloo on CPU, nccl with ``--device cuda``), ``--batch-size`` being the global
batch (the ``--`` stops torchrun from reading ``--m`` as an abbreviation of its own options).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ._common import UsageError, write_text_atomic


def add_arguments(sub) -> None:
    cmd = sub.add_parser("train", help="train a small transformer on MQAR with softmax or sketched attention")
    cmd.add_argument("--task", choices=("mqar",), default="mqar", help="the task (multi-query associative recall)")
    cmd.add_argument("--attention", required=True,
                     help="attention kernel: softmax, poly, based, psf or llops (sketchlab.tasks registry)")
    cmd.add_argument("--out", required=True, help="output directory (created; an existing run there is resumed)")
    k = cmd.add_argument_group("attention options (each kernel takes its own; see sketchlab.tasks.attention)")
    k.add_argument("--p", type=int, default=None, help="polynomial degree (poly, based, psf, llops)")
    k.add_argument("--m", type=int, default=None, help="features (psf, llops)")
    k.add_argument("--rank", type=int, default=None, help="LLoPS CP rank t (llops)")
    k.add_argument("--non-negative", action="store_true", default=None,
                   help="self-tensor the features φ⊗φ (llops; psf does by default)")
    k.add_argument("--normalize", choices=("sum", "none"), default=None, help="attention normalisation")
    k.add_argument("--form", choices=("taylor", "expand"), default=None, help="BASED form (based)")
    k.add_argument("--dim", type=int, default=None, help="BASED feature dimension d' (based)")
    k.add_argument("--backend", choices=("auto", "torch", "triton", "reference"), default=None,
                   help="LLoPS attention backend (llops)")
    k.add_argument("--init", nargs="+", default=None, metavar="INIT",
                   help="llops initialisation: 'random' (default), 'based', or 'theta FILE' (an exported Θ)")
    k.add_argument("--init-from", default=None, metavar="DIR",
                   help="copy every non-attention weight from this model checkpoint (e.g. a trained softmax or "
                        "BASED model) before --init")
    t = cmd.add_argument_group("task and model")
    t.add_argument("--vocab-size", type=int, default=65)
    t.add_argument("--num-pairs", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=64)
    t.add_argument("--num-queries", type=int, default=None, help="queries per sequence (default: every key)")
    t.add_argument("--d-model", type=int, default=64)
    t.add_argument("--n-heads", type=int, default=4)
    t.add_argument("--n-layers", type=int, default=2)
    t.add_argument("--mlp-ratio", type=int, default=2)
    t.add_argument("--short-conv", type=int, default=2)
    o = cmd.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=300)
    o.add_argument("--batch-size", type=int, default=32, help="global batch (sequences per step)")
    o.add_argument("--lr", type=float, default=3e-3)
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--kernel-lr", type=float, default=0.1,
                   help="learning-rate factor of the attention kernels' parameters (LLoPS's Θ); at 1 Θ trained from "
                        "BASED loses its non-negative kernel before recall is learned")
    o.add_argument("--warmup", type=int, default=30)
    o.add_argument("--clip", type=float, default=1.0)
    o.add_argument("--seed", type=int, default=0, help="model initialisation and data stream")
    o.add_argument("--eval-every", type=int, default=50, help="held-out evaluation every N steps (0: at the end)")
    o.add_argument("--eval-sequences", type=int, default=256)
    o.add_argument("--checkpoint-every", type=int, default=100)
    o.add_argument("--device", default="cpu", help="cpu or cuda")
    o.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed for determinism)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def _attention_options(args) -> dict:
    names = ("p", "m", "rank", "non_negative", "normalize", "form", "dim", "backend")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _parse_init(init, attention: str) -> tuple[str, str | None]:
    if init is None:
        return "random", None
    if attention != "llops":
        raise UsageError(f"--init applies to --attention llops only, got --attention {attention}")
    if init[0] == "theta" and len(init) == 2:
        return "theta", init[1]
    if init[0] in ("random", "based") and len(init) == 1:
        return init[0], None
    raise UsageError(f"--init must be 'random', 'based' or 'theta FILE', got {' '.join(init)!r}")


def build_model(args):
    """The model of ``args`` (config, seed, ``--init-from``, ``--init``) and its ``run_info``."""
    import torch

    from ..tasks import TransformerConfig, TransformerLM, copy_shared_weights, init_llops, load_checkpoint

    init, theta_file = _parse_init(args.init, args.attention)
    config = TransformerConfig(
        vocab_size=args.vocab_size, d_model=args.d_model, n_heads=args.n_heads, n_layers=args.n_layers,
        mlp_ratio=args.mlp_ratio, short_conv=args.short_conv, attention=args.attention,
        attention_options=_attention_options(args),
    )
    torch.manual_seed(args.seed)
    model = TransformerLM(config)
    run_info: dict = {}
    if args.init_from is not None:
        source, _ = load_checkpoint(args.init_from)
        copy_shared_weights(source, model)
        digest = hashlib.sha256((Path(args.init_from) / "model.safetensors").read_bytes()).hexdigest()
        run_info["init_from"] = {"dir": str(args.init_from), "sha256": digest}
    if args.attention == "llops":
        run_info["init"] = init_llops(model, init, theta_file, seed=args.seed)
    return model, run_info


def run(args) -> int:
    import torch

    from ..tasks import MQARConfig, init_distributed, save_checkpoint, train_mqar

    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"output directory's parent {str(out.parent)!r} does not exist (for --out {args.out!r})")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=args.device.startswith("cuda"))
    rank, world = init_distributed(args.device)
    try:
        task = MQARConfig(args.vocab_size, args.num_pairs, args.seq_len, args.num_queries)
        model, run_info = build_model(args)
        device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device.startswith("cuda") else "cpu")
        model.to(device)
        out.mkdir(exist_ok=True)
        result = train_mqar(
            model, [(task, args.steps)], batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
            kernel_lr=args.kernel_lr, warmup=args.warmup, clip=args.clip, seed=args.seed, eval_sequences=args.eval_sequences,
            eval_every=args.eval_every, out=out, checkpoint_every=args.checkpoint_every, run_info=run_info,
            progress=not args.no_progress,
        )
        if rank == 0:
            summary = {
                "task": task.to_dict(), "model": model.config.to_dict(), "run_info": run_info,
                "steps": result.steps, "batch_size": args.batch_size, "lr": args.lr,
                "weight_decay": args.weight_decay, "kernel_lr": args.kernel_lr, "warmup": args.warmup, "clip": args.clip, "seed": args.seed,
                "world_size": world, "heldout_accuracy": result.heldout_accuracy, "evals": result.evals,
                "losses": result.losses, "seconds": result.seconds, "resumed_from": result.resumed_from,
            }
            save_checkpoint(out, model.cpu(), extra={"task": task.to_dict(), "heldout_accuracy": result.heldout_accuracy,
                                                     "run_info": run_info})
            write_text_atomic(str(out / "train.json"), json.dumps(summary, indent=1, sort_keys=True) + "\n")
            print(f"{out}: {args.attention} held-out accuracy {result.heldout_accuracy:.4f} after {result.steps} "
                  f"steps (world size {world}, {result.seconds:.0f}s"
                  f"{'' if result.resumed_from is None else f', resumed from step {result.resumed_from}'})")
    finally:
        import torch.distributed as dist

        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0
