"""The LLoPS paper's training results at CPU scale: MQAR with Zoology's protocol (Tables 4-5, Figure 3)
and BASED -> LLoPS continual training on real text (Table 1).

MQAR part (``--part mqar``). Zoology's protocol (HazyResearch/zoology, ``arxiv24_based_figure2``):
the ``"zoology"`` MQAR layout (keys ``[1, V/2)``, values ``[V/2, V)``, power-law query gaps,
random non-query tokens), trained on the standard ``(T, P)`` mixture ``(64, 4), (128, 8),
(256, 16), (256, 32), (256, 64)`` (weights 5:1:1:1:1) and tested on those and longer ones; a
2-layer model (short causal convolution + sequence mixer, then an MLP), AdamW with weight decay
0.1 on the matrices, linear warm-up then cosine decay, a learning-rate sweep per method (the best
rate per method reported, as Zoology and the paper do), several seeds. Every method shares the
model and differs only in the attention kernel:

* ``softmax``; ``poly`` (exact polynomial attention, p = 2, quadratic time);
* ``based`` (BASED's Taylor map ``1 + s + s²/2`` on a 16-dimensional feature projection: 273 features);
* ``psf`` (PolySketchFormer's random sketch, self-tensored, fixed); ``psf-learned`` (its learned
  sketch, LN → Linear → GELU → Linear, self-tensored; ``sketchlab.featuremaps.psf_learned_map``);
* ``hedgehog`` (``[softmax(xW), softmax(-xW)]``, W learned, started at the identity, separate query
  and key maps as LoLCATs; ``sketchlab.featuremaps.HedgehogMap``);
* ``llops`` at degree p and sketch size m, Θ initialised at random (element-wise start) or from
  BASED's expand map (``--init based``; only where m is a BASED feature count), Θ learning at
  ``kernel_lr`` times the model's rate.

Each method also has its sliding-window hybrid (``<key>-w16``, ``<key>-w64``: the same kernel with
``window`` exact softmax keys and a learned gate) for ``based``, ``llops-p4-m256``,
``llops-p2-m256-based`` and ``hedgehog``; the verdict compares a LLoPS hybrid with BASED's hybrid of
the same window.

Every method also has a NoPE variant, ``<key>-nope``: the same model with no positional encoding
(``TransformerConfig(rope_base=None)``), as Zoology's, whose attention sees position only through the
short convolutions and whose test set runs to 4x its training lengths; every other key uses RoPE (base 10⁴)
on q and k. The verdict compares a ``-nope`` LLoPS with ``based-nope``.

Runs are written to ``--work`` (one JSON per run) and read back by later invocations, so the
study can be grown run by run. Writes ``analysis/results/mqar.md`` (``--report NAME``: ``NAME.md``).

Figure 3 part (``--part m``): LLoPS p = 4 (``--m-degree``), random init, at m in {64, 128, 192, 256},
pure and with the sliding window (``--m-windows 0,16``), one learning rate (``--m-lr``, not swept),
``--seeds`` (default 0, 1); the forward time of every model of the sweep measured round-robin in one
process (:func:`time_side_by_side`). Writes ``mqar_m.md`` and ``mqar_m.png`` (accuracy vs m with the
forward time on a second axis, as the paper's Figure 3) and says whether the accuracy moves with m
beyond the seed spread (:func:`m_trend`).

Table 1 part (``--part table1``): a byte-level BASED LM pretrained on Shakespeare (``--table1-map``:
BASED's expand map, or its own Taylor map, which converts to LLoPS of the affine input ``[x, 1]``),
then continued (a) as BASED, (b) converted exactly to LLoPS (checked in float64), (c) the control:
converted with Θ frozen (BASED's function through LLoPS's code path: what rounding alone does),
and (d) softmax trained as long from scratch. Writes ``table1.md`` (``table1_taylor.md``; mean ± sd
and every seed, the paired LLoPS − BASED difference against the seed spread) and its ``.png``.

The MQAR part is a record (issue 41): it no longer trains (without ``--report-only`` it refuses); new MQAR
runs are ``sketchlab frontier`` (:mod:`sketchlab.tasks.frontier`: Zoology's task and state accounting, every
method sized by its state bytes, a cached, resumable grid), and ``--report-only`` rebuilds the committed
``mqar*.md`` reports from the run files beside them (the command at each report's top). The Figure 3 and
Table 1 parts, which the frontier does not do (forward time against m; continued training on text), still train.

Usage::

    python analysis/paper_training.py --part m --quick --steps 800  # Figure 3: accuracy and forward time vs m
    python analysis/paper_training.py --part table1 ...  # the Table 1 analogue on Shakespeare
    python analysis/paper_training.py --quick --steps 3200 ... --report-only  # a committed mqar*.md from its runs

The committed study is the reduced scale trained longer, grown run by run: ``analysis/results/mqar_nope3200.md``
(``--quick --steps 3200``, NoPE, the rates swept on a few methods and reused) holds 320.9 min of run time, ~2.7 h
with ``--jobs 2`` on 2 cores; ``--d-model 128`` was the issue's second width (``mqar_d128.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# --------------------------------------------------------------------------------------------
# settings

ZOOLOGY_TRAIN = ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64))
ZOOLOGY_TEST = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256))


@dataclass(frozen=True)
class Scale:
    """The task and training scale of one study mode."""

    vocab: int = 8192
    divide: int = 1  # every (T, P) of Zoology's mixture divided by this (1 = Zoology's own)
    d_model: int = 128
    steps: int = 4000
    batch: int = 64
    warmup: int = 100
    eval_sequences: int = 256
    lrs: tuple = (1e-3, 3e-3, 1e-2, 3e-2)  # Zoology sweeps 4 log-spaced rates
    seeds: tuple = (0, 1, 2)
    sweep_methods: tuple = ("softmax", "based", "llops-p4-m256")
    m_seeds: tuple = (0, 1)  # the m sweep (Figure 3): fewer seeds, as the issue allows

    def train_pairs(self):
        return tuple((T // self.divide, P // self.divide) for T, P in ZOOLOGY_TRAIN)

    def test_pairs(self):
        return tuple((T // self.divide, P // self.divide) for T, P in ZOOLOGY_TEST)


FULL = Scale()
QUICK = Scale(vocab=512, divide=4, d_model=64, steps=400, batch=64, warmup=40, eval_sequences=128,
              lrs=(1e-2,), seeds=(0,), sweep_methods=("softmax",))
# --quick is a smoke run (three runs of 400 steps: softmax, BASED, LLoPS p = 4 m = 256, seed 0; ~7 min on an
# idle 2-core machine, BASED and LLoPS being ~3x slower per step than softmax on the CPU). At 400 steps
# softmax reaches 0.97-0.99 per slice; the committed mqar.md is the same scale at 800 steps, 3 softmax seeds.
QUICK_METHODS = "softmax,based,llops-p4-m256"


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    attention: str
    options: dict = field(default_factory=dict)
    init: str | None = None  # llops: "random" or "based"
    kernel_lr: float = 1.0
    rope_base: float | None = 10000.0  # the model's RoPE base; None: no positional encoding (NoPE)


def methods(d_model: int) -> dict[str, Method]:
    """Every method of the study, by key. One attention head (as Zoology's attention and BASED)."""
    out = [
        Method("softmax", "softmax", "softmax"),
        Method("poly-p2", "exact polynomial p = 2 (quadratic time)", "poly", {"p": 2}),
        Method("based", "BASED (Taylor, feature dim 16: 273 features)", "based", {"form": "taylor", "dim": 16}),
        Method("psf-p4-m256", "PSF (random, self-tensored, degree 4, 256 features)", "psf",
               {"p": 4, "m": 256, "non_negative": True}),
        Method("psf-learned-p4-m256", "PSF (learned sketch, self-tensored, degree 4, 256 features)", "psf-learned",
               {"p": 4, "m": 256}),
        Method("hedgehog", f"Hedgehog ({2 * d_model} features, W from the identity)", "hedgehog", {"m": 2 * d_model}),
    ]
    for p in (2, 4, 6):
        for m in M_SWEEP:
            out.append(Method(f"llops-p{p}-m{m}", f"LLoPS p = {p}, m = {m} (random init)", "llops",
                              {"p": p, "m": m}, init="random", kernel_lr=KERNEL_LR))
    # Θ at the model's own rate (kernel_lr 1, not KERNEL_LR): the 0.1 factor protects a BASED-started Θ's
    # non-negative kernel; from a random start there is nothing to protect
    out.append(Method("llops-p4-m256-klr1", "LLoPS p = 4, m = 256 (random init, Θ at the model's rate)", "llops",
                      {"p": 4, "m": 256}, init="random", kernel_lr=1.0))
    # from BASED: m a BASED expand feature count (p = 2: d' = 16 -> 256 = the Taylor map's quadratic block)
    out.append(Method("llops-p2-m256-based", "LLoPS p = 2, m = 256 (init: BASED expand, d' = 16)", "llops",
                      {"p": 2, "m": 256}, init="based", kernel_lr=KERNEL_LR))
    out.append(Method("llops-p4-m256-based", "LLoPS p = 4, m = 256 (init: BASED expand, d' = 4)", "llops",
                      {"p": 4, "m": 256}, init="based", kernel_lr=KERNEL_LR))
    # LLoPS on the affine input [x, 1] (each factor affine in x: inhomogeneous features of degree <= p): from BASED's
    # own Taylor map (p = 2, d' = 16: the same 273 features, so step 0 *is* the `based` model), and from a random start
    out.append(Method("llops-taylor-m273-based", "LLoPS on [x, 1], p = 2, m = 273 (init: BASED Taylor, d' = 16: step 0 "
                      "is BASED)", "llops", {"p": 2, "m": 273, "affine": True}, init="based", kernel_lr=KERNEL_LR))
    # ... and self-tensored (φ ⊗ φ of a p = 2, 16-feature map of [x, 1]: 256 features, a kernel (φ(q)·φ(k))² >= 0
    # whatever Θ becomes, with BASED's lower-degree terms), from a random start
    # (inner m = 8, 12, 14, 16: 64, 144, 196, 256 features, near the paper's Figure 3 sizes 64, 128, 192, 256)
    for inner in (8, 12, 14, 16):
        out.append(Method(f"llops-nn-affine-p2-m{inner}", f"LLoPS self-tensored on [x, 1], p = 2, m = {inner} "
                          f"({inner * inner} features, degree <= 4; random init)", "llops",
                          {"p": 2, "m": inner, "non_negative": True, "affine": True}, init="random", kernel_lr=KERNEL_LR))
    # self-tensored LLoPS (φ ⊗ φ of a degree-2, 16-feature map: 256 features, degree 4, a kernel (φ(q)·φ(k))² >= 0
    # whatever Θ becomes in training): from a random start, and from BASED expand d' = 4 (the same step-0 kernel
    # (s')⁴ as llops-p4-m256-based, whose Θ turns signed in training)
    out.append(Method("llops-nn-p2-m16", "LLoPS self-tensored, p = 2, m = 16 (256 features, degree 4; random init)",
                      "llops", {"p": 2, "m": 16, "non_negative": True}, init="random", kernel_lr=KERNEL_LR))
    out.append(Method("llops-nn-p2-m16-based", "LLoPS self-tensored, p = 2, m = 16 (256 features, degree 4; init: "
                      "BASED expand, d' = 4)", "llops", {"p": 2, "m": 16, "non_negative": True}, init="based",
                      kernel_lr=KERNEL_LR))
    # the delta-rule far state (issue 34; mqar_delta.md, a record): the self-tensored affine LLoPS map above with
    # state="delta" (256 features, L2-normalised inside the rule), and DeltaNet's identity features (φ(x) = x:
    # d_model features with one head), β per head learned in the kernel group (at kernel_lr with Θ)
    out.append(Method("llops-nn-affine-p2-m16-delta", "LLoPS self-tensored on [x, 1], p = 2, m = 16 (256 features; "
                      "random init), delta rule", "llops",
                      {"p": 2, "m": 16, "non_negative": True, "affine": True, "state": "delta"}, init="random",
                      kernel_lr=KERNEL_LR))
    out.append(Method("identity-delta", f"DeltaNet-style: identity features ({d_model}), delta rule", "identity",
                      {"state": "delta"}))
    # the sliding-window hybrids (exact softmax on the last `window` keys, the sketch beyond, one denominator,
    # a learned gate per head): BASED's own recipe; window 64 at Zoology's lengths (16 at a quarter of them)
    hybrid_bases = ("based", "llops-p2-m256-based", "hedgehog", "llops-nn-affine-p2-m16",
                    *(f"llops-p4-m{m}" for m in M_SWEEP))
    for base in [m for m in out if m.key in hybrid_bases]:
        out.append(replace(base, key=f"{base.key}-w64", label=f"{base.label} + window 64",
                           options={**base.options, "window": 64}))
        out.append(replace(base, key=f"{base.key}-w16", label=f"{base.label} + window 16",
                           options={**base.options, "window": 16}))
    # NoPE: every method without positional encoding (Zoology's models: the short convolutions carry the order)
    out += [replace(m, key=f"{m.key}-nope", label=f"{m.label}, NoPE", rope_base=None) for m in list(out)]
    return {m.key: m for m in out}


M_SWEEP = (64, 128, 192, 256)  # the paper's Figure 3 sketch sizes
KERNEL_LR = 0.1  # Θ's learning-rate factor (see sketchlab.tasks.train_mqar, kernel_lr)


@dataclass(frozen=True)
class RunSpec:
    method: str
    lr: float
    seed: int
    scale: Scale

    @property
    def name(self) -> str:
        s = self.scale
        return f"{self.method}_lr{self.lr:.0e}_s{self.seed}_V{s.vocab}_div{s.divide}_d{s.d_model}_n{s.steps}_b{s.batch}"


# --------------------------------------------------------------------------------------------
# one run (in a worker process)


def build_model(method: Method, d_model: int, vocab: int, seed: int):
    import torch

    from sketchlab.tasks import TransformerConfig, TransformerLM, init_llops

    config = TransformerConfig(vocab_size=vocab, d_model=d_model, n_heads=1, n_layers=2, mlp_ratio=2,
                               short_conv=3, attention=method.attention, attention_options=dict(method.options),
                               rope_base=method.rope_base)
    torch.manual_seed(seed)
    model = TransformerLM(config)
    if method.init is not None:
        init_llops(model, method.init, seed=seed)
    return model


def forward_ms(model, seq_len: int, batch: int = 8, repeats: int = 5) -> float:
    """Median wall time (ms) of one model forward pass on ``[batch, seq_len]`` tokens (no grad)."""
    import torch

    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    model.eval()
    times = []
    with torch.no_grad():
        model(x)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x)
            times.append(1e3 * (time.perf_counter() - t0))
    model.train()
    return statistics.median(times)


