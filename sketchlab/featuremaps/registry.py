r"""The one name registry of the feature-map family.

``register_feature_map(name, build, options)`` adds a map: ``build(heads, head_dim, **options)``
returns a :class:`~sketchlab.featuremaps.FeatureMap`, and ``options`` declares, once, every option
the map takes beyond the :data:`COMMON_OPTIONS` all maps accept (name → :class:`Option`: kind,
constraint, default, as scikit-learn's ``_parameter_constraints``). :func:`make_feature_map` checks
the options against those declarations (the one check; ``build`` trusts them) and builds the map;
:func:`feature_map_names` lists the names; :func:`resolve_name` maps a deprecated name to its
successor with a ``DeprecationWarning``. ``fit_sketch``, the toy model's attention registry and
``convert_attention`` all read this registry, so a map registered here runs in each of them.

Names (DESIGN §6): ``llops``, ``elementwise``, ``exact-poly``, ``based-taylor``, ``based-expand``,
``psf-random``, ``psf-learned``, ``tensorsketch``, ``hedgehog``, ``dpfp``, ``identity``. Deprecated here:
``exact`` → ``exact-poly``, ``taylor`` → ``based-taylor``, ``psf`` → ``psf-learned`` (this registry's
old meaning of it; ``fit_sketch`` and the toy model used ``psf`` for ``psf-random``).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .base import FeatureMap

__all__ = ["COMMON_OPTIONS", "DEPRECATED_NAMES", "Option", "check_feature_map_options", "feature_map_names",
           "feature_map_options", "make_feature_map", "register_feature_map", "resolve_name"]


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
    build: Callable[..., FeatureMap]
    options: dict


_REGISTRY: dict[str, _Entry] = {}

#: Deprecated names of this registry → ``(successor, note)``.
DEPRECATED_NAMES = {
    "exact": ("exact-poly", ""),
    "taylor": ("based-taylor", ""),
    "psf": ("psf-learned", " (here 'psf' was the learned sketch; fit_sketch's and the toy model's 'psf' is "
                           "'psf-random')"),
}


#: The names ``fit_sketch`` means as a method other than a map of this registry (``optimal``, ``mlp``, a
#: ``register_sketch`` name): never a map's name. Filled by :mod:`sketchlab.fit`, the layer above, as it
#: registers them (this layer never imports it).
FIT_METHOD_NAMES: set[str] = set()


def register_feature_map(name: str, build: Callable[..., FeatureMap], options: dict | None = None) -> None:
    """Register ``build(heads, head_dim, **options) -> FeatureMap`` as ``name`` with its own ``options``
    (name → :class:`Option`) besides :data:`COMMON_OPTIONS`. A name is registered once."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a feature map name must be a non-empty string, got {name!r}")
    if name in _REGISTRY or name in DEPRECATED_NAMES:
        raise ValueError(f"a feature map named {name!r} is already registered")
    if not callable(build):
        raise TypeError(f"feature map {name!r}: build must be a callable (heads, head_dim, **options) -> FeatureMap, "
                        f"got {type(build).__name__}")
    if name not in _BUILTINS and name in FIT_METHOD_NAMES:  # one vocabulary with fit_sketch
        raise ValueError(f"the name {name!r} is a fit_sketch method that is not this map (fit_sketch and compare "
                         "would fit that method): choose another name")
    options = dict(options or {})
    for key, opt in options.items():
        if key in COMMON_OPTIONS or not isinstance(opt, Option):
            raise ValueError(f"feature map {name!r}: option {key!r} must be an Option and not one of the common "
                             f"options {sorted(COMMON_OPTIONS)}")
    _REGISTRY[name] = _Entry(build, options)


def feature_map_names() -> list[str]:
    """The registered names, sorted (deprecated names not included)."""
    _builtins()
    return sorted(_REGISTRY)


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
    _builtins()
    return {**COMMON_OPTIONS, **_entry(name).options}


def _entry(name: str) -> _Entry:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"feature map name must be one of {tuple(sorted(_REGISTRY))}, got {name!r}")
    return _REGISTRY[name]


def check_feature_map_options(name: str, options: dict, *, where: str | None = None) -> dict:
    """``options`` checked against the declarations of ``name`` and completed with the defaults:
    the one check every caller of the registry runs (unknown options refused, naming the ones it takes)."""
    _builtins()
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
    _builtins()
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

