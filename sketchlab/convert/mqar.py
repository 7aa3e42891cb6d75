r"""The toy MQAR checkpoint family of :func:`sketchlab.linearize`: a trained softmax
:class:`~sketchlab.tasks.TransformerLM` directory made a native ``llops`` model with fitted LLoPS Θ.

:func:`linearize_checkpoint` (reached through ``sketchlab.linearize(PATH, out=..., ...)``;
``sketchlab linearize CHECKPOINT`` on the shell): (1) capture ``q, k, v [L, H, n, D]`` from the
checkpoint on ``capture_sequences`` MQAR sequences of their own seed stream (:func:`sketchlab.capture_qk`);
(2) fit LLoPS per layer and head to the polynomial kernel of the inputs the attention sees,
``x · D^{-1/4}`` (``"sqrt-d"``: a polynomial in ``qᵀk/√D``), a quarter of the tokens held out; (3) export Θ
(:func:`sketchlab.export_theta`); (4) the same model with ``llops`` attention, the teacher's other weights
(:func:`~sketchlab.tasks.copy_shared_weights`) and Θ (:func:`~sketchlab.tasks.init_llops`); (5) evaluate
it at step 0 beside the teacher and exact polynomial attention, with each layer's attention error on the
captured inputs (:func:`~sketchlab.convert.evaluate.attention_errors`); (6) fine-tune ``steps`` steps
(next-token loss plus ``transfer ×`` the attention-transfer loss
:func:`~sketchlab.convert.transfer.transfer_loss` of every layer against softmax attention), resumable
(:func:`~sketchlab.tasks.train_mqar`); (7) evaluate again and write the summary.

Unlike the model family (a :class:`torch.nn.Module` given to :func:`sketchlab.linearize`, converted in
place to sketched attention and trained stage by stage on text), this family builds a *native* ``llops``
model trained end to end on its task, saved as a checkpoint, with the Θ export and MQAR accuracy.

Written under ``out``, all-or-nothing (:func:`sketchlab.io.staged_directory`): ``capture.safetensors``,
``theta.safetensors``, ``model/`` (``model.safetensors`` + ``config.json``), ``linearize.json`` and
``linearize.md``; and ``finetune/``, the fine-tuning's resumable checkpoints, written as they come.

With ``non_negative=True`` (even ``p``) the map is self-tensored, ``φ ⊗ φ``: Θ of degree ``p/2``
is fitted to the kernel ``(qᵀk/√D)^{p/2}`` and its self-tensor has degree ``p`` and ``m²`` features.

References
----------
Zhang et al. *LoLCATs: On Low-Rank Linearizing of Large Language Models*, 2024 (attention transfer).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .._validation import check_nonnegative_int, check_positive_int, check_real
from ..io.atomic import write_text_atomic as _write_text
from ..tasks.attention import input_scale, kernel_modules
from ..tasks.inits import copy_shared_weights, init_llops
from ..tasks.model import TransformerConfig, TransformerLM
from ..tasks.mqar import MQARConfig, mqar_batch
from ..tasks.train import (
    _check_seed,
    check_evaluation_work,
    evaluate_mqar,
    load_checkpoint,
    save_checkpoint,
    train_mqar,
)
from .evaluate import attention_errors
from .teacher import LayerIO
from .transfer import transfer_loss

__all__ = ["CheckpointReport", "linearize_checkpoint"]

_CAPTURE_OFFSET = 2_000_003  # captured sequences come from their own stream (neither train nor held-out)


@dataclass
class CheckpointReport:
    """Outcome of :func:`linearize_checkpoint` (also written to ``out/linearize.json``).

    ``teacher_accuracy``, ``step0_accuracy``, ``final_accuracy``: held-out MQAR accuracy of the
    softmax checkpoint, of the linearised model before and after fine-tuning (same sequences).
    ``attention_error``: per layer, ``‖o_llops − o_softmax‖_F / ‖o_softmax‖_F`` on the captured inputs
    at step 0; ``poly_attention_error`` and ``poly_accuracy``: the same error, and the step-0
    accuracy, of *exact* polynomial attention ``(qᵀk/√D)^p`` with the teacher's weights, which
    separates the gap between a degree-``p`` kernel and softmax from the sketch's own error. ``fit``: the LLoPS fit report (per layer and head errors against the polynomial
    kernel, in-sample and held-out). ``losses``/``evals``: the fine-tuning curve.
    """

    teacher_accuracy: float
    step0_accuracy: float
    final_accuracy: float
    attention_error: list[float]
    poly_accuracy: float
    poly_attention_error: list[float]
    fit: dict
    steps: int
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


def _transfer_hooks(model: TransformerLM):
    r"""Hooks that measure the attention-transfer loss of every layer of ``model``; returns ``(loss_fn, remove)``.

    After each forward pass, ``loss_fn()`` returns the mean over layers of
    :func:`~sketchlab.convert.transfer.transfer_loss` ``(o_ℓ, softmax_attention(q_ℓ, k_ℓ, v_ℓ))``, where
    ``o_ℓ`` is layer ℓ's kernel output and ``q_ℓ, k_ℓ, v_ℓ`` ``[B, T, H, D]`` its inputs (the softmax
    target is computed without gradient: it teaches the feature map, it is not trained itself), and
    forgets the stored terms. ``remove()`` detaches the hooks.
    """
    from ..attention import softmax_attention

    terms: list[torch.Tensor] = []

    def hook(module, args, output):
        q, k, v = args[:3]
        with torch.no_grad():
            target = softmax_attention(q, k, v, causal=True)  # [B, T, H, D], logits qᵀk/√D
        terms.append(transfer_loss(output, target))

    handles = [kernel.register_forward_hook(hook) for kernel in kernel_modules(model)]

    def loss_fn() -> torch.Tensor:
        if not terms:
            raise RuntimeError("attention transfer loss: no forward pass since the last call")
        loss = torch.stack(terms).mean()
        terms.clear()
        return loss

    def remove() -> None:
        for h in handles:
            h.remove()

    return loss_fn, remove


def _captured_layers(q, k, v, batch: int) -> list[LayerIO]:
    """The captured ``q, k, v [L, H, n, D]`` (``n = batch · T``: ``batch`` sequences joined along the token
    axis) as one :class:`~sketchlab.convert.teacher.LayerIO` per layer, ``[batch, T, H, D]``, its output the
    float64 of causal softmax attention on them (the reference of :func:`attention_errors`)."""
    from .._validation import check_memory
    from ..attention import softmax_attention

    L, H, n, D = q.shape
    T = n // batch
    check_memory(8 * batch * H * T * T, what=f"the softmax scores of the captured sequences ([{batch}, {H}, {T}, {T}] "
                 "float64)", way_out="capture fewer or shorter sequences")
    layers = []
    with torch.no_grad():
        for layer in range(L):
            x = [t[layer].permute(1, 0, 2).reshape(batch, T, H, D) for t in (q, k, v)]  # [B, T, H, D]
            layers.append(LayerIO(*x, out=softmax_attention(*x, causal=True).double(), scaling=D ** -0.5))
    return layers


def _captured_attention_errors(model: TransformerLM, layers: list[LayerIO]) -> list[float]:
    """Per layer ``‖kernel(q, k, v) − softmax(q, k, v)‖_F / ‖softmax‖_F`` on the captured ``layers``
    (:func:`attention_errors`, every token valid; the toy kernels take no scaling or padding mask:
    their scale is their own, ``1/√D``)."""
    kernels = [lambda q, k, v, scaling, key_padding_mask, kernel=kernel: kernel(q, k, v)
               for kernel in kernel_modules(model)]
    batch, T = layers[0].q.shape[:2]
    return attention_errors(kernels, layers, torch.ones(batch, T), slice(None), batch_size=batch)


def linearize_checkpoint(
    checkpoint,
    *,
    p: int = 2,
    m: int = 64,
    out,
    rank: int = 1,
    non_negative: bool = False,
    normalize: str = "sum",
    capture_sequences: int = 4,
    holdout: float = 0.25,
    steps: int = 100,
    batch_size: int = 32,
    lr: float = 1e-3,
    warmup: int = 10,
    transfer: float = 0.0,
    eval_sequences: int = 512,
    eval_every: int = 0,
    seed: int = 0,
    progress: bool = True,
) -> CheckpointReport:
    """Linearise the softmax model in ``checkpoint`` with fitted LLoPS attention (module docstring).

    Parameters
    ----------
    checkpoint : str or Path
        A :func:`~sketchlab.tasks.save_checkpoint` directory of a ``"softmax"`` model whose
        ``config.json`` records its MQAR ``task`` (as ``analysis/train_mqar.py`` writes).
    p, m, rank : int
        Degree of the attention kernel, features and CP rank of Θ (with ``non_negative``, Θ has
        degree ``p/2`` and the attention ``m²`` features).
    out : str or Path
        Output directory (created; its parent must exist). Everything but the fine-tuning
        checkpoints ``out/finetune`` appears there at the end, together (module docstring).
    non_negative : bool
        Self-tensored features (needs even ``p``).
    normalize : {"sum", "none"}
        Attention normalisation of the linearised model.
    capture_sequences : int
        Task sequences captured and joined along the token axis for the fit.
    holdout : float in [0, 1)
        Fraction of captured tokens held out of the fit (their error is reported).
    steps : int >= 0
        Fine-tuning steps (``0``: step 0 only).
    batch_size, lr, warmup, eval_every
        Fine-tuning settings (:func:`~sketchlab.tasks.train_mqar`).
    transfer : float >= 0
        Weight of the attention-transfer loss (the mean over layers of
        :func:`~sketchlab.convert.transfer.transfer_loss` against softmax attention); ``0`` = plain
        next-token loss.
    eval_sequences : int
        Held-out sequences for every accuracy (teacher, step 0, final).
    seed : int in [0, 2**64 - 2_000_003)
        Capture stream (``seed + 2_000_003``), fit seed, held-out and fine-tuning data streams.

    Returns
    -------
    CheckpointReport
    """
    from ..io import staged_directory

    p, m, rank = check_positive_int(p, "p"), check_positive_int(m, "m"), check_positive_int(rank, "rank")
    if not isinstance(non_negative, bool):
        raise TypeError(f"non_negative must be a bool, got {non_negative!r}")
    if non_negative and p % 2:
        raise ValueError(f"non_negative=True needs an even p (Θ of degree p/2, self-tensored), got p={p}")
    capture_sequences = check_positive_int(capture_sequences, "capture_sequences")
    steps = check_nonnegative_int(steps, "steps")
    transfer = check_real(transfer, "transfer", positive=False)
    eval_sequences = check_positive_int(eval_sequences, "eval_sequences")
    seed = _check_seed(seed)
    if seed + _CAPTURE_OFFSET >= 2**64:
        raise ValueError(f"seed must be below 2**64 - {_CAPTURE_OFFSET} (the captured sequences come from the stream "
                         f"seed + {_CAPTURE_OFFSET}, a 64-bit generator seed), got {seed}")
    out = Path(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"output directory's parent {str(out.parent)!r} does not exist (for out={str(out)!r})")
    teacher, extra = load_checkpoint(checkpoint)
    if teacher.config.attention != "softmax":
        raise ValueError(f"checkpoint {checkpoint}: linearize takes a softmax model, got attention "
                         f"{teacher.config.attention!r}")
    try:
        task = MQARConfig(**extra["task"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"checkpoint {checkpoint}: config.json has no MQAR task in extra.task ({err}); "
                         "it is needed to capture the model's own task data") from err
    check_evaluation_work(teacher, [task], eval_sequences)  # the teacher's and the student's, before any work
    cfg = teacher.config
    p_theta = p // 2 if non_negative else p
    student_cfg = TransformerConfig(**{**cfg.to_dict(), "attention": "llops", "attention_options": {
        "p": p_theta, "m": m, "rank": rank, "non_negative": non_negative, "normalize": normalize}})
    with staged_directory(out, last=("linearize.json",)) as stage:
        return _linearize(teacher, checkpoint, task, student_cfg, stage, out, p=p, m=m, rank=rank,
                          non_negative=non_negative, normalize=normalize, capture_sequences=capture_sequences,
                          holdout=holdout, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, transfer=transfer,
                          eval_sequences=eval_sequences, eval_every=eval_every, seed=seed, progress=progress)


def _linearize(teacher, checkpoint, task, student_cfg, stage: Path, out: Path, *, p, m, rank, non_negative, normalize,
               capture_sequences, holdout, steps, batch_size, lr, warmup, transfer, eval_sequences, eval_every, seed,
               progress) -> CheckpointReport:
    """:func:`linearize_checkpoint` after its checks: every file into ``stage`` but the checkpoints (``out/finetune``)."""
    from ..capture import capture_qk
    from ..export import export_theta
    from ..fit import fit_sketch

    cfg = teacher.config
    D = cfg.head_dim
    p_theta = p // 2 if non_negative else p
    seconds: dict = {}

    # 1. capture
    t0 = time.perf_counter()
    tokens, _ = mqar_batch(task, capture_sequences, generator=torch.Generator().manual_seed(seed + _CAPTURE_OFFSET))
    capture_path = stage / "capture.safetensors"
    dump = capture_qk(teacher, tokens, path=capture_path, meta={
        "source": f"sketchlab linearize: {checkpoint}", "task": json.dumps(task.to_dict(), sort_keys=True),
        "input_ids": json.dumps(tokens.tolist())})
    seconds["capture"] = time.perf_counter() - t0

    # 2. fit, on the inputs the attention sees: x · D^{-1/4}
    t0 = time.perf_counter()
    s = input_scale(D)
    q64, k64 = (x.to(torch.float64) * s for x in (dump.q, dump.k))  # [L, H, n, D]
    fit = fit_sketch("llops", q64, k64, p=p_theta, m=m, rank=rank, seed=seed, holdout=holdout,
                     progress=progress)
    seconds["fit"] = time.perf_counter() - t0
    report = fit.report.as_dict()

    # 3. export (every metadata field from the fit and the capture file)
    theta_path = export_theta(fit, stage / "theta.safetensors", dump=capture_path, scale="sqrt-d")

    # 4. the linearised model
    torch.manual_seed(seed)
    student = TransformerLM(student_cfg)
    copy_shared_weights(teacher, student)
    init_info = init_llops(student, "theta", theta_path)
    init_info["file"] = str(out / "theta.safetensors")  # where it will be, not the staging directory's random name
    # the export's bytes carry the fit's wall time; the run identity (resume check) keeps Θ's values only
    init_info.pop("sha256")
    theta_bytes = b"".join(kernel.theta_q.detach().numpy().tobytes() + kernel.theta_k.detach().numpy().tobytes()
                           for kernel in kernel_modules(student))
    init_info["theta_sha256"] = hashlib.sha256(theta_bytes).hexdigest()
    student.eval()

    # 5. step 0
    t0 = time.perf_counter()
    teacher_acc = evaluate_mqar(teacher, task, num_sequences=eval_sequences, seed=seed)
    step0_acc = evaluate_mqar(student, task, num_sequences=eval_sequences, seed=seed)
    captured = _captured_layers(dump.q, dump.k, dump.v, capture_sequences)
    att_err = _captured_attention_errors(student, captured)
    poly = TransformerLM(TransformerConfig(**{**cfg.to_dict(), "attention": "poly",
                                              "attention_options": {"p": p, "normalize": normalize}}))
    copy_shared_weights(teacher, poly)
    poly_acc = evaluate_mqar(poly, task, num_sequences=eval_sequences, seed=seed)
    poly_err = _captured_attention_errors(poly, captured)
    seconds["evaluate_step0"] = time.perf_counter() - t0

    # 6. fine-tune
    final_acc, losses, evals = step0_acc, [], []
    settings = {"checkpoint": str(checkpoint), "p": p, "m": m, "rank": rank, "non_negative": non_negative,
                "normalize": normalize, "capture_sequences": capture_sequences, "holdout": holdout, "steps": steps,
                "batch_size": batch_size, "lr": lr, "warmup": warmup, "transfer": transfer,
                "eval_sequences": eval_sequences, "seed": seed, "task": task.to_dict(), "init": init_info,
                "theta_degree": p_theta, "attention_features": m * m if non_negative else m}
    if steps:
        t0 = time.perf_counter()
        remove = None
        extra_loss = None
        if transfer > 0:
            loss_fn, remove = _transfer_hooks(student)
            extra_loss = lambda: transfer * loss_fn()  # noqa: E731
        try:
            result = train_mqar(student, [(task, steps)], batch_size=batch_size, lr=lr, weight_decay=0.0,
                                warmup=warmup, seed=seed, eval_sequences=eval_sequences, eval_every=eval_every,
                                out=out / "finetune", run_info={"linearize": settings}, extra_loss=extra_loss,
                                progress=progress)
        finally:
            if remove is not None:
                remove()
        final_acc, losses, evals = result.heldout_accuracy, result.losses, result.evals
        seconds["finetune"] = time.perf_counter() - t0
    save_checkpoint(stage / "model", student, extra={"task": task.to_dict(), "heldout_accuracy": final_acc,
                                                   "linearize": settings})

    res = CheckpointReport(teacher_accuracy=teacher_acc, step0_accuracy=step0_acc, final_accuracy=final_acc,
                          attention_error=att_err, poly_accuracy=poly_acc, poly_attention_error=poly_err, fit=report, steps=steps, losses=losses, evals=evals,
                          settings=settings, seconds=seconds)
    _write_text(stage / "linearize.json", json.dumps(asdict(res), indent=1, sort_keys=True) + "\n")
    _write_text(stage / "linearize.md", _markdown(res))
    return res


def _median(values) -> float:
    flat = torch.tensor(values, dtype=torch.float64).flatten()
    return float(flat.median())


def _markdown(res: CheckpointReport) -> str:
    s, f = res.settings, res.fit
    holdout = "–" if f.get("holdout_rel_fro") is None else f"{_median(f['holdout_rel_fro']):.4f}"
    transfer = f" (attention transfer × {s['transfer']})" if s["transfer"] else ""
    lines = [
        f"# Linearised {s['checkpoint']}: LLoPS p={s['p']}, m={s['m']}, rank {s['rank']}"
        f"{' (self-tensored)' if s['non_negative'] else ''}",
        "",
        f"Task: MQAR {s['task']}; {s['eval_sequences']} held-out sequences for every accuracy.",
        "",
        "| model | held-out accuracy |",
        "|---|---|",
        f"| softmax teacher | {res.teacher_accuracy:.4f} |",
        f"| exact polynomial attention (qᵀk/√D)^{s['p']}, teacher's weights (reference, not sketched) | "
        f"{res.poly_accuracy:.4f} |",
        f"| LLoPS, step 0 (fitted Θ, teacher's other weights) | {res.step0_accuracy:.4f} |",
        f"| LLoPS, after {res.steps} fine-tuning steps{transfer} | {res.final_accuracy:.4f} |",
        "",
        f"Fit (per layer and head, kernel (qᵀk/√D)^{s['theta_degree']}): median rel_fro {_median(f['rel_fro']):.4f} "
        f"in-sample, {holdout} held-out; median optimality ratio {_median(f['optimality_ratio']):.3f}.",
        "",
        "Attention output error at step 0 against the teacher's softmax attention on the captured inputs "
        "(‖o_llops − o_softmax‖/‖o_softmax‖): "
        + ", ".join(f"layer {i}: {e:.3f}" for i, e in enumerate(res.attention_error))
        + "; exact polynomial attention of the same degree: "
        + ", ".join(f"layer {i}: {e:.3f}" for i, e in enumerate(res.poly_attention_error)) + ".",
        "",
        "Seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in res.seconds.items()) + ".",
        "",
    ]
    return "\n".join(lines)