def denominator_cell(rs) -> str:
    """Per seed, ``calls (rows)`` of :func:`sketchlab.attention.count_denominators`; ``–`` for a run made before
    they were counted."""
    return ", ".join(f"{d['calls']} ({d['rows']})" if (d := r.get("denominator_warnings")) else "–" for r in rs)


def read_run(path: Path, rope_base) -> dict:
    """A finished run's JSON, refused (``ValueError`` naming the file) when it was trained with another
    positional encoding than its method's today: ``<key>-nope`` once meant RoPE base 1e300, and runs are
    found by file name only. Runs older than the ``rope_base`` field used RoPE base 1e4 or, for
    ``softmax-nope``, 1e300: both count as RoPE."""
    r = json.loads(path.read_text())
    had = r.get("rope_base", 10000.0)
    if had != rope_base:  # None (NoPE) equals only None
        raise ValueError(f"{path}: run trained with rope_base={had!r}, but method {r['spec']['method']!r} now has "
                         f"rope_base={rope_base!r}; move the file out of the work directory to rerun it")
    return r


def run_one(spec: RunSpec, work: str, threads: int) -> dict:
    import torch

    from sketchlab.attention import count_denominators
    from sketchlab.tasks.mqar import zoology_mixture, zoology_tests
    from sketchlab.tasks.train import train_mqar
    from sketchlab.tasks.zoology import evaluate_slices

    path = Path(work) / f"{spec.name}.json"
    s = spec.scale
    method = methods(s.d_model)[spec.method]
    if path.is_file():
        return read_run(path, method.rope_base)
    torch.set_num_threads(threads)
    model = build_model(method, s.d_model, s.vocab, spec.seed)
    mix = zoology_mixture(s.vocab, pairs=s.train_pairs())
    t0 = time.perf_counter()
    with count_denominators() as denominators:  # the attention's denominator warnings, every one counted
        try:
            result = train_mqar(model, [(mix, s.steps)], batch_size=s.batch, lr=spec.lr, weight_decay=0.1,
                                kernel_lr=method.kernel_lr, warmup=s.warmup, clip=1.0, seed=spec.seed,
                                eval_sequences=s.eval_sequences, eval_every=max(1, s.steps // 4), progress=False)
            diverged = None
        except FloatingPointError as err:
            result, diverged = None, str(err)
        seconds = time.perf_counter() - t0
        if result is None:
            slices = [{"seq_len": T, "num_pairs": P, "accuracy": 0.0, "queries": 0} for T, P in s.test_pairs()]
            mix_acc, evals = 0.0, []
        else:
            slices = evaluate_slices(model, zoology_tests(s.vocab, pairs=s.test_pairs()),
                                     num_sequences=s.eval_sequences, seed=spec.seed)
            mix_acc, evals = result.heldout_accuracy, result.evals
    out = {"spec": {"method": spec.method, "lr": spec.lr, "seed": spec.seed, "scale": asdict(s)},
           "label": method.label, "mixture_accuracy": mix_acc, "slices": slices, "evals": evals,
           "seconds": seconds, "diverged": diverged, "forward_ms_T256": forward_ms(model, 256),
           "threads": threads, "rope_base": method.rope_base, "denominator_warnings": denominators,
           "command": "python analysis/paper_training.py " + _command()}  # the invocation that ran it
    from sketchlab.io import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        Path(tmp).write_text(json.dumps(out, indent=1) + "\n")
    return out


# --------------------------------------------------------------------------------------------
# the plan: sweep, then seeds at the winning rate, then the degree and m sweeps


def run_all(specs, args) -> list[dict]:
    if args.report_only:  # finished runs only; the report marks the rest as not run
        found = [(Path(args.work) / f"{s.name}.json", methods(s.scale.d_model)[s.method].rope_base) for s in specs]
        return [read_run(f, rope) for f, rope in found if f.is_file()]
    if not specs:
        return []
    if args.jobs == 1:
        return [run_one(s, str(args.work), args.threads) for s in specs]
    with ProcessPoolExecutor(args.jobs) as pool:
        return list(pool.map(run_one, specs, [str(args.work)] * len(specs), [args.threads] * len(specs)))


def mean_sd(xs):
    xs = list(xs)
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs) -> str:
    """``mean ± sd (each value)``; one value: ``x (1 seed)`` (no spread to quote)."""
    xs = list(xs)
    if len(xs) == 1:
        return f"{xs[0]:.3f} (1 seed)"
    m, sd = mean_sd(xs)
    return f"{m:.3f} ± {sd:.3f} (" + ", ".join(f"{x:.3f}" for x in xs) + ")"


def score(r: dict) -> float:
    """A run's score: mean accuracy over the test slices at training lengths (Zoology's headline)."""
    T_max = max(T for T, _ in ZOOLOGY_TRAIN) // r["spec"]["scale"]["divide"]
    accs = [s["accuracy"] for s in r["slices"] if s["seq_len"] <= T_max]
    return statistics.fmean(accs)


def _mqar_scale(args) -> Scale:
    """The MQAR parts' scale: the mode's, with --steps and --d-model applied."""
    scale = QUICK if args.quick else FULL
    if args.steps:
        scale = replace(scale, steps=args.steps)
    if args.d_model:
        scale = replace(scale, d_model=args.d_model)
    return scale


def mqar(args) -> int:
    if not args.report_only:
        raise SystemExit("paper_training.py --part mqar no longer trains (issue 41): new MQAR runs are `sketchlab "
                         "frontier` (sketchlab.tasks.frontier); --report-only rebuilds a committed mqar*.md from its "
                         "runs")
    scale = _mqar_scale(args)
    if args.seeds:
        scale = replace(scale, seeds=tuple(int(x) for x in args.seeds.split(",")))
    if args.sweep:
        scale = replace(scale, sweep_methods=tuple(args.sweep.split(",")))
    if args.lrs:
        scale = replace(scale, lrs=tuple(float(x) for x in args.lrs.split(",")))
    table = methods(scale.d_model)
    t0 = time.perf_counter()
    # 1. learning-rate sweep (seed 0) for the sweep methods; other methods reuse the rate of their family
    fixed = dict(x.split("=") for x in args.fixed_lr.split(",") if x)  # method=lr: not swept
    sweep = [RunSpec(m, lr, scale.seeds[0], scale) for m in scale.sweep_methods for lr in scale.lrs if m not in fixed]
    sweep += [RunSpec(m, float(lr), scale.seeds[0], scale) for m, lr in fixed.items()]
    swept = run_all(sweep, args)
    best_lr = {}
    for m in dict.fromkeys([*scale.sweep_methods, *fixed]):
        rs = [r for r in swept if r["spec"]["method"] == m]
        if rs:
            best_lr[m] = max(rs, key=score)["spec"]["lr"]
    default_lr = best_lr.get("softmax", scale.lrs[-1])

    def lr_of(key: str) -> float:
        if key in best_lr:
            return best_lr[key]
        family = [k for k in best_lr if k.split("-")[0] == key.split("-")[0]]
        return best_lr[family[0]] if family else default_lr

    # 2. Tables 4-5 comparisons: every seed at the chosen rate
    table_keys = [k for k in args.methods.split(",") if k]
    for k in table_keys:
        if k not in table:
            raise SystemExit(f"--methods: unknown method {k!r}; known: {', '.join(table)}")
    seeded = run_all([RunSpec(k, lr_of(k), s, scale) for k in table_keys for s in scale.seeds], args)
    write_mqar_report(args, scale, table, swept, best_lr, seeded, time.perf_counter() - t0)
    return 0


# --------------------------------------------------------------------------------------------
# report


PAPER_T4 = {"BASED": 91.9, "LLoPS (m = 256, p = 4)": 93.2}
PAPER_T5 = {2: 88.7, 4: 93.2, 6: 86.6}


def write_mqar_report(args, scale, table, swept, best_lr, seeded, wall):
    import torch

    import sketchlab

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by = {}
    for r in seeded:
        by.setdefault(r["spec"]["method"], []).append(r)
    L = []
    cmd = "python analysis/paper_training.py " + _command()
    unique = {json.dumps(r["spec"], sort_keys=True): r for r in swept + seeded}
    total = sum(r["seconds"] for r in unique.values())
    L += ["# MQAR with Zoology's protocol (LLoPS paper, Tables 4-5, Figure 3) at CPU scale", "",
          f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"torch {torch.__version__}, sketchlab {sketchlab.__version__}, {args.threads} thread(s) per run, "
          f"{'runs read back (--report-only)' if args.report_only else f'{args.jobs} run(s) at a time'} on a shared "
          f"2-core machine; {wall / 60:.1f} min wall for this invocation "
          f"(finished runs are read back from `{Path(args.work).relative_to(ROOT) if Path(args.work).is_relative_to(ROOT) else args.work}`), "
          f"{total / 60:.1f} min of run time in all.", ""]
    fixed = dict(x.split("=") for x in args.fixed_lr.split(",") if x)
    swept_keys = [m for m in scale.sweep_methods if m not in fixed]
    rates = (f"Learning rates swept: {', '.join(f'{x:g}' for x in scale.lrs)} on seed {scale.seeds[0]} for "
             f"{', '.join(swept_keys)}" if swept_keys else "No learning-rate sweep in this invocation")
    if fixed:
        rates += "; rates fixed (not swept): " + ", ".join(f"{m} {float(lr):g}" for m, lr in fixed.items())
    rates += "; every other method uses the winner of its family, else softmax's."
    full_rate = [k for k in by if table[k].attention == "llops" and table[k].kernel_lr == 1.0]  # Θ not slowed
    rope = [k for k in by if table[k].rope_base is not None]
    nope = [k for k in by if table[k].rope_base is None]
    pos = "; ".join(x for x in (
        f"RoPE (base {table[rope[0]].rope_base:g}) on q, k for {', '.join(rope)}" if rope else "",
        f"none (NoPE, `TransformerConfig(rope_base=None)`, as Zoology) for {', '.join(nope)}" if nope else "") if x)
    tr = ", ".join(f"({T}, {P})" for T, P in scale.train_pairs())
    te = ", ".join(f"({T}, {P})" for T, P in scale.test_pairs())
    L += ["## Protocol, and where it deviates from Zoology's", "",
          f"- Task: Zoology's MQAR generator restated (`MQARConfig(layout=\"zoology\")`: keys [1, V/2), values "
          f"[V/2, V), every key queried once at a power-law gap (a = 0.01), random tokens elsewhere), vocabulary "
          f"**{scale.vocab}** (Zoology: 8192). Training mixture (T, P) = {tr} with weights 5:1:1:1:1 "
          f"(Zoology: (64, 4), (128, 8), (256, 16), (256, 32), (256, 64)); one component per batch (Zoology "
          f"shuffles all components into each batch). Test (T, P) = {te}, {scale.eval_sequences} held-out "
          f"sequences each.",
          f"- Model: 2 layers, d_model {scale.d_model}, one head, each layer a causal depthwise short convolution "
          f"(kernel 3) then the sequence mixer, then an MLP (ratio 2); untied output head; positional encoding: "
          f"{pos}. Zoology: a gated BaseConv then the mixer (Hybrid), no positional encoding, tied embeddings.",
          f"- Optimisation: AdamW (β = 0.9, 0.98), weight decay 0.1 on matrices, {scale.warmup} warm-up steps then "
          f"cosine to 0, clipping 1.0, batch {scale.batch}, **{scale.steps} steps** (Zoology: batch 256, 32-64 epochs "
          f"of 180k sequences: ~20-45k steps). {rates} LLoPS's Θ learns at {KERNEL_LR} × the model's rate "
          f"(`kernel_lr`" + (f"; {', '.join(full_rate)}: at the model's rate" if full_rate else "") + ").",
          f"- Score: mean held-out accuracy over the test slices at training lengths (T ≤ "
          f"{max(T for T, _ in scale.train_pairs())}); longer slices are reported separately (length "
          f"extrapolation, which RoPE models do not get for free).", ""]
    title = "Learning-rate sweep" if swept_keys else "Learning rates, fixed, not swept"
    L += [f"## {title} (seed {scale.seeds[0]})", "", "| method | " + " | ".join(f"lr {x:g}" for x in scale.lrs) + " | best |",
          "|---|" + "---|" * (len(scale.lrs) + 1)]
    for m in best_lr:
        row = {r["spec"]["lr"]: score(r) for r in swept if r["spec"]["method"] == m}
        L.append(f"| {table[m].label} | " + " | ".join(f"{row[x]:.3f}" if x in row else "–" for x in scale.lrs)
                 + f" | {best_lr[m]:g} |")
    L += ["", "## Every method: mean ± sd over seeds (each seed's number in brackets)", "",
          "Score = mean accuracy over the test slices at training lengths; then each slice (T, P).", "",
          "| method | lr | seeds | score | " + " | ".join(f"({T}, {P})" for T, P in scale.test_pairs())
          + " | train s | forward ms (B=8, T=256) | calls with a denominator ≤ 0 (rows) |",
          "|---|---|---|---|" + "---|" * len(scale.test_pairs()) + "---|---|---|"]
    for k, rs in by.items():
        cells = []
        for i in range(len(scale.test_pairs())):
            m_, sd = mean_sd([r["slices"][i]["accuracy"] for r in rs])
            cells.append(f"{m_:.3f} ± {sd:.3f}" if len(rs) > 1 else f"{m_:.3f}")
        seeds = ", ".join(str(r["spec"]["seed"]) for r in rs)
        L.append(f"| {table[k].label} | {rs[0]['spec']['lr']:g} | {seeds} | {fmt([score(r) for r in rs])} | "
                 + " | ".join(cells)
                 + f" | {statistics.fmean(r['seconds'] for r in rs):.0f} | {statistics.fmean(r['forward_ms_T256'] for r in rs):.1f}"
                 + f" | {denominator_cell(rs)} |")
    # softmax check, for each softmax variant run
    T_max = max(T for T, _ in scale.train_pairs())
    for key in ("softmax", "softmax-nope"):
        if key in by:
            L += ["", softmax_check(by[key], T_max, table[key].label)]
    # the same check at every budget (steps) finished in the work directory, same scale and rate otherwise
    budget = []
    for key in ("softmax", "softmax-nope"):  # at this invocation's rate (its run's, else --fixed-lr's)
        lr = by[key][0]["spec"]["lr"] if key in by else float(fixed[key]) if key in fixed else None
        if lr is not None:
            task = ("vocab", "divide", "d_model", "batch", "warmup", "eval_sequences")  # all but steps
            for f in Path(args.work).glob(f"{key}_lr{lr:.0e}_s*_n*_b{scale.batch}.json"):
                r = read_run(f, table[key].rope_base)
                if (r["spec"]["method"] == key and r["spec"]["lr"] == lr and r["spec"]["seed"] in scale.seeds
                        and all(r["spec"]["scale"][k] == getattr(scale, k) for k in task)):
                    budget.append(r)
    if len({r["spec"]["scale"]["steps"] for r in budget}) > 1:
        L += ["", "**The softmax check by training budget** (every finished run of this scale and rate in the work "
              f"directory, among seeds {', '.join(map(str, scale.seeds))}; the worst seed per slice):", "",
              *budget_table(budget, T_max)]
    # Table 4 / 5 side by side (left out when none of its methods ran)
    def here(key):
        return fmt([score(r) for r in by[key]]) if key in by else "not run"

    rows = paper_rows(by)
    if any(key in by for _, _, key in rows):
        L += ["", "## Table 4 and Table 5 next to the paper", "",
              "Paper: d = 128, Zoology's full protocol on GPUs; accuracy in %. Here: the score above (fraction).", "",
              "| | paper | here |", "|---|---|---|"]
        L += [f"| {name} | {paper} | {here(key)} |" for name, paper, key in rows]
    L += ["", verdict(by), ""] + ([args.note, ""] if args.note else [])
    L += ["## Cut from the full protocol (and why)", "", args.cut or "(see the protocol above)", ""]
    from sketchlab.io import atomic_write

    with atomic_write(out / f"{args.report}.md") as tmp:
        Path(tmp).write_text("\n".join(L) + "\n")
    print("\n".join(L))


def paper_rows(by) -> list[tuple[str, str, str]]:
    """The rows of the Table 4 / Table 5 comparison: ``(name, the paper's number, method key)``.

    The paper's rows are keyed by the RoPE methods; when every method of ``by`` (method key -> runs) is a NoPE
    variant (``…-nope``: an invocation run wholly without positional encoding, the harness that passes its softmax
    check), they are keyed by the NoPE variants instead, so each paper number faces its NoPE run. The hybrids, the
    affine LLoPS and the NoPE variants of BASED and LLoPS p = 4 follow (no paper number), when run.
    """
    nope = bool(by) and all(k.endswith("-nope") for k in by)
    tag, suffix = (" (NoPE)", "-nope") if nope else ("", "")
    rows = [(f"Table 4: BASED{tag}", "91.9", f"based{suffix}"),
            (f"Table 4: LLoPS m = 256, p = 4 (random init){tag}", "93.2", f"llops-p4-m256{suffix}"),
            (f"Table 4: LLoPS m = 256, p = 4 (init from BASED expand, d' = 4){tag}", "–",
             f"llops-p4-m256-based{suffix}")]
    rows += [(f"Table 5: LLoPS p = {p}, m = 256{tag}", f"{PAPER_T5[p]}", f"llops-p{p}-m256{suffix}") for p in (2, 4, 6)]
    extra = [(f"Table 4, hybrid: {name} + window {w}{tag}", "–", f"{key}-w{w}{suffix}") for w in (16, 64)
             for key, name in (("based", "BASED"), ("llops-p4-m256", "LLoPS m = 256, p = 4 (random init)"),
                               ("llops-nn-affine-p2-m16", "LLoPS self-tensored on [x, 1], 256 features"))]
    # LLoPS of the affine input [x, 1] (BASED's lower-degree terms): from BASED's Taylor map, and self-tensored
    extra += [(f"Table 4, affine: {name}{tag}", "–", f"{key}{suffix}")
              for key, name in (("llops-taylor-m273-based", "LLoPS on [x, 1], p = 2, m = 273 (init: BASED Taylor)"),
                                ("llops-nn-affine-p2-m16", "LLoPS self-tensored on [x, 1], 256 features"))]
    if not nope:
        extra += [(f"Table 4, NoPE: {name}", "–", f"{key}-nope")
                  for key, name in (("based", "BASED"), ("llops-p4-m256", "LLoPS m = 256, p = 4 (random init)"))]
    return rows + [row for row in extra if row[2] in by]  # the hybrids and NoPE variants run (no paper number)


def softmax_check(runs, T_max: int, label: str = "softmax") -> str:
    """The harness check: softmax >= 0.99 on every seed, at training lengths (T <= T_max) and at every test length.

    Zoology's test set runs to 4x its longest training length (1024 vs 256) and its headline accuracy counts every
    query of it, so the check at every test length is Zoology's; a RoPE model is not expected to pass it (its
    unseen rotation angles beyond T_max), a model without positional encoding is. The line gives the worst seed's
    accuracy at every test slice, and the command(s) that ran the runs (recorded in each run's JSON).
    """
    def worst(keep):
        cells = [(s["accuracy"], r["spec"]["seed"], (s["seq_len"], s["num_pairs"]))
                 for r in runs for s in r["slices"] if keep(s["seq_len"])]
        return min(cells)

    (a, sa, ca), (b, sb, cb) = worst(lambda T: T <= T_max), worst(lambda T: True)
    verdict_ = lambda x: "passes" if x >= 0.99 else "FAILS"  # noqa: E731
    per_slice = "; ".join(f"({s['seq_len']}, {s['num_pairs']}) {w:.3f}"
                          for s, w in zip(runs[0]["slices"], worst_per_slice(runs)))
    commands = sorted({r["command"] for r in runs if r.get("command")})
    ran = (" Runs made by " + ", ".join(f"`{c}`" for c in commands) + "." if commands else "")
    return (f"**Harness check ({label} ≥ 0.99 on every seed):** the lowest accuracy over {len(runs)} seed(s) "
            f"({', '.join(str(r['spec']['seed']) for r in runs)}) at training lengths (T ≤ {T_max}) is **{a:.3f}** "
            f"(seed {sa}, slice {ca}; {verdict_(a)}); at every test length, the longer ones included (Zoology's "
            f"test set runs to 4× its training lengths), **{b:.3f}** (seed {sb}, slice {cb}; {verdict_(b)}). "
            f"Worst seed per test slice (T, P): {per_slice}.{ran}")


def worst_per_slice(runs) -> list[float]:
    """The lowest accuracy over ``runs`` (seeds of one method and budget) at each test slice, in slice order."""
    return [min(r["slices"][i]["accuracy"] for r in runs) for i in range(len(runs[0]["slices"]))]


def budget_table(runs, T_max: int) -> list[str]:
    """The harness check by training budget: one row per (method, steps) of ``runs`` (softmax variants at one
    scale and rate, any number of steps): the seeds, the worst seed's accuracy at every test slice, and whether
    the worst over the training lengths and over every length reaches 0.99. Markdown lines; [] without runs."""
    groups = {}
    for r in runs:
        groups.setdefault((r["spec"]["method"], r["spec"]["scale"]["steps"]), []).append(r)
    if not groups:
        return []
    pairs = [(s["seq_len"], s["num_pairs"]) for s in next(iter(groups.values()))[0]["slices"]]
    L = ["| method | steps | lr | seeds | " + " | ".join(f"({T}, {P})" for T, P in pairs)
         + " | T ≤ " + str(T_max) + " | every length |", "|---|---|---|---|" + "---|" * (len(pairs) + 2)]
    for (key, steps), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["spec"]["seed"])
        worst = worst_per_slice(rs)
        short = min(w for w, (T, _) in zip(worst, pairs) if T <= T_max)
        mark = lambda x: f"{x:.3f} {'passes' if x >= 0.99 else 'FAILS'}"  # noqa: E731
        L.append(f"| {key} | {steps} | {rs[0]['spec']['lr']:g} | {', '.join(str(r['spec']['seed']) for r in rs)} | "
                 + " | ".join(f"{w:.3f}" for w in worst) + f" | {mark(short)} | {mark(min(worst))} |")
    return L


