"""``sketchlab linearize``: fitted LLoPS Θ as the attention of a trained softmax model, then fine-tune.

Capture q/k from the checkpoint on its own task data → fit LLoPS per layer and head → export Θ →
the same model with ``llops`` attention from that Θ and the softmax model's other weights →
held-out accuracy at step 0 (next to the teacher's) → fine-tune ``--steps`` → accuracy again.
Everything goes under ``--out`` (see :func:`sketchlab.tasks.linearize`); running it again resumes the
fine-tuning.
"""

from __future__ import annotations


def add_arguments(sub) -> None:
    cmd = sub.add_parser("linearize", help="swap a softmax checkpoint's attention for fitted LLoPS, fine-tune")
    cmd.add_argument("checkpoint", help="softmax model directory (model.safetensors + config.json with its MQAR task)")
    cmd.add_argument("--p", type=int, required=True, help="degree of the attention kernel")
    cmd.add_argument("--m", type=int, required=True, help="LLoPS features (m² attention features with --non-negative)")
    cmd.add_argument("--out", required=True, help="output directory (created; its parent must exist)")
    cmd.add_argument("--rank", type=int, default=1, help="CP rank t of Θ (default 1)")
    cmd.add_argument("--non-negative", action="store_true",
                     help="self-tensored map φ⊗φ: Θ of degree p/2 (even p), non-negative kernel")
    cmd.add_argument("--normalize", choices=("sum", "none"), default="sum", help="attention normalisation")
    cmd.add_argument("--capture-sequences", type=int, default=4, help="task sequences captured for the fit")
    cmd.add_argument("--holdout", type=float, default=0.25, help="fraction of captured tokens held out of the fit")
    cmd.add_argument("--steps", type=int, default=100, help="fine-tuning steps (0: step 0 only)")
    cmd.add_argument("--batch-size", type=int, default=32)
    cmd.add_argument("--lr", type=float, default=1e-3)
    cmd.add_argument("--warmup", type=int, default=10)
    cmd.add_argument("--transfer", type=float, default=0.0,
                     help="weight of the attention-transfer loss against softmax attention (LoLCATs; 0 = off)")
    cmd.add_argument("--eval-sequences", type=int, default=512)
    cmd.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N fine-tuning steps")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    import torch

    from ..tasks import linearize
    from ._common import UsageError

    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    res = linearize(
        args.checkpoint, p=args.p, m=args.m, out=args.out, rank=args.rank, non_negative=args.non_negative,
        normalize=args.normalize, capture_sequences=args.capture_sequences, holdout=args.holdout, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, transfer=args.transfer,
        eval_sequences=args.eval_sequences, eval_every=args.eval_every, seed=args.seed,
        progress=not args.no_progress,
    )
    print(f"{args.out}: softmax teacher {res.teacher_accuracy:.4f}, LLoPS step 0 {res.step0_accuracy:.4f}, "
          f"after {res.steps} steps {res.final_accuracy:.4f} (exact degree-{args.p} polynomial attention at step 0: "
          f"{res.poly_accuracy:.4f}); summary in {args.out}/linearize.md")
    return 0
