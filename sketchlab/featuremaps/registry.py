r"""The one name registry: every name of the feature-map family and of ``fit_sketch``, one vocabulary.

Each name has two slots. The **builder slot**: ``register_feature_map(name, build, options)`` adds a
map: ``build(heads, head_dim, **options)`` returns a :class:`~sketchlab.featuremaps.FeatureMap`, and
``options`` declares, once, every option the map takes beyond the :data:`COMMON_OPTIONS` all maps accept
(name → :class:`Option`: kind, constraint, default, as scikit-learn's ``_parameter_constraints``).
:func:`make_feature_map` checks the options against those declarations (the one check; ``build`` trusts
them) and builds the map; :func:`feature_map_names` lists the names that have one. The **fitter slot**:
``register_fitter(name, fit)`` (``sketchlab.register_sketch`` fills it) gives the name its own
``fit_sketch`` fitter ``fit(q, k, *, p, m, seed=0, **options)``, which returns :class:`FittedMaps` (the pair
and the fit's own ``info``), or just the fitted map or pair ``(map_q, map_k)`` (:mod:`sketchlab.fit`); :func:`own_fitter` is the
lookup ``fit_sketch`` makes and :func:`fitter_names` lists the names that have one. A map whose fitter
slot is empty is fitted by Adam on the kernel loss (:mod:`.fitting`); a name with a fitter and no map
(``optimal``, ``mlp``) is a ``fit_sketch`` method only.

One name, one meaning: a fitter may join a registered map (it fits that map: the name says so), but a
map may not take a name that already means a fit method (``fit_sketch`` and ``compare`` would keep
fitting that method, ``make_feature_map`` would build another thing), and no slot is filled twice.
:func:`resolve_name` maps a deprecated name to its successor with a ``DeprecationWarning``.
``fit_sketch``, the toy model's attention registry and ``convert_attention`` all read this registry, so
a map registered here runs in each of them. The built-in names, both slots on one line each, are
:data:`_BUILTINS`; their fitters live below this layer (:mod:`sketchlab.optimal`, :mod:`sketchlab.llops`,
:mod:`sketchlab.featuremaps`' map modules) and are imported on first lookup.

Names (DESIGN §6): maps ``llops``, ``elementwise``, ``exact-poly``, ``based-taylor``, ``based-expand``,
``psf-random``, ``psf-learned``, ``tensorsketch``, ``hedgehog``, ``dpfp``, ``identity``; of these
``llops``, ``elementwise``, ``based-*``, ``psf-random`` and ``tensorsketch`` have their own fitter;
fit methods only: ``optimal``, ``mlp``. Deprecated maps (:data:`DEPRECATED_NAMES`): ``exact`` →
``exact-poly``, ``taylor`` → ``based-taylor``, ``psf`` → ``psf-learned`` (the learned sketch, as this
registry meant it); deprecated fit methods (:data:`DEPRECATED_METHODS`, each keeping its fitter): ``psf``
→ ``psf-random`` (as ``fit_sketch`` and the toy model meant it), ``based`` → ``based-expand``.
"""

from __future__ import annotations

import importlib
import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .base import FeatureMap, FittedMaps

__all__ = ["COMMON_OPTIONS", "DEPRECATED_METHODS", "DEPRECATED_NAMES", "FittedMaps", "Option", "check_feature_map_options",
           "feature_map_names", "feature_map_options", "fitter_names", "make_feature_map", "own_fitter",
           "register_feature_map", "register_fitter", "resolve_name"]