def _command() -> str:
    """This invocation's arguments, the --cut and --note texts elided (each is printed in its own section)."""
    out, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            out.append('"..."')
            skip = False
        elif a in ("--cut", "--note"):
            out.append(a)
            skip = True
        elif a.startswith(("--cut=", "--note=")):
            out.append(a.split("=", 1)[0] + '="..."')
        else:
            out.append(a)
    return " ".join(out)


_LLOPS_KEYS = ("llops-p4-m256", "llops-p4-m256-based", "llops-nn-p2-m16", "llops-nn-p2-m16-based", "llops-p2-m256",
               "llops-p2-m256-based", "llops-p6-m256", "llops-taylor-m273-based", "llops-nn-affine-p2-m16")


def verdict(by) -> str:
    """One honest sentence: LLoPS vs BASED, the difference against the seed spread.

    Pure LLoPS methods are compared with pure BASED (``based``), the sliding-window hybrids
    (``…-w16``, ``…-w64``) with BASED's hybrid of the same window (``based-w16``, ``based-w64``), and each
    NoPE variant (``…-nope``) with BASED's NoPE variant of the same window (``based-nope``, ``based-w16-nope``).
    """
    pairs = [(key, "based") for key in _LLOPS_KEYS]
    pairs += [(f"{key}-w{w}", f"based-w{w}") for w in (16, 64) for key in _LLOPS_KEYS]
    pairs += [(f"{key}-nope", f"{base}-nope") for key, base in pairs]
    pairs = [(key, base) for key, base in pairs if key in by and base in by]
    if not pairs:
        return ("BASED not run: no LLoPS-BASED comparison." if not any(k.startswith("based") for k in by)
                else "No LLoPS run to compare.")
    lines = []
    for key, base in pairs:
        b = [score(r) for r in by[base]]
        x = [score(r) for r in by[key]]
        name = "BASED" if base == "based" else f"BASED {base.removeprefix('based-')}"  # e.g. "BASED w16-nope"
        (mx, sx), (mb, sb) = mean_sd(x), mean_sd(b)
        d, spread = mx - mb, max(sx, sb)
        if len(x) < 2 or len(b) < 2:
            word = f"{min(len(x), len(b))} seed on one side, so no claim either way"
        elif abs(d) <= 2 * spread:
            word = "no difference beyond the seed spread"
        else:
            word = "LLoPS ahead" if d > 0 else "BASED ahead"
        side = lambda m_, s_, n: f"{m_:.3f} (1 seed)" if n == 1 else f"{m_:.3f} ± {s_:.3f} over {n} seeds"  # noqa: E731
        detail = f"LLoPS {side(mx, sx, len(x))}, {name} {side(mb, sb, len(b))}"
        if len(x) >= 2 and len(b) >= 2:
            se = math.sqrt(sx**2 / len(x) + sb**2 / len(b))  # Welch's standard error of the difference
            disjoint = min(x) > max(b) or max(x) < min(b)
            detail += (f"; Welch t = {d / se:+.1f}" if se > 0 else "") + \
                f"; the seeds' ranges {'do not overlap' if disjoint else 'overlap'}"
        lines.append(f"{key} − {name} = {d:+.3f} ({detail}; rule: a side is ahead when the difference exceeds "
                     f"twice the larger seed sd, {2 * spread:.3f}): {word}")
    return "**LLoPS vs BASED here:** " + "; ".join(lines) + "."


