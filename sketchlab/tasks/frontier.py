r"""Zoology's recall frontier: MQAR accuracy against state bytes per layer, for every method at several sizes.

A *point* is a method at one size (:class:`Point`: the toy model's attention, options and heads); a *run* is
a point trained at one learning rate and seed (:func:`train_point`) and scored on held-out test slices. The
grid (:func:`run_frontier`) is, per point, Zoology's learning-rate sweep on the first seed, then the other
seeds at the sweep's best rate. Every run is cached in ``work`` as one JSON file named by a hash of all its
settings (:func:`run_key`), written atomically when it finishes: a grid started again trains only what is
missing (Ctrl-C loses no finished run), and :func:`frontier_report` rebuilds the report from the cached runs
alone.

Protocol (:class:`Protocol`; Zoology's ``arxiv24_based_figure2`` at :data:`ZOOLOGY`, a CPU cut at
:data:`CPU`): the ``"zoology"`` MQAR layout (keys from ``[1, V/2)``, values from ``[V/2, V)``, power-law query
gaps, random tokens between queries) trained on a mixture of ``(T, P)`` with weights 5:1:1:1:1, tested on
those and longer slices (4x the longest training length); a 2-layer :class:`~sketchlab.tasks.TransformerLM`
with a short convolution and no positional encoding; AdamW, weight decay 0.1, linear warm-up then cosine,
clip 1. A run's *score* is the mean of its slices' accuracies, every slice weighted equally.

Methods (:data:`METHODS`), each sized by its state (:func:`~sketchlab.tasks.state_size.layer_state_bytes`):

* ``softmax`` (the harness check; its KV cache at the longest test length), ``window`` (``w`` keys);
* ``based`` (Taylor map on a ``d'``-dimensional projection: ``1 + d' + d'²`` features), ``hedgehog`` (``m``),
  ``dpfp`` (``2·D`` features per head, sized by the heads), ``psf-learned`` (``m`` self-tensored);
* ``llops`` (the affine self-tensored form: ``m²`` features of ``[x, 1]``, ``p = 2``, random start);
  ``llops-p{2,4,6}`` (homogeneous, ``m`` features, random start) and ``llops-p4-based`` (from BASED's
  expand map): the paper's Tables 4-5 forms; their ablation (kernel harness): ``llops-p4-based-frozen``,
  ``-lr001``, ``-lr1`` (that start with Θ frozen, at 0.01 or 1 times the rate), ``llops-p4-frozen``,
  ``llops-p4-lr1`` (random start), ``llops-taylor`` (affine, ``p = 2``, Θ started at BASED's Taylor map
  ``1 + s + s²/2``, so step 0 is ``based`` at ``d'`` with ``m = 1 + d' + d'²``), ``llops-taylor-lr001`` and
  ``llops-taylor-frozen``;
* ``deltanet`` (SiLU features, L2-normalised q/k, β from the input, the short convolution; state
  ``D × D`` per head, sized by the heads), ``gated-deltanet`` (the same with a decay from the input),
  ``llops-delta`` (the affine self-tensored LLoPS features under the delta rule); ``llops-gated-delta``,
  ``psf-learned-gated-delta`` (those LLoPS features, PSF-learned's ``m``, under the gated delta rule: β and
  the decay from the input; state ``features × D``).

References
----------
Arora et al. *Zoology: Measuring and Improving Recall in Efficient Language Models*, ICLR 2024; Arora et al.
*Simple linear attention language models balance the recall-throughput tradeoff*, ICML 2024.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._validation import check_positive_int
from ..io.atomic import atomic_write, write_text_atomic
from . import mixers  # noqa: F401  (registers "sliding-window" and "silu")
from .model import TransformerConfig
from .mqar import (
    ZOOLOGY_TEST,
    ZOOLOGY_TRAIN,
    ZOOLOGY_TRAIN_WEIGHTS,
    zoology_mixture,
    zoology_tests,
)
from .state_size import layer_state_bytes

__all__ = [
    "CPU",
    "KERNEL_CPU",
    "KernelProtocol",
    "METHODS",
    "ZOOLOGY",
    "Point",
    "Protocol",
    "frontier_report",
    "frontier_summary",
    "load_runs",
    "method_points",
    "plan_runs",
    "run_frontier",
    "run_key",
    "train_point",
]


@dataclass(frozen=True)
class Protocol:
    """The task, model and training settings every run of a frontier shares.

    ``train_pairs``/``test_pairs``: ``(T, P)`` of the training mixture (weighted ``train_weights``) and of the
    test slices; ``d_model``: the width of every method; ``steps``, ``batch``, ``warmup``: the schedule;
    ``eval_sequences``: held-out sequences per slice; ``random_non_queries``: Zoology's random tokens between the
    queries (its default, :data:`ZOOLOGY`), or ``False``, the filler 0 (Zoology's option of that name; the CPU
    cut's: with random tokens every one of them writes into a delta-rule state, which then stays at chance at
    CPU budgets, ``analysis/results/delta_diagnosis.md``).
    """

    vocab: int = 512
    train_pairs: tuple = tuple((T // 4, P // 4) for T, P in ZOOLOGY_TRAIN)
    train_weights: tuple = ZOOLOGY_TRAIN_WEIGHTS
    test_pairs: tuple = tuple((T // 4, P // 4) for T, P in ZOOLOGY_TEST)
    d_model: int = 64
    n_layers: int = 2
    short_conv: int = 3
    steps: int = 600
    batch: int = 32
    warmup: int = 20
    weight_decay: float = 0.1
    eval_sequences: int = 64
    random_non_queries: bool = False

    def __post_init__(self):
        for name in ("vocab", "d_model", "n_layers", "steps", "batch", "eval_sequences"):
            check_positive_int(getattr(self, name), name)
        object.__setattr__(self, "train_pairs", tuple(tuple(p) for p in self.train_pairs))
        object.__setattr__(self, "test_pairs", tuple(tuple(p) for p in self.test_pairs))
        object.__setattr__(self, "train_weights", tuple(float(w) for w in self.train_weights))
        zoology_mixture(self.vocab, pairs=self.train_pairs, weights=self.train_weights)  # refuses a bad (T, P), V
        zoology_tests(self.vocab, pairs=self.test_pairs)

    @property
    def max_len(self) -> int:
        """The longest test length (softmax's KV cache is counted there)."""
        return max(T for T, _ in self.test_pairs)


CPU = Protocol()
"""The CPU cut: Zoology's lengths and pairs divided by 4 (training T <= 64, P <= 16; tests to T = 256, P = 64),
vocabulary 512, d_model 64, 600 steps of batch 32, the filler 0 between the queries (a run takes 15-60 s on
one core)."""
ZOOLOGY = Protocol(vocab=8192, train_pairs=ZOOLOGY_TRAIN, test_pairs=ZOOLOGY_TEST, d_model=128, steps=20_000,
                   batch=256, warmup=500, eval_sequences=1000, random_non_queries=True)
"""Zoology's ``arxiv24_based_figure2`` sizes (its 32 epochs of 180k examples at batch 256 are ~22.5k steps)."""


@dataclass(frozen=True)
class KernelProtocol(Protocol):
    """The kernel-only harness (:mod:`sketchlab.tasks.recall_kernel`): Zoology's continuous MQAR, one layer of
    projections and the kernel over frozen embeddings. ``train_pairs``/``test_pairs`` are ``(T, P)`` with
    ``T = 2P`` (the pairs, then the queries); ``vocab`` the embeddings (``P <= vocab / 2``); ``n_layers`` 1;
    ``short_conv`` 0 by default (none: the harness's point; a value > 0 adds the toy block's convolution, an
    ablation); ``random_non_queries`` is unused."""

    vocab: int = 512
    train_pairs: tuple = ((8, 4), (16, 8), (32, 16), (64, 32))
    train_weights: tuple = (5.0, 1.0, 1.0, 1.0)
    test_pairs: tuple = ((8, 4), (16, 8), (32, 16), (64, 32), (128, 64), (256, 128))
    n_layers: int = 1
    short_conv: int = 0
    harness: str = "kernel"

    def __post_init__(self):
        for name in ("vocab", "d_model", "steps", "batch", "eval_sequences"):
            check_positive_int(getattr(self, name), name)
        if self.n_layers != 1 or self.harness != "kernel":
            raise ValueError(f"the kernel-only harness has n_layers=1 and harness='kernel', got {self.n_layers} and "
                             f"{self.harness!r}")
        object.__setattr__(self, "train_pairs", tuple(tuple(p) for p in self.train_pairs))
        object.__setattr__(self, "test_pairs", tuple(tuple(p) for p in self.test_pairs))
        object.__setattr__(self, "train_weights", tuple(float(w) for w in self.train_weights))
        for name in ("train_pairs", "test_pairs"):
            pairs = getattr(self, name)
            bad = [(T, P) for T, P in pairs if isinstance(P, bool) or not isinstance(P, int) or not 1 <= P <= self.vocab // 2
                   or T != 2 * P]
            if not pairs or bad:
                raise ValueError(f"{name} must be (T, P) pairs with T = 2P and 1 <= P <= vocab/2 = {self.vocab // 2}, "
                                 f"got {list(bad) or list(pairs)}")
        if len(self.train_weights) != len(self.train_pairs) or not all(w > 0 for w in self.train_weights):
            raise ValueError(f"train_weights must be one weight > 0 per training pair, got {self.train_weights}")


KERNEL_CPU = KernelProtocol()
"""The kernel-only harness on the CPU: Zoology's ``mqar_continuous`` pairs (P = 4 … 64 for training, to 256 for the
tests) cut at P = 32 and 128, vocabulary 512 (256 keys), d_model 64, 600 steps of batch 32."""


@dataclass(frozen=True)
class Point:
    """One method at one size: the toy model's ``attention``, ``options`` and ``heads``; ``init`` of LLoPS's Θ
    (:func:`~sketchlab.tasks.init_llops`), ``kernel_lr`` the kernel parameters' rate factor (0: the kernel frozen,
    the kernel-only harness only)."""

    method: str
    size: str
    attention: str
    options: dict = field(default_factory=dict)
    heads: int = 1
    init: str | None = None
    kernel_lr: float = 1.0

    def config(self, protocol: Protocol) -> TransformerConfig:
        """The model of this point under ``protocol`` (NoPE, mlp ratio 2)."""
        return TransformerConfig(vocab_size=protocol.vocab, d_model=protocol.d_model, n_heads=self.heads,
                                 n_layers=protocol.n_layers, mlp_ratio=2, short_conv=protocol.short_conv,
                                 attention=self.attention, attention_options=dict(self.options), rope_base=None)


_LLOPS_NN = {"p": 2, "non_negative": True, "affine": True}
_DELTANET = {"state": "delta", "beta": "input"}

#: Method -> its sizes (the knob's values) and how a size becomes a :class:`Point`.
METHODS = {
    "softmax": ((0,), lambda s: Point("softmax", "full", "softmax")),
    "window": ((4, 8, 16, 32), lambda w: Point("window", f"w={w}", "sliding-window", {"window": w})),
    "based": ((4, 8, 12, 16), lambda f: Point("based", f"d'={f}", "based-taylor", {"dim": f})),
    "hedgehog": ((8, 16, 32, 64), lambda m: Point("hedgehog", f"m={m}", "hedgehog", {"m": m})),
    "dpfp": ((8, 4, 2, 1), lambda h: Point("dpfp", f"H={h}", "dpfp", {"nu": 1}, heads=h)),
    "psf-learned": ((16, 36, 64, 144), lambda m: Point("psf-learned", f"m={m}", "psf-learned", {"p": 4, "m": m})),
    "llops": ((4, 8, 12, 16), lambda m: Point("llops", f"m={m}x{m}", "llops", {**_LLOPS_NN, "m": m}, init="random",
                                              kernel_lr=0.1)),
    "llops-p2": ((16, 64, 144, 256), lambda m: Point("llops-p2", f"m={m}", "llops", {"p": 2, "m": m}, init="random",
                                                     kernel_lr=0.1)),
    "llops-p4": ((16, 64, 144, 256), lambda m: Point("llops-p4", f"m={m}", "llops", {"p": 4, "m": m}, init="random",
                                                     kernel_lr=0.1)),
    "llops-p6": ((16, 64, 144, 256), lambda m: Point("llops-p6", f"m={m}", "llops", {"p": 6, "m": m}, init="random",
                                                     kernel_lr=0.1)),
    "llops-p4-based": ((16, 81, 256), lambda m: Point("llops-p4-based", f"m={m}", "llops", {"p": 4, "m": m},
                                                      init="based", kernel_lr=0.1)),
    # the ablation of llops-p4-based's shortfall (analysis/results/frontier_kernel_ablation): start, form, Θ's rate
    "llops-p4-based-frozen": ((81, 256), lambda m: Point("llops-p4-based-frozen", f"m={m}", "llops", {"p": 4, "m": m},
                                                         init="based", kernel_lr=0.0)),
    "llops-p4-based-lr001": ((81, 256), lambda m: Point("llops-p4-based-lr001", f"m={m}", "llops", {"p": 4, "m": m},
                                                        init="based", kernel_lr=0.01)),
    "llops-p4-based-lr1": ((81, 256), lambda m: Point("llops-p4-based-lr1", f"m={m}", "llops", {"p": 4, "m": m},
                                                      init="based", kernel_lr=1.0)),
    "llops-p4-frozen": ((81, 256), lambda m: Point("llops-p4-frozen", f"m={m}", "llops", {"p": 4, "m": m},
                                                   init="random", kernel_lr=0.0)),
    "llops-p4-lr1": ((81, 256), lambda m: Point("llops-p4-lr1", f"m={m}", "llops", {"p": 4, "m": m}, init="random",
                                                kernel_lr=1.0)),
    "llops-taylor": ((73, 273), lambda m: Point("llops-taylor", f"m={m}", "llops", {"p": 2, "m": m, "affine": True},
                                                init="based", kernel_lr=0.1)),
    "llops-taylor-lr001": ((73, 273), lambda m: Point("llops-taylor-lr001", f"m={m}", "llops",
                                                      {"p": 2, "m": m, "affine": True}, init="based", kernel_lr=0.01)),
    "llops-taylor-frozen": ((73, 273), lambda m: Point("llops-taylor-frozen", f"m={m}", "llops",
                                                       {"p": 2, "m": m, "affine": True}, init="based", kernel_lr=0.0)),
    "deltanet": ((8, 4, 2, 1), lambda h: Point("deltanet", f"H={h}", "silu", dict(_DELTANET), heads=h)),
    "gated-deltanet": ((8, 4, 2, 1), lambda h: Point("gated-deltanet", f"H={h}", "silu",
                                                     {**_DELTANET, "decay": "input"}, heads=h)),
    "llops-delta": ((2, 4, 6, 8), lambda m: Point("llops-delta", f"m={m}x{m}", "llops",
                                                  {**_LLOPS_NN, "m": m, **_DELTANET}, init="random", kernel_lr=0.1)),
    "llops-gated-delta": ((4, 8), lambda m: Point("llops-gated-delta", f"m={m}x{m}", "llops",
                                                  {**_LLOPS_NN, "m": m, **_DELTANET, "decay": "input"}, init="random",
                                                  kernel_lr=0.1)),
    "psf-learned-gated-delta": ((16, 64), lambda m: Point("psf-learned-gated-delta", f"m={m}", "psf-learned",
                                                          {"p": 4, "m": m, **_DELTANET, "decay": "input"})),
}


def method_points(method: str, sizes=None) -> list[Point]:
    """The points of ``method`` (a key of :data:`METHODS`) at ``sizes`` (default: its own)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    default, make = METHODS[method]
    return [make(s) for s in (default if sizes is None else sizes)]


def run_key(point: Point, protocol: Protocol, lr: float, seed: int) -> str:
    """The cache name of a run: ``<method>_<size>_lr<lr>_s<seed>_<12 hex of SHA-256 of every setting>``."""
    settings = json.dumps({"point": asdict(point), "protocol": asdict(protocol), "lr": lr, "seed": seed},
                          sort_keys=True)
    digest = hashlib.sha256(settings.encode()).hexdigest()[:12]
    size = "".join(c if c.isalnum() else "-" for c in point.size)
    return f"{point.method}_{size}_lr{lr:.0e}_s{seed}_{digest}"


def train_point(point: Point, protocol: Protocol, lr: float, seed: int) -> dict:
    """Train ``point`` at rate ``lr`` and ``seed`` under ``protocol`` (one thread); the run record.

    The record holds the settings, ``state_bytes`` (per layer), ``slices`` (``{"seq_len", "num_pairs",
    "accuracy", "queries"}`` per test slice), ``score`` (their unweighted mean; 0 when the loss diverged, with
    ``diverged`` its message) and ``seconds``. Under a :class:`KernelProtocol` the model is the kernel-only
    harness's :class:`~sketchlab.tasks.recall_kernel.RecallModel` (:func:`~sketchlab.tasks.recall_kernel.train_recall`),
    and the record adds ``attention_error``.
    """
    import torch

    from .inits import init_llops
    from .model import TransformerLM
    from .recall_kernel import RecallModel, train_recall
    from .train import train_mqar
    from .zoology import evaluate_slices

    torch.set_num_threads(1)
    config = point.config(protocol)
    torch.manual_seed(seed)
    kernel_only = isinstance(protocol, KernelProtocol)
    model = RecallModel(config, embed_seed=seed) if kernel_only else TransformerLM(config)
    if point.init is not None:
        init_llops(model, point.init, seed=seed)
    record = {"key": run_key(point, protocol, lr, seed), "point": asdict(point), "protocol": asdict(protocol),
              "lr": lr, "seed": seed, "state_bytes": layer_state_bytes(config, seq_len=protocol.max_len)}
    if kernel_only:
        t0 = time.perf_counter()
        result = train_recall(model, protocol, lr=lr, seed=seed, kernel_lr=point.kernel_lr)
        return {**record, "slices": result["slices"], "score": _score(result["slices"]),
                "attention_error": result["attention_error"], "diverged": result["diverged"],
                "seconds": time.perf_counter() - t0}
    noise = protocol.random_non_queries
    mixture = zoology_mixture(protocol.vocab, pairs=protocol.train_pairs, weights=protocol.train_weights,
                              random_non_queries=noise)
    tests = zoology_tests(protocol.vocab, pairs=protocol.test_pairs, random_non_queries=noise)
    t0 = time.perf_counter()
    diverged = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # train_mqar's per-stage line: the grid's bar reports
            train_mqar(model, [(mixture, protocol.steps)], batch_size=protocol.batch, lr=lr,
                       weight_decay=protocol.weight_decay, kernel_lr=point.kernel_lr, warmup=protocol.warmup,
                       clip=1.0, seed=seed, eval_sequences=protocol.eval_sequences, progress=False)
        slices = evaluate_slices(model, tests, num_sequences=protocol.eval_sequences, seed=seed)
    except FloatingPointError as err:
        diverged = str(err)
        slices = [{"seq_len": t.seq_len, "num_pairs": t.num_pairs, "accuracy": 0.0, "queries": 0} for t in tests]
    return {**record, "slices": slices, "score": _score(slices), "diverged": diverged,
            "seconds": time.perf_counter() - t0}


def _score(slices) -> float:
    """The mean of the slices' accuracies, every slice weighted equally (not by its number of queries)."""
    return math.fsum(s["accuracy"] for s in slices) / len(slices)


def _store(record: dict, work: Path) -> dict:
    with atomic_write(work / f"{record['key']}.json") as tmp:
        Path(tmp).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def _run_and_store(point, protocol, lr, seed, work) -> dict:
    return _store(train_point(point, protocol, lr, seed), Path(work))


def load_runs(work) -> dict[str, dict]:
    """Every cached run record in ``work`` (``{key: record}``; none when it does not exist)."""
    work = Path(work)
    return {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("*.json"))} if work.is_dir() else {}