@dataclass(frozen=True)
class Option:
    """One declared option: ``kind`` (``"int"``, ``"real"``, ``"bool"``, ``"str"``, ``"dtype"``,
    ``"tensor"``), its ``default``, a lower bound ``low`` (numbers), ``choices`` (``"str"``), and
    whether ``None`` is allowed (``none``; ``default=None`` allows it)."""

    kind: str
    default: Any = None
    low: float | None = None
    choices: tuple | None = None
    none: bool = False
    doc: str = ""

    def check(self, name: str, value, where: str):
        """``value`` checked against the declaration (a ``ValueError``/``TypeError`` naming ``where``,
        the option, the rule and the value)."""
        if value is None and (self.none or self.default is None):
            return None
        if self.kind == "int":
            low = 0 if self.low is None else int(self.low)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{where}: {name} must be an integer >= {low}, got {value!r}")
            return int(value)
        if self.kind == "real":
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or (self.low is not None and value < self.low):
                bound = "" if self.low is None else f" >= {self.low}"
                raise ValueError(f"{where}: {name} must be a finite number{bound}, got {value!r}")
            return float(value)
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise TypeError(f"{where}: {name} must be a bool, got {value!r}")
            return value
        if self.kind == "str":
            if value not in self.choices:
                raise ValueError(f"{where}: {name} must be one of {list(self.choices)}, got {value!r}")
            return value
        if self.kind == "dtype":
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise TypeError(f"{where}: {name} must be a floating torch.dtype, got {value!r}")
            return value
        if self.kind == "tensor":
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: {name} must be a tensor, got {type(value).__name__}")
            return value
        raise AssertionError(f"unknown option kind {self.kind!r}")


#: Options every map accepts (a map that has no use for one ignores it: ``convert_attention``
#: passes ``p, m, rank`` to whichever map it builds).
COMMON_OPTIONS = {
    "p": Option("int", 2, low=1, doc="degree of the kernel the map stands for"),
    "m": Option("int", 64, low=1, doc="features (a budget where the map's size is discrete)"),
    "rank": Option("int", 1, low=1, doc="CP rank (LLoPS)"),
    "seed": Option("int", 0, low=0, doc="seeds the map's random start"),
    "dtype": Option("dtype", torch.float32, doc="dtype of the map's tensors"),
    "self_tensored": Option("bool", False, doc="wrap the map in SelfTensored (φ ⊗ φ)"),
    "input_norm": Option("bool", False, doc="the map on per-head layer-normalised input (InputNormed)"),
}


@dataclass(frozen=True)
class _Entry:
    """One name's two slots: the builder (``build`` and its declared ``options``; ``None``: no map) and
    the fitter (``fit``: the name's own ``fit_sketch`` fitter, or ``(module, attr)`` imported on first
    lookup; ``None``: none of its own)."""

    build: Callable[..., FeatureMap] | None = None
    options: dict = field(default_factory=dict)
    fit: Callable | tuple[str, str] | None = None


_REGISTRY: dict[str, _Entry] = {}

#: Deprecated map names (the builder slot, :func:`make_feature_map`) → ``(successor, note)``.
DEPRECATED_NAMES = {
    "exact": ("exact-poly", ""),
    "taylor": ("based-taylor", ""),
    "psf": ("psf-learned", " (here 'psf' was the learned sketch; fit_sketch's and the toy model's 'psf' is "
                           "'psf-random')"),
}

#: Deprecated ``fit_sketch`` method names (the fitter slot; each keeps its own fitter) → ``(successor, note)``.
DEPRECATED_METHODS = {
    "psf": ("psf-random", ""),
    "based": ("based-expand", " (its default form; 'based-taylor' for form='taylor')"),
}


def _check_name(name, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what} name must be a non-empty string, got {name!r}")


def register_feature_map(name: str, build: Callable[..., FeatureMap], options: dict | None = None) -> None:
    """Fill the builder slot of ``name``: ``build(heads, head_dim, **options) -> FeatureMap`` with its own
    ``options`` (name → :class:`Option`) besides :data:`COMMON_OPTIONS`. A name has one map; a name that
    already means a ``fit_sketch`` method (a filled fitter slot: ``optimal``, ``mlp``) is refused."""
    _check_name(name, "feature map")
    entry = _REGISTRY.get(name)
    if name in DEPRECATED_NAMES or (entry is not None and entry.build is not None):
        raise ValueError(f"a feature map named {name!r} is already registered")
    if not callable(build):
        raise TypeError(f"feature map {name!r}: build must be a callable (heads, head_dim, **options) -> FeatureMap, "
                        f"got {type(build).__name__}")
    if entry is not None:  # one vocabulary: the name is a fit method that is not this map
        raise ValueError(f"the name {name!r} is a fit_sketch method that is not this map (fit_sketch and compare "
                         "would fit that method): choose another name")
    options = dict(options or {})
    for key, opt in options.items():
        if key in COMMON_OPTIONS or not isinstance(opt, Option):
            raise ValueError(f"feature map {name!r}: option {key!r} must be an Option and not one of the common "
                             f"options {sorted(COMMON_OPTIONS)}")
    _REGISTRY[name] = _Entry(build, options)