def _budget_dim(head_dim, p, m, form, symmetric):
    from ..sketches.based import based_num_features

    fits = [d for d in range(1, head_dim + 1) if based_num_features(d, p, form, symmetric) <= m]
    if not fits:
        raise ValueError(f"m={m} is below the smallest BASED {form} map (d'=1 has "
                         f"{based_num_features(1, p, form, symmetric)} features)")
    return fits[-1]


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
    from .based import TaylorMap

    if p != 2:
        raise ValueError(f"the Taylor map is BASED's degree-2 expansion: p must be 2, got {p}")
    if dim is None and proj is None:
        dim = _budget_dim(head_dim, 2, m, "taylor", bool(symmetric))
    return TaylorMap(heads, head_dim, dim=dim, proj=proj, symmetric=bool(symmetric), learn=learn, dtype=dtype)


def _expand(heads, head_dim, *, p, m, dtype, dim, proj, symmetric, learn, **_):
    from .based import ExpandMap

    symmetric = True if symmetric is None else symmetric
    if dim is None and proj is None:
        dim = _budget_dim(head_dim, p, m, "expand", symmetric)
    return ExpandMap(heads, head_dim, p=p, dim=dim, proj=proj, symmetric=symmetric, learn=learn, dtype=dtype)


def _psf_learned(heads, head_dim, *, p, m, seed, dtype, self_tensored, hidden, **_):
    from .psf import PSFLearnedMap
    from .selftensored import SelfTensored

    if p % 2:
        raise ValueError(f"PolySketchFormer's map is self-tensored (degree 2·(p/2)): p must be even, got {p}")
    if self_tensored:
        raise ValueError("the 'psf-learned' map is already self-tensored; drop self_tensored=True")
    return SelfTensored(PSFLearnedMap(heads, head_dim, m=max(1, math.isqrt(m)), hidden=hidden, degree=p // 2,
                                      seed=seed, dtype=dtype))


def _psf_random(heads, head_dim, *, p, m, seed, dtype, non_negative, **_):
    from ..sketches.psf import PolySketch
    from .sketch_map import SketchMap

    non_negative = p % 2 == 0 if non_negative is None else non_negative
    sketch = PolySketch.draw(head_dim, p, m, non_negative=non_negative, seed=seed, batch_shape=(heads,), dtype=dtype)
    return SketchMap(sketch, heads=heads, head_dim=head_dim)


def _tensorsketch(heads, head_dim, *, p, m, seed, dtype, **_):
    from ..sketches.tensorsketch import TensorSketch
    from .sketch_map import SketchMap

    sketch = TensorSketch.draw(head_dim, p, m, seed=seed, batch_shape=(heads,), dtype=dtype)
    return SketchMap(sketch, heads=heads, head_dim=head_dim)


def _hedgehog(heads, head_dim, *, m, seed, dtype, **_):
    from .hedgehog import HedgehogMap

    return HedgehogMap(heads, head_dim, m=m, seed=seed, dtype=dtype)


def _lazy(module: str, attr: str):
    """The build function ``attr`` of ``sketchlab.featuremaps.<module>``, imported on first call (so a map
    in its own module is registered by one line of :data:`_BUILTINS`)."""

    def build(heads, head_dim, **options):
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)(heads, head_dim, **options)

    return build


_LEARN = Option("bool", True, doc="the map's tensors as trained parameters (else fixed buffers)")
_BASED = {"dim": Option("int", None, low=1, doc="BASED's d' (default: the largest within m)"),
          "proj": Option("tensor", None, doc="the projection [H, D, d']"),
          "symmetric": Option("bool", None, doc="symmetric coordinates of the quadratic block"),
          "learn": Option("bool", False, doc="train the projection")}

_BUILTINS = {
    "llops": (_llops, {"theta": Option("tensor", None, doc="a given Θ [H, t, p, D, M]"), "learn": _LEARN}),
    "elementwise": (_elementwise, {"learn": _LEARN}),
    "exact-poly": (_exact, {"symmetric": Option("bool", True, doc="C(D+p−1, p) symmetric coordinates")}),
    "based-taylor": (_taylor, _BASED),
    "based-expand": (_expand, _BASED),
    "psf-learned": (_psf_learned, {"hidden": Option("int", None, low=1, doc="hidden width (default 4·D)")}),
    "psf-random": (_psf_random, {"non_negative": Option("bool", None, doc="self-tensor (default: even p)")}),
    "tensorsketch": (_tensorsketch, {}),
    "hedgehog": (_hedgehog, {}),
    "dpfp": (_lazy("dpfp", "build_dpfp"), {"nu": Option("int", None, low=1, doc="DPFP's order n (M = 2·D·n)")}),
    "identity": (_lazy("identity", "build_identity"), {}),
}


def _builtins() -> None:
    """Register the built-in maps on first use (idempotent)."""
    if "llops" in _REGISTRY:
        return
    for name, (build, options) in _BUILTINS.items():
        register_feature_map(name, build, options)