def plan_runs(points, protocol: Protocol, lrs, seeds, done) -> list[tuple]:
    """The runs still to train, given the cached keys ``done``, point by point in the order of ``points``: the
    first seed at every rate of ``lrs``; once those are done, the other ``seeds`` at the best of them (ties: the
    smaller rate). Returns ``(point, lr, seed)``; a grid cut short keeps its first points whole."""
    todo = []
    for point in points:
        sweep = [(point, lr, seeds[0]) for lr in lrs if run_key(point, protocol, lr, seeds[0]) not in done]
        if sweep:
            todo += sweep
            continue
        best = _best_lr(point, protocol, lrs, seeds[0], done)
        todo += [(point, best, s) for s in seeds[1:] if run_key(point, protocol, best, s) not in done]
    return todo


def _best_lr(point, protocol, lrs, seed, runs) -> float:
    """The rate of ``lrs`` whose run on ``seed`` scores highest (the first of equal ones)."""
    return max(lrs, key=lambda lr: (runs[run_key(point, protocol, lr, seed)]["score"], -lrs.index(lr)))


def run_frontier(points, protocol: Protocol, *, lrs, seeds, work, jobs: int = 1, progress: bool = True) -> dict:
    """Train every run of :func:`plan_runs` not cached in ``work``, ``jobs`` at a time; returns :func:`load_runs`.

    The plan is renewed after every finished run (a point's seeds wait for its sweep). Each run is stored
    (atomically) as it finishes, so an interrupted grid keeps every finished run and a second call trains only
    the rest: the same records as one uninterrupted call (runs are deterministic on one thread). A tqdm bar
    shows the runs done and the time left.
    """
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from tqdm.auto import tqdm

    lrs, seeds = [float(x) for x in lrs], [int(s) for s in seeds]
    if not lrs or not seeds:
        raise ValueError(f"lrs and seeds must be non-empty, got lrs={lrs}, seeds={seeds}")
    jobs = check_positive_int(jobs, "jobs")
    frozen = sorted({p.method for p in points if p.kernel_lr == 0})
    if frozen and not isinstance(protocol, KernelProtocol):
        raise ValueError(f"method(s) {', '.join(frozen)} freeze the kernel (kernel_lr 0), which only the kernel-only "
                         "harness supports: pass --preset kernel")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    points = list(points)
    runs = load_runs(work)
    grid = {run_key(p, protocol, lr, s) for p in points for lr in lrs for s in seeds}
    total = len(points) * (len(lrs) + len(seeds) - 1)
    bar = tqdm(total=total, initial=len(grid & runs.keys()), desc="frontier", unit="run", disable=not progress,
               dynamic_ncols=True)
    pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
    flying = {}  # future -> run key
    try:
        while True:
            busy = set(flying.values())
            todo = [(p, lr, s) for p, lr, s in plan_runs(points, protocol, lrs, seeds, runs)
                    if run_key(p, protocol, lr, s) not in busy]
            if pool is None and todo:
                point, lr, seed = todo[0]
                record = _run_and_store(point, protocol, lr, seed, work)
            else:
                for point, lr, seed in todo[:jobs - len(flying)]:
                    flying[pool.submit(_run_and_store, point, protocol, lr, seed, str(work))] = run_key(
                        point, protocol, lr, seed)
                if not flying:
                    break
                finished, _ = wait(flying, return_when=FIRST_COMPLETED)
                future = finished.pop()
                del flying[future]
                record = future.result()
            runs[record["key"]] = record
            bar.set_postfix_str(f"{record['point']['method']} {record['point']['size']} lr {record['lr']:.0e} "
                                f"s{record['seed']}: {record['score']:.3f}")
            bar.update(1)
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
    return load_runs(work)