def register_fitter(name: str, fit: Callable) -> None:
    """Fill the fitter slot of ``name`` with ``fit(q, k, *, p, m, seed=0, **options) -> FittedMaps`` (the
    contract: :mod:`sketchlab.fit`): a new ``fit_sketch`` method, or the own fitter of the map ``name``
    (which it then fits instead of Adam). Registering the same ``fit`` again does nothing; another
    ``fit`` for a name that has one, or a deprecated map name (it means its successor), is refused."""
    _check_name(name, "fit_sketch method")
    if not callable(fit):
        raise TypeError(f"fit_sketch method {name!r}: fit must be a callable (q, k, *, p, m, seed, **options) -> "
                        f"maps, got {type(fit).__name__}")
    if name in DEPRECATED_NAMES:
        raise ValueError(f"the name {name!r} is a deprecated feature map name (it means "
                         f"{DEPRECATED_NAMES[name][0]!r}): choose another name")
    own = own_fitter(name)
    if own is not None and own is not fit:
        raise ValueError(f"a fit_sketch method named {name!r} is already registered")
    _REGISTRY[name] = replace(_REGISTRY.get(name, _Entry()), fit=fit)


def own_fitter(name: str) -> Callable | None:
    """The fitter slot of ``name``: its own ``fit_sketch`` fitter (a built-in one imported now), or
    ``None`` where it has none (a map fitted by Adam, :func:`.fitting.feature_map_fitter`, or no such name)."""
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None or entry.fit is None:
        return None
    if isinstance(entry.fit, tuple):
        module, attr = entry.fit
        _REGISTRY[name] = entry = replace(entry, fit=getattr(importlib.import_module(module), attr))
    return entry.fit


def fitter_names() -> list[str]:
    """The names with their own ``fit_sketch`` fitter, sorted (deprecated names not included)."""
    return sorted(name for name, entry in _REGISTRY.items() if entry.fit is not None and name not in DEPRECATED_METHODS)


def feature_map_names() -> list[str]:
    """The names with a map, sorted (deprecated names not included)."""
    return sorted(name for name, entry in _REGISTRY.items() if entry.build is not None)


def resolve_name(name: str, table: dict | None = None, *, where: str = "make_feature_map") -> str:
    """``name``, or its successor when ``table`` (default :data:`DEPRECATED_NAMES`) lists it as
    deprecated, with a ``DeprecationWarning`` naming both."""
    table = DEPRECATED_NAMES if table is None else table
    if isinstance(name, str) and name in table:
        new, note = table[name]
        warnings.warn(f"{where}: the name {name!r} is deprecated, use {new!r}{note}", DeprecationWarning, stacklevel=3)
        return new
    return name


def feature_map_options(name: str) -> dict:
    """Every option of the map ``name`` (its own and the common ones): name → :class:`Option`."""
    return {**COMMON_OPTIONS, **_entry(name).options}


def _entry(name: str) -> _Entry:
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None or entry.build is None:
        raise ValueError(f"feature map name must be one of {tuple(feature_map_names())}, got {name!r}")
    return entry


def check_feature_map_options(name: str, options: dict, *, where: str | None = None) -> dict:
    """``options`` checked against the declarations of ``name`` and completed with the defaults:
    the one check every caller of the registry runs (unknown options refused, naming the ones it takes)."""
    entry = _entry(name)
    where = where or f"feature map {name!r}"
    declared = {**COMMON_OPTIONS, **entry.options}
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; it takes {sorted(declared)}")
    return {key: opt.check(key, options.get(key, opt.default), where) if key in options else opt.default
            for key, opt in declared.items()}


