"""``sketchlab train``: train a small transformer on MQAR with any registered attention (resumable, DDP-ready).

Writes under ``--out``: ``checkpoints/step-N/`` (resumable state, see :mod:`sketchlab.tasks.train`),
and at the end ``model.safetensors`` + ``config.json`` (a :func:`sketchlab.tasks.load_checkpoint`
directory) and ``train.json`` (settings, losses per step, held-out accuracy per evaluation). Running
the same command again resumes an interrupted run; a different configuration is refused. Under
``torchrun --nproc_per_node N -m sketchlab.cli -- train ...`` the same command trains with
DistributedDataParallel (gloo on CPU, nccl with ``--device cuda``), ``--batch-size`` being the global
batch (the ``--`` stops torchrun from reading ``--m`` as an abbreviation of its own options).

``--attention llops`` defaults (:data:`LLOPS_DEFAULTS`, each overridden by its flag): from a random
start the form the MQAR study found best (``analysis/results/mqar_nope3200.md``: LLoPS of the affine
input ``[x, 1]``, self-tensored, ``p = 2``, ``m = 16``: 256 features, 0.984 ± 0.007 over 5 seeds against
0.42-0.58 for the homogeneous map); with ``--init based`` or ``--init theta FILE`` the homogeneous map
those start from (``p = 2``, ``m = 64``, neither affine nor self-tensored; ``--init based --affine`` is
BASED's Taylor map, ``m = 1 + d' + d'²``). A resumed run keeps its own: an option not given on the
command line takes the value stored in the newest checkpoint (a run written before these defaults
resumes as it was).

Refused before any work (exit 2, one line): an ``--out`` that is or holds the ``--init-from``
directory or the ``--init theta`` file; an ``--out`` holding files of something other than a
``sketchlab train`` run (a model directory, another run's final model); a device this machine does
not have; a model and batch whose estimated memory exceeds :func:`memory_budget`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from ._common import (
    DEFAULT_M,
    DEFAULT_P,
    Outputs,
    UsageError,
    check_run_dir,
    decay_arg,
    device_arg,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    seed_arg,
    write_text_atomic,
)

#: What a ``sketchlab train`` output directory holds (anything else there belongs to something else).
RUN_FILES = ("checkpoints", "model.safetensors", "config.json", "train.json")

#: ``--attention llops`` options the command fills in when not given, by ``--init``. Random: the trainable
#: form of the MQAR study (``analysis/results/mqar_nope3200.md``); BASED and an exported Θ: the homogeneous
#: map they start from (BASED's expand map; the map ``sketchlab fit`` fits), the command's defaults before.
LLOPS_DEFAULTS = {
    "random": {"affine": True, "non_negative": True, "p": 2, "m": 16},
    "based": {"affine": False, "non_negative": False, "p": DEFAULT_P, "m": DEFAULT_M},
    "theta": {"affine": False, "non_negative": False, "p": DEFAULT_P, "m": DEFAULT_M},
}


def memory_budget() -> int:
    """Bytes a training run may plan to use: half of this machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 16 GiB
        total = 16 * 2**30
    return total // 2


def estimate_bytes(args) -> int:
    """A generous estimate of a training step's memory (float32): the parameters with their
    gradients and two AdamW moments, and one batch's activations kept for the backward pass.

    Per token and layer the blocks keep ``≈ (12 + 4·mlp_ratio)·d_model`` activations; softmax and
    exact polynomial attention add ``2·H·T`` (scores and weights), a sketch ``2·H·M`` features
    (``M = m²`` self-tensored); the output head keeps ``3·vocab`` (logits, log-softmax, gradient).
    """
    d, layers, heads, vocab, T, B = (args.d_model, args.n_layers, args.n_heads, args.vocab_size, args.seq_len,
                                     args.batch_size)
    params = 2 * vocab * d + layers * (4 + 2 * args.mlp_ratio) * d * d
    if args.attention in ("softmax", "poly"):
        attn = 2 * heads * T
    else:
        m = args.m or DEFAULT_M
        attn = 2 * heads * (m * m if args.non_negative else m) + 2 * heads * (args.dim or 0) ** (args.p or DEFAULT_P)
    per_token = layers * ((12 + 4 * args.mlp_ratio) * d + attn) + 3 * vocab
    return 4 * (4 * params + B * T * per_token)


def _device(text: str) -> str:
    """``--device``: a device this machine has (:func:`~sketchlab.cli._common.device_arg`), kept as text."""
    return str(device_arg(text))