# ------------------------------------------------------------------------------------------------ the report
def frontier_summary(runs, points, protocol: Protocol, *, lrs, seeds, threshold: float = 0.9) -> dict:
    """The report's numbers from cached ``runs`` (``{key: record}``): per point its state bytes, best rate,
    the scores of its seeds at that rate (mean, sd) and mean per-slice accuracies; per method the smallest
    state whose mean reaches ``threshold`` (``None``: not reached). Points whose sweep is unfinished are
    left out."""
    lrs, seeds = [float(x) for x in lrs], [int(s) for s in seeds]
    rows = []
    for point in points:
        if any(run_key(point, protocol, lr, seeds[0]) not in runs for lr in lrs):
            continue
        best = _best_lr(point, protocol, lrs, seeds[0], runs)
        found = [runs[k] for s in seeds if (k := run_key(point, protocol, best, s)) in runs]
        scores = [r["score"] for r in found]
        rows.append({"method": point.method, "size": point.size, "state_bytes": found[0]["state_bytes"], "lr": best,
                     "sweep": {f"{lr:g}": runs[run_key(point, protocol, lr, seeds[0])]["score"] for lr in lrs},
                     "seeds": [r["seed"] for r in found], "scores": scores, "mean": statistics.fmean(scores),
                     "sd": statistics.stdev(scores) if len(scores) > 1 else None,
                     "slices": [statistics.fmean(r["slices"][i]["accuracy"] for r in found)
                                for i in range(len(protocol.test_pairs))],
                     "seconds": sum(runs[run_key(point, protocol, lr, seeds[0])]["seconds"] for lr in lrs)
                     + sum(r["seconds"] for r in found if r["seed"] != seeds[0])})
        if isinstance(protocol, KernelProtocol):
            rows[-1]["attention_error"] = _mean_errors([r["attention_error"] for r in found])
    methods = list(dict.fromkeys(r["method"] for r in rows))
    reach = {m: min((r["state_bytes"] for r in rows if r["method"] == m and r["mean"] >= threshold), default=None)
             for m in methods}
    return {"protocol": asdict(protocol), "lrs": lrs, "seeds": seeds, "threshold": threshold, "points": rows,
            "smallest_state_reaching": reach, "train_seconds": sum(r["seconds"] for r in rows)}