# --------------------------------------------------------------------------------------------
# Figure 3 at MQAR (--part m): accuracy and forward time vs the sketch size m


# The paper's Figure 3 (d = 128, p = 4, m in {64, 128, 192, 256}: accuracy and forward time vs m). The project's
# summary of the paper holds its caption, not its points; the one number on the curve we have is m = 256,
# Table 4's LLoPS p = 4 (93.2 %).
PAPER_FIG3 = ("Figure 3: \"Results of how accuracy and forward time changes with sketch dimension m ∈ {64, 128, 192, "
              "256} and d = 128, p = 4\". The paper's points are not in our copy of the paper (the caption only); "
              "the one point known is m = 256: 93.2 % (Table 4, LLoPS p = 4).")


def m_key(m: int, degree: int, window: int = 0) -> str:
    """The method key of LLoPS degree ``degree``, sketch size ``m``, random init, pure or with a window."""
    return f"llops-p{degree}-m{m}" + (f"-w{window}" if window else "")


def m_rows(runs, degree: int, window: int = 0, ms=M_SWEEP) -> list[dict]:
    """Per sketch size m (those with runs, in the order of ``ms``): the runs of ``m_key(m, degree, window)``.

    Returns dicts with ``m``, ``seeds`` (ascending), ``scores`` (each seed's :func:`score`, same order),
    ``slices`` (per test slice, the mean accuracy over the seeds) and ``seconds`` (mean training time).
    """
    rows = []
    for m in ms:
        key = m_key(m, degree, window)
        rs = sorted((r for r in runs if r["spec"]["method"] == key), key=lambda r: r["spec"]["seed"])
        if rs:
            rows.append({"m": m, "seeds": [r["spec"]["seed"] for r in rs], "scores": [score(r) for r in rs],
                         "slices": [statistics.fmean(r["slices"][i]["accuracy"] for r in rs)
                                    for i in range(len(rs[0]["slices"]))],
                         "seconds": statistics.fmean(r["seconds"] for r in rs)})
    return rows