def make_feature_map(name: str, *, heads: int, head_dim: int, **options) -> FeatureMap:
    """The feature map ``name`` (:func:`feature_map_names`) of ``heads`` heads of dimension ``head_dim``.

    ``options``: the common ones (:data:`COMMON_OPTIONS`: ``p``, ``m``, ``rank``, ``seed``, ``dtype``,
    ``self_tensored``, ``input_norm``) and the map's own (:func:`feature_map_options`), checked once here. Sizes:
    ``llops``, ``elementwise``, ``hedgehog``, ``tensorsketch``: ``m`` features; ``based-taylor``,
    ``based-expand``: the largest ``d'`` with at most ``m``; ``psf-random``, ``psf-learned``:
    ``⌊√m⌋²`` (self-tensored); ``exact-poly``: ``C(D+p−1, p)`` (``m`` ignored); ``dpfp``: ``2·D·nu``; ``identity``: ``D``.
    ``input_norm=True`` wraps the map in :class:`~sketchlab.featuremaps.normed.InputNormed`; ``self_tensored``
    (and psf-learned's own self-tensoring) then applies outside it.
    """
    name = resolve_name(name)
    opts = check_feature_map_options(name, options)
    fmap = _entry(name).build(heads, head_dim, **opts)
    from .normed import InputNormed
    from .selftensored import SelfTensored

    if opts["input_norm"]:  # inside any self-tensoring (psf-learned's own included)
        fmap = SelfTensored(InputNormed(fmap.inner)) if isinstance(fmap, SelfTensored) else InputNormed(fmap)
    return SelfTensored(fmap) if opts["self_tensored"] else fmap


# ----------------------------------------------------------------------------------------------
# the built-in maps: one build function and one registration line each

def _llops(heads, head_dim, *, p, m, rank, seed, dtype, theta, learn, **_):
    from .llops import LLoPSMap

    if theta is not None:
        return LLoPSMap(heads, head_dim, theta=theta, learn=learn)
    return LLoPSMap(heads, head_dim, p=p, m=m, rank=rank, seed=seed, learn=learn, dtype=dtype)


def _elementwise(heads, head_dim, *, p, m, rank, seed, dtype, learn, **_):
    from .elementwise import TiedLLoPSMap

    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(heads, rank, head_dim, m, generator=gen, dtype=torch.float64) / math.sqrt(head_dim)
    return TiedLLoPSMap(heads, head_dim, theta.to(dtype), p=p, learn=learn)


def _exact(heads, head_dim, *, p, symmetric, **_):
    from .exact import ExactPolyMap

    return ExactPolyMap(heads, head_dim, p=p, symmetric=symmetric)


def _taylor(heads, head_dim, *, p, m, dtype, dim, proj, symmetric, learn, **_):
    from .based import TaylorMap, based_dim_for_budget

    if p != 2:
        raise ValueError(f"the Taylor map is BASED's degree-2 expansion: p must be 2, got {p}")
    if dim is None and proj is None:
        dim = based_dim_for_budget(head_dim, 2, m, "taylor", bool(symmetric))
    return TaylorMap(heads, head_dim, dim=dim, proj=proj, symmetric=bool(symmetric), learn=learn, dtype=dtype)


def _expand(heads, head_dim, *, p, m, dtype, dim, proj, symmetric, learn, **_):
    from .based import ExpandMap, based_dim_for_budget

    symmetric = True if symmetric is None else symmetric
    if dim is None and proj is None:
        dim = based_dim_for_budget(head_dim, p, m, "expand", symmetric)
    return ExpandMap(heads, head_dim, p=p, dim=dim, proj=proj, symmetric=symmetric, learn=learn, dtype=dtype)


def _psf_learned(heads, head_dim, *, p, m, seed, dtype, self_tensored, hidden, **_):
    from .psf import psf_learned_map
    from .selftensored import SelfTensored

    if p % 2:
        raise ValueError(f"PolySketchFormer's map is self-tensored (degree 2·(p/2)): p must be even, got {p}")
    if self_tensored:
        raise ValueError("the 'psf-learned' map is already self-tensored; drop self_tensored=True")
    return SelfTensored(psf_learned_map(heads, head_dim, m=max(1, math.isqrt(m)), hidden=hidden, degree=p // 2,
                                        seed=seed, dtype=dtype))