def _mean_errors(errors) -> dict | None:
    """The seeds' mean of each attention-matrix error (None when a run has none: the LM harness, a memory kernel)."""
    if not errors or any(e is None for e in errors):
        return None
    return {name: statistics.fmean(e[name] for e in errors) for name in errors[0]}


def frontier_report(runs, points, protocol: Protocol, *, lrs, seeds, out, command: str,
                    threshold: float = 0.9) -> dict:
    """Write ``out.md``, ``out.json`` and ``out.png`` (accuracy against state bytes per layer, log x) from the
    cached ``runs`` alone (:func:`frontier_summary`); returns the summary. The same runs give the same files."""
    summary = frontier_summary(runs, points, protocol, lrs=lrs, seeds=seeds, threshold=threshold)
    summary["command"] = command
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out.with_suffix(".json"), json.dumps(summary, indent=1) + "\n")
    write_text_atomic(out.with_suffix(".md"), _markdown(summary))
    _plot(summary, out.with_suffix(".png"))
    return summary


def _protocol_text(p: Protocol) -> str:
    """The report's sentence on the task and the model of ``p``."""
    if isinstance(p, KernelProtocol):
        return (f"Protocol: the kernel-only harness (`sketchlab.tasks.recall_kernel`; Zoology's continuous MQAR: "
                f"frozen random unit embeddings, vocabulary {p.vocab}, a pair token `[key | value]`, a query `[key | "
                f"0]`, T = 2P), training mixture (T, P) = {', '.join(f'({T}, {P})' for T, P in p.train_pairs)} "
                f"(weights {':'.join(f'{w:g}' for w in p.train_weights)}); one attention layer (d_model {p.d_model}, "
                f"no MLP, short convolution {p.short_conv}, NoPE): only the projections and the kernel learn")
    between = "random tokens" if p.random_non_queries else "the filler 0 (Zoology's random_non_queries=False)"
    return (f"Protocol: Zoology's MQAR (keys `[1, V/2)`, values `[V/2, V)`, power-law gaps, {between} between the "
            f"queries), vocabulary {p.vocab}, "
            f"training mixture (T, P) = {', '.join(f'({T}, {P})' for T, P in p.train_pairs)} (weights "
            f"{':'.join(f'{w:g}' for w in p.train_weights)}); {p.n_layers} layers, d_model {p.d_model}, short "
            f"convolution {p.short_conv}, NoPE")