def m_trend(rows) -> str:
    """One sentence on accuracy vs m: the largest m's mean score minus the smallest m's, against the seed spread.

    Rule (the one :func:`verdict` uses): the difference counts when it exceeds twice the larger seed sd of the
    two ends; with one seed at either end there is no spread and no claim. The sentence also says whether the
    means are monotonic in m and how far apart all of them lie.
    """
    if len(rows) < 2:
        return "Fewer than two sketch sizes run: no trend to read."
    lo, hi = rows[0], rows[-1]
    (m_lo, s_lo), (m_hi, s_hi) = mean_sd(lo["scores"]), mean_sd(hi["scores"])
    d, spread = m_hi - m_lo, max(s_lo, s_hi)
    means = [mean_sd(r["scores"])[0] for r in rows]
    steps = [b - a for a, b in zip(means, means[1:])]
    shape = ("rise with every step in m" if all(x > 0 for x in steps) else
             "fall with every step in m" if all(x < 0 for x in steps) else "are not monotonic in m")
    text = (f"m = {hi['m']} − m = {lo['m']}: {d:+.3f} (the means {shape}, spanning "
            f"{min(means):.3f}-{max(means):.3f}; largest seed sd of the two ends {spread:.3f}")
    if min(len(lo["scores"]), len(hi["scores"])) < 2:
        return text + "): 1 seed at one end, so no claim either way."
    disjoint = min(hi["scores"]) > max(lo["scores"]) or max(hi["scores"]) < min(lo["scores"])
    text += f"; the two ends' seed ranges {'do not overlap' if disjoint else 'overlap'}"
    if abs(d) <= 2 * spread:
        return text + f"; rule: a trend counts when the difference exceeds twice that sd, {2 * spread:.3f}): " \
                      "no trend beyond the seed spread."
    word = "accuracy rises with m" if d > 0 else "accuracy falls with m"
    return text + f"; rule: twice that sd, {2 * spread:.3f}): {word}, beyond the seed spread."


def time_side_by_side(models: dict, seq_lens, batch: int = 8, rounds: int = 7) -> dict:
    """Median wall time (ms) of one forward pass of each model at each length, measured round-robin.

    Every round times each (length, model) once, so a change in the machine's load falls on all models
    alike: the ratios between them are what to read. One warm-up call per (model, length) first; no grad.
    Returns ``{key: {T: ms}}``.
    """
    import torch

    vocab = next(iter(models.values())).config.vocab_size
    g = torch.Generator().manual_seed(0)
    xs = {T: torch.randint(0, vocab, (batch, T), generator=g) for T in seq_lens}
    times = {k: {T: [] for T in seq_lens} for k in models}
    with torch.no_grad():
        for model in models.values():
            model.eval()
            for x in xs.values():
                model(x)  # warm-up
        for _ in range(rounds):
            for T, x in xs.items():
                for k, model in models.items():
                    t0 = time.perf_counter()
                    model(x)
                    times[k][T].append(1e3 * (time.perf_counter() - t0))
    return {k: {T: statistics.median(v) for T, v in per.items()} for k, per in times.items()}