def _psf_random(heads, head_dim, *, p, m, seed, dtype, non_negative, **_):
    from .psf_random import PSFRandomMap

    non_negative = p % 2 == 0 if non_negative is None else non_negative
    return PSFRandomMap.draw(heads, head_dim, p=p, m=m, non_negative=non_negative, seed=seed, dtype=dtype)


def _tensorsketch(heads, head_dim, *, p, m, seed, dtype, **_):
    from .tensorsketch import TensorSketchMap

    return TensorSketchMap.draw(heads, head_dim, p=p, m=m, seed=seed, dtype=dtype)


def _hedgehog(heads, head_dim, *, m, seed, dtype, **_):
    from .hedgehog import HedgehogMap

    return HedgehogMap(heads, head_dim, m=m, seed=seed, dtype=dtype)


def _lazy(module: str, attr: str):
    """The build function ``attr`` of ``sketchlab.featuremaps.<module>``, imported on first call (so a map
    in its own module is registered by one line of :data:`_BUILTINS`)."""

    def build(heads, head_dim, **options):
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)(heads, head_dim, **options)

    return build


_LEARN = Option("bool", True, doc="the map's tensors as trained parameters (else fixed buffers)")
_BASED = {"dim": Option("int", None, low=1, doc="BASED's d' (default: the largest within m)"),
          "proj": Option("tensor", None, doc="the projection [H, D, d']"),
          "symmetric": Option("bool", None, doc="symmetric coordinates of the quadratic block"),
          "learn": Option("bool", False, doc="train the projection")}

#: The built-in names, both slots on one line each: the map's build and options, and its own fitter
#: ``(module, attr)`` (imported on first lookup) where it has one.
_BUILTINS = {
    "optimal": _Entry(fit=("sketchlab.optimal", "_fit_optimal")),
    "mlp": _Entry(fit=("sketchlab.featuremaps.mlp", "_fit_mlp")),
    "llops": _Entry(_llops, {"theta": Option("tensor", None, doc="a given Θ [H, t, p, D, M]"), "learn": _LEARN},
                    ("sketchlab.llops.dispatch", "fit_llops")),
    "elementwise": _Entry(_elementwise, {"learn": _LEARN}, ("sketchlab.featuremaps.elementwise", "_fit_elementwise")),
    "exact-poly": _Entry(_exact, {"symmetric": Option("bool", True, doc="C(D+p−1, p) symmetric coordinates")}),
    "based-taylor": _Entry(_taylor, _BASED, ("sketchlab.featuremaps.based", "_fit_based_taylor")),
    "based-expand": _Entry(_expand, _BASED, ("sketchlab.featuremaps.based", "_fit_based_expand")),
    "psf-learned": _Entry(_psf_learned, {"hidden": Option("int", None, low=1, doc="hidden width (default 4·D)")}),
    "psf-random": _Entry(_psf_random, {"non_negative": Option("bool", None, doc="self-tensor (default: even p)")},
                         ("sketchlab.featuremaps.psf_random", "_fit_psf")),
    "tensorsketch": _Entry(_tensorsketch, {}, ("sketchlab.featuremaps.tensorsketch", "_fit_tensorsketch")),
    "hedgehog": _Entry(_hedgehog),
    "dpfp": _Entry(_lazy("dpfp", "build_dpfp"), {"nu": Option("int", None, low=1, doc="DPFP's order n (M = 2·D·n)")}),
    "identity": _Entry(_lazy("identity", "build_identity")),
    # deprecated fit_sketch names (DEPRECATED_METHODS), each with its own fitter
    "psf": _Entry(fit=("sketchlab.featuremaps.psf_random", "_fit_psf")),
    "based": _Entry(fit=("sketchlab.featuremaps.based", "_fit_based")),
}
_REGISTRY.update(_BUILTINS)