def _markdown(s: dict) -> str:
    p = (KernelProtocol if s["protocol"].get("harness") == "kernel" else Protocol)(**s["protocol"])
    kernel = isinstance(p, KernelProtocol)
    pairs = " | ".join(f"({T}, {P})" for T, P in p.test_pairs)
    errors = " | attention error vs softmax | vs (s)² |" if kernel else " |"
    L = ["# MQAR recall frontier: accuracy against state bytes per layer", "",
         (f"Generated by `{s['command']}` (from the cached runs alone: the same runs give this file again). "
         f"{s['train_seconds'] / 60:.1f} min of training in the runs reported (one thread each)."), "",
         (f"{_protocol_text(p)}; AdamW (weight decay {p.weight_decay:g}), {p.warmup} warm-up steps then "
         f"cosine, clip 1, batch {p.batch}, {p.steps} steps; rates {', '.join(f'{x:g}' for x in s['lrs'])} swept "
         f"on seed {s['seeds'][0]}, seeds {', '.join(map(str, s['seeds']))} at the best. Score: the mean over the "
         f"{len(p.test_pairs)} test slices, each weighted equally ({p.eval_sequences} sequences per slice). State: "
         f"bytes per attention layer (float32), Zoology's formulas (`sketchlab.tasks.state_size`); softmax's KV "
         f"cache at T = {p.max_len}."), ""]
    if kernel:
        L += [("Attention error: on the trained q, k of held-out sequences of the longest training slice, "
               "‖A − A*‖_F / ‖A*‖_F of the layer's attention weights A (`recall_kernel.attention_matrix`) against "
               "exact softmax attention of s = qᵀk/√D and against the degree-2 polynomial attention s²/Σs², mean over "
               "sequences and heads and seeds; — where the output is not linear in v (a memory mechanism)."), ""]
    L += [f"| method | size | state bytes / layer | best lr | seeds | score mean ± sd (each seed) | {pairs}{errors}",
          "|---|---|---|---|---|---|" + "---|" * (len(p.test_pairs) + 2 * kernel)]
    for r in sorted(s["points"], key=lambda r: (r["method"], r["state_bytes"])):
        spread = "" if r["sd"] is None else f" ± {r['sd']:.3f}"
        err = r.get("attention_error")
        tail = (" — | — |" if err is None else f" {err['softmax']:.3f} | {err['poly2']:.3f} |") if kernel else ""
        L.append(f"| {r['method']} | {r['size']} | {r['state_bytes']:,} | {r['lr']:g} | {len(r['scores'])} | "
                 f"{r['mean']:.3f}{spread} ({', '.join(f'{x:.3f}' for x in r['scores'])}) | "
                 + " | ".join(f"{a:.3f}" for a in r["slices"]) + " |" + tail)
    L += ["", f"Smallest state per layer whose mean score reaches {s['threshold']:g}:", "",
          "| method | bytes |", "|---|---|"]
    L += [f"| {m} | {'not reached' if b is None else f'{b:,}'} |" for m, b in s["smallest_state_reaching"].items()]
    L += ["", "Learning-rate sweep (seed " + str(s["seeds"][0]) + "), score per rate:", "",
          "| method | size | " + " | ".join(f"{x:g}" for x in s["lrs"]) + " |", "|---|---|" + "---|" * len(s["lrs"])]
    L += [f"| {r['method']} | {r['size']} | " + " | ".join(f"{v:.3f}" for v in r["sweep"].values()) + " |"
          for r in sorted(s["points"], key=lambda r: (r["method"], r["state_bytes"]))]
    return "\n".join(L) + "\n"


def _plot(s: dict, path: Path) -> None:
    from ..plots import _pyplot, save_figure

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in s["points"]):
        rows = sorted((r for r in s["points"] if r["method"] == method), key=lambda r: r["state_bytes"])
        x = [r["state_bytes"] for r in rows]
        y = [r["mean"] for r in rows]
        err = [r["sd"] or 0.0 for r in rows]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ax.set_xlabel("state bytes per layer (log scale)")
    ax.set_ylabel("MQAR accuracy (mean over slices)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    save_figure(fig, path)