def m_sweep(args) -> int:
    scale = _mqar_scale(args)
    def fail(msg):  # bad command-line input: one line, exit 2
        print(f"paper_training.py: error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    try:
        seeds = tuple(int(x) for x in args.seeds.split(",")) if args.seeds else scale.m_seeds
        windows = tuple(int(x) for x in args.m_windows.split(","))
    except ValueError:
        fail(f"--seeds and --m-windows take comma-separated integers, got {args.seeds!r} and {args.m_windows!r}")
    if not (math.isfinite(args.m_lr) and args.m_lr > 0):
        fail(f"--m-lr must be a finite learning rate > 0, got {args.m_lr!r}")
    table = methods(scale.d_model)
    keys = [m_key(m, args.m_degree, w) for w in windows for m in M_SWEEP]
    for k in keys:
        if k not in table:
            fail(f"--m-degree/--m-windows: no method {k!r} (LLoPS p in 2, 4, 6 pure; windows 16 and 64 for p = 4)")
    t0 = time.perf_counter()
    runs = run_all([RunSpec(k, args.m_lr, s, scale) for w in windows for s in seeds
                    for k in [m_key(m, args.m_degree, w) for m in M_SWEEP]], args)
    # forward time: every model of the sweep (fresh weights: the time does not depend on them) in one process
    lens = (max(T for T, _ in scale.train_pairs()), max(T for T, _ in scale.test_pairs()))
    timing_path = Path(args.work) / f"m_timing_p{args.m_degree}_V{scale.vocab}_div{scale.divide}_d{scale.d_model}.json"
    if args.report_only:
        timing = json.loads(timing_path.read_text()) if timing_path.is_file() else None
    else:
        import torch

        torch.set_num_threads(args.threads)
        models = {k: build_model(table[k], scale.d_model, scale.vocab, 0) for k in keys}
        ms_ = time_side_by_side(models, lens)
        timing = {"batch": 8, "seq_lens": list(lens), "rounds": 7, "threads": args.threads,
                  "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "ms": {k: {str(T): v for T, v in per.items()} for k, per in ms_.items()}}
        from sketchlab.io import atomic_write

        timing_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(timing_path) as tmp:
            Path(tmp).write_text(json.dumps(timing, indent=1) + "\n")
    write_m_report(args, scale, table, seeds, windows, runs, timing, time.perf_counter() - t0)
    return 0


def write_m_report(args, scale, table, seeds, windows, runs, timing, wall):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import sketchlab
    from sketchlab.io import atomic_write
    from sketchlab.plots import save_figure

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = args.m_degree
    name = args.report or "mqar_m"
    total = sum(r["seconds"] for r in runs)
    L = [f"# Figure 3 at MQAR: LLoPS p = {p} accuracy and forward time vs the sketch size m", "",
         f"Generated by `python analysis/paper_training.py {_command()}` on "
         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, torch {torch.__version__}, "
         f"sketchlab {sketchlab.__version__}, {args.threads} thread(s) per run, "
         f"{'runs read back (--report-only)' if args.report_only else f'{args.jobs} run(s) at a time'}; "
         f"{wall / 60:.1f} min wall for this invocation, {total / 60:.1f} min of training in all (finished runs are "
         f"read back from the work directory).", "",
         "## Protocol", "",
         f"The MQAR protocol of [mqar.md](mqar.md) (Zoology's generator, vocabulary {scale.vocab}, Zoology's (T, P) "
         f"/ {scale.divide}: training mixture {', '.join(f'({T}, {P})' for T, P in scale.train_pairs())}; 2 layers, "
         f"d_model {scale.d_model}, one head, short convolution + mixer + MLP, RoPE; AdamW, weight decay 0.1, "
         f"{scale.warmup} warm-up steps then cosine, batch {scale.batch}, **{scale.steps} steps**). LLoPS p = {p}, "
         f"random init, Θ at {KERNEL_LR} × the rate, at m ∈ {{{', '.join(map(str, M_SWEEP))}}}"
         + (", pure and with the sliding window " + ", ".join(f"{w}" for w in windows if w) + " (exact softmax on "
            "the last keys, a learned gate; [mqar_hybrid.md](mqar_hybrid.md))" if any(windows) else "")
         + f". Learning rate **{args.m_lr:g} for every m and window, not swept here**: the winner of mqar.md's "
         f"sweep for LLoPS p = 4, m = 256 (and its family's rate for the hybrid in mqar_hybrid.md), reused. "
         f"Seeds {', '.join(map(str, seeds))}. Score: the mean accuracy over the test slices at training lengths "
         f"(T ≤ {max(T for T, _ in scale.train_pairs())}), as in mqar.md.", ""]
    pairs = scale.test_pairs()
    T_fwd = [str(T) for T in timing["seq_lens"]] if timing else []
    fwd = timing["ms"] if timing else {}
    all_rows = {w: m_rows(runs, p, w) for w in windows}
    for w in windows:
        rows = all_rows[w]
        kind = f"with window {w}" if w else "pure"
        head = ["m", "seeds", "score", *(f"({T}, {P})" for T, P in pairs), "train s",
                *(f"forward ms T = {T}" for T in T_fwd)]
        L += [f"## LLoPS p = {p}, {kind}: mean ± sd over seeds (each seed's number in brackets)", "",
              "Score, then each slice (T, P): the mean over the seeds.", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        by_m = {r["m"]: r for r in rows}
        for m in M_SWEEP:
            if m not in by_m:
                L.append("| " + " | ".join([str(m), "not run", *("–" * (len(head) - 2))]) + " |")
                continue
            r, t = by_m[m], fwd.get(m_key(m, p, w), {})
            cells = [str(m), ", ".join(map(str, r["seeds"])), fmt(r["scores"]),
                     *(f"{a:.3f}" for a in r["slices"]), f"{r['seconds']:.0f}",
                     *(f"{t[T]:.1f}" if T in t else "–" for T in T_fwd)]
            L.append("| " + " | ".join(cells) + " |")
        L += ["", f"**Trend ({kind}):** {m_trend(rows)}", ""]
    if timing:
        L += [f"Forward time: one forward pass of the whole model (2 layers, embedding and head included), batch "
              f"{timing['batch']}, T = {' and '.join(T_fwd)}, median of {timing['rounds']} rounds in which every "
              f"model is timed once (round-robin, one process, {timing['threads']} thread, fresh weights; measured "
              f"{timing['when']} on the shared machine: read the ratios between rows, not the absolute ms).", ""]
        for w in windows:
            base = fwd.get(m_key(M_SWEEP[-1], p, w), {})
            ratios = [f"m = {m}: {fwd[m_key(m, p, w)][T] / base[T]:.2f}" for m in M_SWEEP for T in T_fwd[-1:]
                      if m_key(m, p, w) in fwd and T in base]
            if ratios:
                L.append(f"- {'window ' + str(w) if w else 'pure'}, time ÷ time at m = {M_SWEEP[-1]} "
                         f"(T = {T_fwd[-1]}): " + ", ".join(ratios))
        L.append("")
    else:
        L += ["Forward time: not measured (no timing file in the work directory: run without --report-only).", ""]
    L += ["## Next to the paper", "", PAPER_FIG3, ""] + ([args.note, ""] if args.note else [])
    # the figure: accuracy (left axis, each seed a dot) and forward time (right axis) vs m
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax2 = ax.twinx()
    for i, w in enumerate(windows):
        rows, tag = all_rows[w], (f"window {w}" if w else "pure")
        if rows:
            xs = [r["m"] for r in rows]
            ax.errorbar(xs, [mean_sd(r["scores"])[0] for r in rows], yerr=[mean_sd(r["scores"])[1] for r in rows],
                        marker="o", color=f"C{2 * i}", capsize=3, label=f"accuracy, {tag}")
            for r in rows:
                ax.scatter([r["m"]] * len(r["scores"]), r["scores"], s=10, color=f"C{2 * i}", alpha=0.5)
        tm = [(m, fwd[m_key(m, p, w)][T_fwd[-1]]) for m in M_SWEEP if m_key(m, p, w) in fwd] if T_fwd else []
        if tm:
            ax2.plot(*zip(*tm), marker="s", linestyle="--", color=f"C{2 * i + 1}", label=f"forward ms, {tag}")
    ax.set_xlabel("sketch size m")
    ax.set_xticks(list(M_SWEEP))
    ax.set_ylabel("MQAR accuracy (training lengths)")
    ax2.set_ylabel(f"forward ms (B = 8, T = {T_fwd[-1]})" if T_fwd else "forward ms")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="best")
    ax.set_title(f"LLoPS p = {p}: accuracy and forward time vs m (MQAR, {scale.steps} steps)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out / f"{name}.png", dpi=120)  # atomic; closes the figure
    L += [f"![accuracy and forward time vs m]({name}.png)", "", "## Cut (and why)", "",
          args.cut or "(see the protocol above)", ""]
    with atomic_write(out / f"{name}.md") as tmp:
        Path(tmp).write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


# --------------------------------------------------------------------------------------------
# Table 1 analogue: BASED LM on Shakespeare, continued as BASED, as LLoPS (exact conversion), softmax reference


@dataclass(frozen=True)
class LMScale:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8  # head dim 32: BASED expand on d' = 16 of them, symmetric: 136 features
    seq_len: int = 512
    batch: int = 16
    pretrain: int = 3000
    extra: int = 1000
    lr: float = 3e-3
    eval_windows: int = 64
    eval_every: int = 250
    seeds: tuple = (0, 1, 2)
    bmap: str = "expand"  # BASED's map: a key of BASED_MAPS


# BASED's map in the Table 1 runs: its options, and the sentence the report gives it
BASED_MAPS = {
    "expand": ({"form": "expand", "p": 2, "dim": 16, "symmetric": True},
               "BASED's expand map (u·u')² on d' = 16 coordinates per head, symmetric form (136 features): the "
               "homogeneous part of BASED's Taylor map, converted exactly to LLoPS p = 2, m = 136"),
    "taylor": ({"form": "taylor", "p": 2, "dim": 16, "symmetric": False},
               "BASED's own Taylor map 1 + s + s²/2 on d' = 16 coordinates per head (273 features, BASED's layout), "
               "converted exactly to LLoPS of the affine input [x, 1] (p = 2, m = 273, `affine`)"),
}


LM_QUICK = LMScale(d_model=64, n_layers=2, n_heads=2, seq_len=128, batch=16, pretrain=300, extra=150, lr=3e-3,
                   eval_windows=32, eval_every=50, seeds=(0,))


def lm_path(kind: str, s: LMScale, seed: int, work) -> Path:
    """Where :func:`lm_run` writes (and finds) the run ``kind`` of ``seed`` at scale ``s``."""
    tag = f"{kind}_s{seed}_d{s.d_model}_L{s.n_layers}_T{s.seq_len}_n{s.pretrain}"
    tag += "" if kind == "pretrain" else f"+{s.extra}"  # one pretrained model serves every continued length
    tag += "" if kind == "softmax" else _map_tag(s)  # softmax has no BASED map: one run serves every map
    return Path(work) / "table1" / f"{tag}.json"


def _map_tag(s: LMScale) -> str:
    """The file-name suffix of BASED's map (none for expand: the runs made before the choice existed)."""
    return "" if s.bmap == "expand" else f"_{s.bmap}"


def table1_verdict(llops: dict, based: dict) -> str:
    """One honest sentence: LLoPS + CT − BASED + CT (final held-out nats/byte) against the seed spread.

    ``llops``, ``based``: seed -> final held-out nats/byte. The seeds both arms share are paired
    (each LLoPS arm continues the same pretrained model as the BASED arm of its seed). The spread
    is the larger between-seed sd of the two arms; a side is called better only when the mean
    paired difference exceeds twice that spread (the rule of :func:`verdict`), and the paired
    t = mean / (sd / √n) and the signs of the seeds' differences are quoted beside it.
    """
    seeds = sorted(set(llops) & set(based))
    if not seeds:
        return "**LLoPS + CT − BASED + CT:** no seed has both arms: no comparison."
    d = [llops[s] - based[s] for s in seeds]
    each = ", ".join(f"{x:+.4f} (seed {s})" for s, x in zip(seeds, d))
    if len(seeds) < 2:
        return (f"**LLoPS + CT − BASED + CT:** {each} nats/byte (negative = LLoPS better); one seed, so no spread "
                "to compare it with and no claim either way.")
    md, sdd = mean_sd(d)
    sl, sb = mean_sd([llops[s] for s in seeds])[1], mean_sd([based[s] for s in seeds])[1]
    spread = max(sl, sb)
    t = md / (sdd / math.sqrt(len(d))) if sdd > 0 else math.copysign(math.inf, md)
    signs = ("every seed's difference is positive (LLoPS worse)" if min(d) > 0 else
             "every seed's difference is negative (LLoPS better)" if max(d) < 0 else
             "the seeds' differences change sign")
    if abs(md) > 2 * spread:
        word = f"the difference is larger than the seed spread: {'BASED' if md > 0 else 'LLoPS'} + CT is better here"
    elif abs(md) > spread:
        word = ("the difference is larger than one seed sd but not than twice it: no claim by that rule, though the "
                "paired t says how consistent it is")
    else:
        word = "the difference is within the seed spread: no difference beyond it"
    return (f"**LLoPS + CT − BASED + CT:** {md:+.4f} ± {sdd:.4f} nats/byte over {len(d)} paired seeds ({each}; "
            f"negative = LLoPS better); the seed spread (between-seed sd of the final held-out loss) is "
            f"{sl:.4f} for LLoPS + CT and {sb:.4f} for BASED + CT; paired t = {t:+.1f}; {signs}; {word} (rule: a "
            f"side is better when the mean difference exceeds twice the larger seed sd, {2 * spread:.4f}).")


def lm_run(kind: str, s: LMScale, seed: int, work: str, threads: int) -> dict:
    """One Table 1 arm: ``pretrain`` (BASED), ``based-ct``, ``llops-ct`` (both from the pretrained BASED), ``softmax``.

    ``llops-frozen-ct``: the control, ``llops-ct`` with Θ frozen (no gradient; every other weight
    trains as in ``based-ct``). It computes BASED + CT's function through LLoPS's code path, so it
    differs from ``based-ct`` only by floating-point rounding amplified by training: how far two
    runs of the same mathematics drift apart in ``extra`` steps.
    """
    import torch

    from sketchlab.attention import count_denominators
    from sketchlab.tasks import TransformerConfig, TransformerLM
    from sketchlab.tasks.text import based_to_llops, conversion_error, lm_batch, shakespeare_text, train_lm
    from sketchlab.tasks.train import load_checkpoint, save_checkpoint

    path = lm_path(kind, s, seed, work)
    if path.is_file():
        return json.loads(path.read_text())
    torch.set_num_threads(threads)
    train, heldout = shakespeare_text("train"), shakespeare_text("heldout")
    common = dict(seq_len=s.seq_len, batch_size=s.batch, lr=s.lr, seed=seed, eval_every=s.eval_every,
                  eval_windows=s.eval_windows)
    base = dict(vocab_size=256, d_model=s.d_model, n_heads=s.n_heads, n_layers=s.n_layers, mlp_ratio=4, short_conv=3)
    extra = {}
    ckpt = Path(work) / "table1" / f"pretrain_s{seed}_d{s.d_model}_L{s.n_layers}_T{s.seq_len}_n{s.pretrain}{_map_tag(s)}"
    if kind in ("pretrain", "softmax"):
        torch.manual_seed(seed)
        att = {"attention": "softmax"} if kind == "softmax" else {
            "attention": "based", "attention_options": dict(BASED_MAPS[s.bmap][0])}
        model = TransformerLM(TransformerConfig(**base, **att))
        steps = s.pretrain + (s.extra if kind == "softmax" else 0)
        res = train_lm(model, train, heldout, steps=steps, **common)
        if kind == "pretrain":
            save_checkpoint(ckpt, model)
    else:
        lm_run("pretrain", s, seed, work, threads)
        model, _ = load_checkpoint(ckpt)
        if kind in ("llops-ct", "llops-frozen-ct"):
            x, _ = lm_batch(heldout, 4, s.seq_len, generator=torch.Generator().manual_seed(seed + 7))
            diff, size = conversion_error(model, x)
            extra = {"conversion_max_abs_logit_change": diff, "logit_scale": size}
            model = based_to_llops(model)
        if kind == "llops-frozen-ct":
            for name, p in model.named_parameters():
                if ".attention.attn." in name:  # the kernels' own parameters: Θ (no gate without a window)
                    p.requires_grad_(False)
        with count_denominators() as denominators:  # the attention's denominator warnings, counted
            res = train_lm(model, train, heldout, steps=s.extra, step0=s.pretrain,
                           kernel_lr=KERNEL_LR if kind == "llops-ct" else 1.0, **{**common, "seed": seed + 1})
        extra["denominator_warnings"] = denominators
    out = {"kind": kind, "seed": seed, "scale": asdict(s), "curve": res.curve, "seconds": res.seconds, **extra}
    from sketchlab.io import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        Path(tmp).write_text(json.dumps(out, indent=1) + "\n")
    return out


def table1(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import sketchlab

    s = LM_QUICK if args.quick else LMScale()
    if args.seeds:
        s = replace(s, seeds=tuple(int(x) for x in args.seeds.split(",")))
    s = replace(s, bmap=args.table1_map)
    name = f"table1{_map_tag(s)}"  # table1.md (expand), table1_taylor.md
    if args.table1_extra:  # a longer (or shorter) continued phase: its own report, table1_taylor_ct600.md
        s = replace(s, extra=args.table1_extra)
        name += f"_ct{s.extra}"
    t0 = time.perf_counter()
    kinds = ("pretrain", "based-ct", "llops-ct", "llops-frozen-ct", "softmax")
    runs = {k: [] for k in kinds}
    if args.report_only:  # finished runs only; a missing one is named in the report
        for k in kinds:
            for seed in s.seeds:
                f = lm_path(k, s, seed, args.work)
                if f.is_file():
                    runs[k].append(json.loads(f.read_text()))
    else:
        for seed in s.seeds:  # pretrain first (the continued arms read its checkpoint), then the rest in parallel
            runs["pretrain"].append(lm_run("pretrain", s, seed, str(args.work), args.threads))
        rest = [(k, seed) for k in kinds[1:] for seed in s.seeds]
        with ProcessPoolExecutor(max(1, args.jobs)) as pool:
            done = list(pool.map(lm_run, [k for k, _ in rest], [s] * len(rest), [sd for _, sd in rest],
                                 [str(args.work)] * len(rest), [args.threads] * len(rest)))
        for r in done:
            runs[r["kind"]].append(r)
    for k in kinds:
        runs[k].sort(key=lambda r: r["seed"])
    ln2 = math.log(2)
    final = lambda r: r["curve"][-1]["heldout_nats"]  # noqa: E731
    missing = [f"{k} seed {seed}" for k in kinds for seed in s.seeds if seed not in {r["seed"] for r in runs[k]}]
    L = ["# Table 1 analogue: BASED -> LLoPS continual training on Shakespeare (bytes)", "",
         f"Generated by `python analysis/paper_training.py {_command()}` on "
         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, sketchlab "
         f"{sketchlab.__version__}, {args.threads} thread(s) per run; {(time.perf_counter() - t0) / 60:.1f} min wall for "
         f"this invocation (finished runs are read back from the work directory); the runs' training took "
         f"{sum(r['seconds'] for k in kinds for r in runs[k]) / 60:.1f} min in all.", "",
         f"**Setup.** Byte-level LM (vocabulary 256) on the Gutenberg plays of the `shakespeare` package (every 5th play "
         f"held out, never trained on). Model: {s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, short conv 3, "
         f"MLP ratio 4, context {s.seq_len}, batch {s.batch}, AdamW lr {s.lr:g} (warm-up, cosine), weight decay 0.1. "
         f"BASED = {BASED_MAPS[s.bmap][1]}. Pretraining {s.pretrain} steps; then {s.extra} more steps (a fresh optimiser and schedule) as "
         f"(a) BASED (BASED+CT) and (b) LLoPS converted exactly from it (Θ at {KERNEL_LR} × the rate); (c) softmax "
         f"trained {s.pretrain + s.extra} steps from scratch as the reference. Seeds {', '.join(map(str, s.seeds))}"
         f" (a seed sets the initialisation and the data stream; both CT arms of a seed continue the same pretrained "
         f"model on the same data).", ""]
    if missing:
        L += [f"**Not run (yet):** {', '.join(missing)}; the rows below cover the finished runs only.", ""]
    names = {"pretrain": "BASED (pretrained)", "based-ct": "BASED + CT", "llops-ct": "BASED → LLoPS + CT",
             "llops-frozen-ct": "control: BASED → LLoPS, Θ frozen, + CT",
             "softmax": "softmax (reference)"}
    L += ["Final held-out loss: mean ± sd over seeds (sd: the sample standard deviation), then each seed's value; "
          "perplexity per byte = exp(mean nats/byte).", "",
          "| model | steps | held-out nats/byte | bits/byte | perplexity (per byte) | "
          + " | ".join(f"seed {seed} (nats/byte)" for seed in s.seeds) + " |",
          "|---|---|---|---|---|" + "---|" * len(s.seeds)]
    for k in kinds:
        xs = [final(r) for r in runs[k]]
        if not xs:
            L.append(f"| {names[k]} | – | not run | – | – |" + " – |" * len(s.seeds))
            continue
        m, sd = mean_sd(xs)
        per = {r["seed"]: final(r) for r in runs[k]}
        L.append(f"| {names[k]} | {runs[k][0]['curve'][-1]['step']} | {m:.4f} ± {sd:.4f} | {m / ln2:.4f} ± "
                 f"{sd / ln2:.4f} | {math.exp(m):.3f} | "
                 + " | ".join(f"{per[seed]:.4f}" if seed in per else "–" for seed in s.seeds) + " |")
    conv = [(r["seed"], r["conversion_max_abs_logit_change"], r["logit_scale"]) for r in runs["llops-ct"]]
    if conv:
        L += ["", "**Conversion check** (float64, the pretrained model's own held-out windows, before training "
              "resumes): " + "; ".join(f"seed {seed_}: max |Δ logit| = {d:.2e} with logits up to {z:.1f}"
                                       for seed_, d, z in conv) + ".", ""]
    else:
        L += [""]
    counted = [(r["seed"], r["denominator_warnings"]) for r in runs["llops-ct"] if "denominator_warnings" in r]
    if counted:
        L += ["**Denominators** (BASED → LLoPS + CT, training and evaluation calls that met a normalising denominator "
              "≤ 0: the trained Θ's kernel turned signed): " + "; ".join(
                  f"seed {seed_}: {d['calls']} call{'' if d['calls'] == 1 else 's'} ({d['rows']} query "
                  f"row{'' if d['rows'] == 1 else 's'})" for seed_, d in counted) + ".", ""]
    based_ct = {r["seed"]: final(r) for r in runs["based-ct"]}
    llops_ct = {r["seed"]: final(r) for r in runs["llops-ct"]}
    L += [table1_verdict(llops_ct, based_ct), ""]
    frozen = {r["seed"]: final(r) for r in runs["llops-frozen-ct"]}
    both = sorted(set(frozen) & set(based_ct))
    if both:
        drift = [frozen[sd_] - based_ct[sd_] for sd_ in both]
        L += ["**Control (Θ frozen) − BASED + CT:** "
              + ", ".join(f"{x:+.4f} (seed {sd_})" for sd_, x in zip(both, drift))
              + f" nats/byte: the same function trained through LLoPS's code path instead of BASED's, so this is "
              f"rounding amplified by {s.extra} steps of training (largest |difference| {max(map(abs, drift)):.4f}); "
              "a LLoPS + CT − BASED + CT difference of that size is not an effect of training Θ.", ""]
    if args.note:
        L += [args.note, ""]
    # left: every run from its first evaluation after step 0 (step 0 is ~8 bits, uniform over bytes);
    # right: the continued phase, where the arms differ by less than a line's width on the left
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(13, 4))
    styles = ("-", "--", ":", "-.")
    for i, k in enumerate(kinds):
        for j, r in enumerate(runs[k]):
            curve = [c for c in r["curve"] if c["step"] > 0]
            x, y = [c["step"] for c in curve], [c["heldout_nats"] / ln2 for c in curve]
            ax.plot(x, y, color=f"C{i}", alpha=0.8, label=names[k] if j == 0 else None)
            late = [(a, b) for a, b in zip(x, y) if a >= s.pretrain]
            zoom.plot([a for a, _ in late], [b for _, b in late], color=f"C{i}", ls=styles[j % len(styles)],
                      marker="o", ms=3, alpha=0.9, label=f"{names[k]}, seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out bits/byte")
    ax.set_title("every run")
    ax.legend()
    zoom.set_xlabel("step")
    zoom.set_title(f"from step {s.pretrain} (continued training)")
    zoom.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: the curves fill them
    fig.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from sketchlab.plots import save_figure

    save_figure(fig, out / f"{name}.png", dpi=120)  # atomic; closes the figure
    L += [f"![held-out bits per byte vs step]({name}.png)", "", "## Cut from the issue's protocol", "",
          args.cut or "(see the setup above)", ""]
    from sketchlab.io import atomic_write

    with atomic_write(out / f"{name}.md") as tmp:
        Path(tmp).write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


# --------------------------------------------------------------------------------------------


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("mqar", "m", "table1"), default="mqar",
                    help="mqar: Tables 4-5 (--report-only: a record; new runs are `sketchlab frontier`); m: Figure 3 (LLoPS accuracy and forward time vs m); table1: Table 1")
    ap.add_argument("--quick", action="store_true", help="smoke run at reduced scale (vocab 512, Zoology's (T, P) / 4, d_model 64, "
                    "400 steps, lr 1e-2, seed 0; softmax, BASED, LLoPS p=4 m=256): ~7 min with 2 jobs on an idle 2-core machine")
    ap.add_argument("--methods", default=None, help="methods of the seeded comparison (keys; default: every "
                    f"method of Tables 4-5, or {QUICK_METHODS} with --quick)")
    ap.add_argument("--table1-map", choices=tuple(BASED_MAPS), default="expand",
                    help="--part table1: BASED's map (expand: table1.md; taylor, BASED's own, converted to LLoPS of "
                    "[x, 1]: table1_taylor.md)")
    ap.add_argument("--table1-extra", type=int, default=0,
                    help="--part table1: continued-training steps in place of the mode's (the pretrained models are "
                    "reused; the report's name gains _ct<N>)")
    ap.add_argument("--m-degree", type=int, default=4, help="--part m: LLoPS's degree p (default 4, the paper's)")
    ap.add_argument("--m-lr", type=float, default=3e-3, help="--part m: the learning rate of every run (default "
                    "3e-3, mqar.md's winner for LLoPS p = 4, m = 256 at --quick scale)")
    ap.add_argument("--m-windows", default="0,16", help="--part m: sliding windows, comma-separated (0 = pure)")
    ap.add_argument("--steps", type=int, default=0, help="override the mode's steps")
    ap.add_argument("--d-model", type=int, default=0, help="MQAR parts: override the mode's d_model (Zoology "
                    "and the issue: 64 and 128)")
    ap.add_argument("--seeds", default="", help="override the mode's seeds (comma-separated)")
    ap.add_argument("--sweep", default="", help="override the mode's learning-rate-swept methods (comma-separated keys)")
    ap.add_argument("--lrs", default="", help="override the mode's learning rates (comma-separated)")
    ap.add_argument("--fixed-lr", default="", help="method=lr,...: these methods take this rate, not swept")
    ap.add_argument("--note", default="", help="a reading of the results for the report (printed under the verdict)")
    ap.add_argument("--report-only", action="store_true", help="write the report from the finished runs only")
    ap.add_argument("--report", default=None, help="MQAR parts: the report's file name in --out, without .md "
                    "(default mqar, --part m: mqar_m; e.g. mqar_hybrid for a hybrid-only invocation, leaving "
                    "mqar.md as it is)")
    ap.add_argument("--cut", default="", help="a sentence for the report: what this invocation left out")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "paper_training")
    ap.add_argument("--out", type=Path, default=ROOT / "analysis" / "results")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.methods is None:
        args.methods = QUICK_METHODS if args.quick else ("softmax,based,llops-p4-m256,llops-p4-m256-based,"
                                                         "llops-p2-m256,llops-p2-m256-based,llops-p6-m256,poly-p2,psf-p4-m256,"
                                                         "psf-learned-p4-m256,hedgehog")
    if args.part == "mqar":
        args.report = args.report or "mqar"
        return mqar(args)
    if args.part == "m":
        return m_sweep(args)
    return table1(args)


if __name__ == "__main__":
    raise SystemExit(main())