def add_arguments(sub) -> None:
    cmd = sub.add_parser("train", help="train a small transformer on MQAR with softmax or sketched attention")
    cmd.add_argument("--task", choices=("mqar",), default="mqar", help="the task (multi-query associative recall)")
    from ..tasks.model import attention_registry

    names = attention_registry()
    cmd.add_argument("--attention", required=True,
                     help=f"attention kernel: {', '.join(names[:-1])} or {names[-1]} "
                          "(sketchlab.tasks registry)")
    cmd.add_argument("--out", required=True,
                     help="output directory (created with its parents; the same run there is resumed, another refused)")
    k = cmd.add_argument_group("attention options (each kernel takes its own; see sketchlab.tasks.attention)")
    k.add_argument("--p", type=int, default=None,
                   help=f"polynomial degree p (poly, based, psf, llops; default {DEFAULT_P})")
    k.add_argument("--m", type=int, default=None,
                   help=f"sketch size: features per map (psf: default {DEFAULT_M}; llops: 16 with --init random, "
                        f"{DEFAULT_M} with --init based or theta, 1 + d' + d'² with --init based "
                        "--affine)")
    k.add_argument("--rank", type=int, default=None, help="LLoPS CP rank t (llops)")
    k.add_argument("--non-negative", action=argparse.BooleanOptionalAction, default=None,
                   help="self-tensor the features φ⊗φ: m² features, kernel (φ(q)·φ(k))² ≥ 0 (psf: on by default; "
                        "llops: on with --init random, off with --init based or theta)")
    k.add_argument("--affine", action=argparse.BooleanOptionalAction, default=None,
                   help="LLoPS of the affine input [x·D^(-1/4), 1]: features are inhomogeneous polynomials of degree "
                        "<= p, as BASED's 1 + s + s²/2 (llops; on with --init random, the MQAR study's best form with "
                        "--non-negative, p 2, m 16; off with --init based or theta; --init based --affine is BASED's "
                        "Taylor map, m 1 + d' + d'² with d' = min(16, head dim), and refuses --non-negative)")
    k.add_argument("--normalize", choices=("sum", "none"), default=None, help="attention normalisation")
    k.add_argument("--form", choices=("taylor", "expand"), default=None, help="BASED form (based)")
    k.add_argument("--dim", type=int, default=None, help="BASED feature dimension d' (based)")
    k.add_argument("--backend", choices=("auto", "torch", "triton", "reference"), default=None,
                   help="LLoPS attention backend (llops)")
    m = cmd.add_argument_group("sliding window and long-context memory (every sketched kernel; checked by "
                               "sketchlab.attention.AttentionOptions, docs/DESIGN.md §7)")
    m.add_argument("--window", type=nonnegative_int, default=None, help="exact local keys (0: pure linear attention)")
    m.add_argument("--sinks", type=nonnegative_int, default=None, help="attention sinks (needs --window)")
    m.add_argument("--cache", type=nonnegative_int, default=None,
                   help="far keys kept exact, the ones the state recalls worst (needs --window)")
    m.add_argument("--decay", type=decay_arg, default=None, metavar="DECAY",
                   help="decay of the far state: a number in (0, 1] (1: none), 'head' (learned per head) or 'input' "
                        "(from the value)")
    m.add_argument("--state", choices=("additive", "delta"), default=None,
                   help="the far state: additive sums (default) or the delta rule")
    m.add_argument("--beta", choices=("head", "input"), default=None,
                   help="the delta rule's write strength: learned per head (default) or from the value")
    m.add_argument("--qk-conv", type=nonnegative_int, default=None, metavar="K",
                   help="a causal depthwise convolution of width K on q and k before the attention (0: none; "
                        "4 in DeltaNet), started as the identity")
    k.add_argument("--init", nargs="+", default=None, metavar="INIT",
                   help="llops initialisation: 'random' (default), 'based', or 'theta FILE' (an exported Θ); it "
                        "picks the defaults of --affine, --non-negative and --m (a resumed run keeps its own)")
    k.add_argument("--init-from", default=None, metavar="DIR",
                   help="copy every non-attention weight from this model checkpoint (e.g. a trained softmax or "
                        "BASED model) before --init")
    t = cmd.add_argument_group("task and model")
    t.add_argument("--vocab-size", type=positive_int, default=65,
                   help="MQAR vocabulary: filler token 0, keys and values (at least 2 · num-pairs + 1; default 65)")
    t.add_argument("--num-pairs", type=positive_int, default=8, help="key-value pairs per sequence (default 8)")
    t.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default 64)")
    t.add_argument("--num-queries", type=positive_int, default=None, help="queries per sequence (default: every key)")
    t.add_argument("--d-model", type=positive_int, default=64, help="model width (default 64)")
    t.add_argument("--n-heads", type=positive_int, default=4, help="attention heads per layer (default 4)")
    t.add_argument("--n-layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    t.add_argument("--mlp-ratio", type=positive_int, default=2, help="MLP hidden width over d-model (default 2)")
    t.add_argument("--short-conv", type=nonnegative_int, default=2,
                   help="width of the causal depthwise convolution before attention (0: none; default 2)")
    o = cmd.add_argument_group("optimisation")
    o.add_argument("--steps", type=positive_int, default=300, help="training steps (default 300)")
    o.add_argument("--batch-size", type=positive_int, default=32, help="global batch (sequences per step)")
    o.add_argument("--lr", type=positive_float, default=3e-3,
                   help="AdamW peak learning rate (linear warm-up, then cosine decay; default 3e-3)")
    o.add_argument("--weight-decay", type=nonnegative_float, default=0.0,
                   help="AdamW weight decay of the weight matrices (not of embeddings, norms, biases or the attention "
                        "kernels' parameters; default 0)")
    o.add_argument("--kernel-lr", type=positive_float, default=0.1,
                   help="learning-rate factor of the attention kernels' parameters (LLoPS's Θ); at 1 Θ trained from "
                        "BASED loses its non-negative kernel before recall is learned; default 0.1)")
    o.add_argument("--warmup", type=nonnegative_int, default=30, help="linear learning-rate warm-up steps (default 30)")
    o.add_argument("--clip", type=positive_float, default=1.0, help="gradient-norm clipping threshold (default 1)")
    o.add_argument("--seed", type=seed_arg, default=0, help="model initialisation and data stream (0 to 2**62)")
    o.add_argument("--eval-every", type=nonnegative_int, default=50, help="held-out evaluation every N steps (0: at the end)")
    o.add_argument("--eval-sequences", type=positive_int, default=256,
                   help="held-out sequences per evaluation (default 256)")
    o.add_argument("--checkpoint-every", type=positive_int, default=100,
                   help="steps between resumable checkpoints (default 100)")
    o.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda or cuda:N (one this machine has)")
    o.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (fixed for determinism)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def _attention_options(args) -> dict:
    names = ("p", "m", "rank", "non_negative", "affine", "normalize", "form", "dim", "backend", "window", "sinks",
             "cache", "decay", "state", "beta", "qk_conv")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _stored_run(out: Path, attention: str) -> tuple[dict, str | None] | None:
    """The run in ``out`` (its newest checkpoint's ``state.json``): its completed attention options and
    its llops ``--init`` (``None`` when not recorded), or ``None`` when there is none of ``attention``
    that this version can read (the resume then names the problem)."""
    from ..tasks import TransformerConfig
    from ..tasks.train import latest_checkpoint

    found = latest_checkpoint(out)
    if found is None:
        return None
    try:
        identity = json.loads((found / "state.json").read_text())["identity"]
        model = identity["model"]
        if model["attention"] != attention:
            return None
        init = (identity.get("run_info") or {}).get("init")
        # completed: an option added since takes its default
        return TransformerConfig(**model).attention_options, init.get("init") if isinstance(init, dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def with_llops_defaults(args, stored: dict | None = None):
    """``args`` with the ``--attention llops`` options not given filled in (a copy; other kernels as given).

    Each of ``affine``, ``non_negative``, ``p``, ``m`` left ``None`` takes ``stored[name]`` (a resumed
    run's own options, :func:`_stored_run`) or else :func:`llops_defaults` of ``--init`` (with
    ``--init based --affine`` the default ``m`` is ``1 + d' + d'²``: step 0 is then the model
    ``--attention based`` builds by default, its Taylor map). Raises :class:`UsageError` for
    ``--affine`` on another kernel, and for a new run of ``--init based --affine --non-negative``
    (BASED's Taylor map, self-tensored, is no BASED model; a resumed run's stored identity decides
    instead: another ``--init`` than the run's is refused there, naming it).
    """
    filled = argparse.Namespace(**vars(args))
    if args.attention != "llops":
        if args.affine is not None:
            raise UsageError(f"--affine/--no-affine apply to --attention llops only, got --attention {args.attention}")
        return filled
    init, _ = _parse_init(args.init, args.attention)
    for name, default in LLOPS_DEFAULTS[init].items():
        if getattr(args, name) is None:
            setattr(filled, name, stored[name] if stored is not None else default)
    if args.m is None and stored is None:
        filled.m = llops_defaults(filled, init)["m"]
    if init == "based" and filled.affine and filled.non_negative and stored is None:  # a resume: its identity decides
        raise UsageError("--init based with --affine is BASED's Taylor map 1 + s + s²/2, and --non-negative would "
                         "square its kernel (no BASED model): add --no-non-negative, or --no-affine for BASED's "
                         "expand map")
    return filled


def llops_defaults(args, init: str) -> dict:
    """:data:`LLOPS_DEFAULTS` of ``init`` for a run of ``args`` (its ``affine``, ``d_model``, ``n_heads``):
    with ``--init based`` and ``affine`` the default ``m`` is ``1 + d' + d'²``, ``d' = min(16, D)``, BASED's
    Taylor map as ``--attention based`` builds it."""
    out = dict(LLOPS_DEFAULTS[init])
    if init == "based" and args.affine:
        dim = min(16, args.d_model // args.n_heads)
        out["m"] = 1 + dim + dim * dim
    return out


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


def _check_run_dir(out: Path) -> None:
    """Refuse an ``--out`` that holds something other than a ``sketchlab train`` run (see :data:`RUN_FILES`)."""
    names = check_run_dir(out, command="train", known=RUN_FILES)
    if "model.safetensors" in names and not (out / "train.json").is_file():
        raise ValueError(f"--out {str(out)!r} holds a model (model.safetensors) that no sketchlab train run wrote "
                         "there: training would replace it; choose an empty or new directory")
    if (out / "train.json").is_file() and not (out / "checkpoints").is_dir():
        raise ValueError(f"--out {str(out)!r} holds a finished run without its checkpoints, so this run can neither "
                         "resume it nor tell whether it is the same: choose an empty or new directory")


def build_model(args):
    """The model of ``args`` (config, seed, ``--init-from``, ``--init``; the llops options as
    :func:`with_llops_defaults` fills them) and its ``run_info``."""
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

    out = Path(args.out)
    init, theta_file = _parse_init(args.init, args.attention)
    stored, stored_init = _stored_run(out, args.attention) or (None, None)
    if stored_init is not None and stored_init != init:  # before the defaults, which follow --init
        raise UsageError(f"--out {str(out)!r} holds a run started with --init {stored_init}, not --init {init}: "
                         f"resume it with --init {stored_init}, or choose an empty or new directory")
    given, args = args, with_llops_defaults(args, stored)
    kept = {} if stored is None or args.attention != "llops" else {
        name: stored[name] for name, default in llops_defaults(args, init).items()
        if getattr(given, name) is None and stored[name] != default}
    if kept and os.environ.get("RANK", "0") == "0":  # say it once under torchrun
        print(f"train: {out} holds a run of {', '.join(f'{k}={json.dumps(v)}' for k, v in kept.items())}: "
              "resuming it with those (options not given keep the run's own values)", file=sys.stderr)
    outputs = Outputs({}, directories={"--out": args.out}, inputs=[args.init_from, theta_file])
    _check_run_dir(out)
    need, budget = estimate_bytes(args), memory_budget()
    if need > budget:
        raise ValueError(
            f"train: the model and one batch need about {need / 2**30:.3g} GiB (vocab_size={args.vocab_size}, "
            f"seq_len={args.seq_len}, batch_size={args.batch_size}, d_model={args.d_model}, n_layers={args.n_layers}),"
            f" over the memory budget of {budget / 2**30:.3g} GiB (half of this machine's memory): lower --seq-len, "
            "--batch-size, --vocab-size or --d-model"
        )
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=args.device.startswith("cuda"))
    rank, world = init_distributed(args.device)
    try:
        task = MQARConfig(args.vocab_size, args.num_pairs, args.seq_len, args.num_queries)
        model, run_info = build_model(args)
        device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device.startswith("cuda") else "cpu")
        model.to(device)
        outputs.make_directories()
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
            outputs.announce(*(out / name for name in ("model.safetensors", "config.json", "train.json")))
            print(f"{out}: {args.attention} held-out accuracy {result.heldout_accuracy:.4f} after {result.steps} "
                  f"steps (world size {world}, {result.seconds:.0f}s"
                  f"{'' if result.resumed_from is None else f', resumed from step {result.resumed_from}'})")
    finally:
        import torch.distributed as dist

        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0
