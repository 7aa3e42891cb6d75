r"""A user's own module as a member of the family, in one call: :func:`as_feature_map` → :class:`ModuleMap`.

Any ``nn.Module`` or callable that maps per-head ``x [B, T, H, D]`` to features ``[B, T, H, M]`` (one map
per head; flash-linear-attention's ``fla.modules.feature_map`` maps are such modules) becomes a
:class:`~sketchlab.featuremaps.FeatureMap`: it runs through :func:`sketchlab.linear_attention`, and once
registered under a name (:func:`~sketchlab.featuremaps.register_feature_map`) it is a
:func:`sketchlab.fit_sketch` method, compared against the Theorem 3.1 optimum by :func:`sketchlab.compare`,
built by the toy model and by ``convert_attention``, like any built-in map::

    register_feature_map("fla-hedgehog", lambda heads, head_dim, dtype, **_: as_feature_map(
        HedgehogFeatureMap(head_dim).to(dtype), heads=heads, head_dim=head_dim, non_negative=True))
    sl.compare(dump, p=2, m=64, methods=["optimal", "fla-hedgehog"])

**The float64 twin.** A built-in map's twin is its formula written out again, a loop in float64. A
module's formula is known only to its author, so the default twin is the module's own ``forward`` run with
its floating parameters and buffers detached and cast to float64 (:func:`torch.func.functional_call`; the
module itself is not changed): it separates the map from the precision it runs in, not from its code.
``naive=`` takes an independent twin, ``naive(x [B, T, H, D] float64) -> [B, T, H, M] float64``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from .._validation import check_positive_int
from .base import FeatureMap, _check_x, _init_heads

__all__ = ["ModuleMap", "as_feature_map"]


def _run(fn, x: torch.Tensor, dtype: torch.dtype, *, detach: bool) -> torch.Tensor:
    """``fn(x)`` with ``x`` and, for a module, its floating parameters and buffers in ``dtype`` (no copy where
    they already are; detached for the twin); the module's own tensors are left as they are."""
    if not isinstance(fn, nn.Module):
        return fn(x.to(dtype))
    tensors = {**dict(fn.named_parameters()), **dict(fn.named_buffers())}
    cast = {name: (t.detach() if detach else t).to(dtype) for name, t in tensors.items() if t.is_floating_point()}
    return functional_call(fn, cast, (x.to(dtype),))


def _name(fn) -> str:
    """A callable's name for the errors: a function's ``__name__``, else its type's."""
    return getattr(fn, "__name__", type(fn).__name__)


def _like(fn) -> torch.Tensor:
    """A module's first floating parameter or buffer (its dtype and device; an empty float32 CPU tensor for a
    callable or a module without)."""
    tensors = [*fn.parameters(), *fn.buffers()] if isinstance(fn, nn.Module) else []
    return next((t for t in tensors if t.is_floating_point()), torch.empty(0))


class ModuleMap(FeatureMap):
    """A user's module (or callable) ``x [B, T, H, D] -> [B, T, H, M]`` as a :class:`FeatureMap`
    (:func:`as_feature_map` builds it and documents the arguments). A module is a submodule, so its
    parameters train, move and save with the map; a plain callable is held as given."""

    per_head_parameters = False  # a module may share its parameters between heads (fla's maps do)

    def __init__(self, module, *, heads: int, head_dim: int, num_features: int | None = None,
                 degree: int | None = None, non_negative: bool = False, naive=None):
        super().__init__()
        if not callable(module):
            raise TypeError(f"as_feature_map: module must be an nn.Module or a callable mapping [B, T, H, D] to "
                            f"[B, T, H, M], got {type(module).__name__}")
        if naive is not None and not callable(naive):
            raise TypeError(f"as_feature_map: naive must be a callable (x [B, T, H, D] float64 -> [B, T, H, M] "
                            f"float64) or None, got {type(naive).__name__}")
        if not isinstance(non_negative, bool):
            raise TypeError(f"as_feature_map: non_negative must be a bool, got {non_negative!r}")
        _init_heads(self, heads, head_dim)
        if isinstance(module, nn.Module):
            self.module = module
        else:
            self.__dict__["module"] = module  # a plain callable: not a submodule
        self.__dict__["naive"] = naive
        self._degree = None if degree is None else check_positive_int(degree, "degree")
        self._non_negative = non_negative
        if num_features is None:  # probe M on one token (its values unchecked: a zero input may be degenerate)
            with torch.no_grad():
                like = _like(module)
                x = torch.zeros(1, 1, self.heads, self.head_dim, dtype=like.dtype, device=like.device)
                num_features = self._checked(_run(module, x, x.dtype, detach=True), x, None, f"module {_name(module)}")
                num_features = num_features.shape[-1]
        self._m = check_positive_int(num_features, "num_features")

    @property
    def num_features(self) -> int:
        return self._m

    @property
    def degree(self) -> int | None:
        return self._degree

    @property
    def non_negative(self) -> bool:
        return self._non_negative

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_features={self._m}, degree={self._degree}, "
                f"non_negative={self._non_negative}")

    @staticmethod
    def _checked(out, x: torch.Tensor, m: int | None, who: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out`` of ``who`` (``"module <name>"``, ...) on ``x`` checked: a floating tensor ``[B, T, H, m]`` (any
        ``m`` when ``None``; else finite), of ``dtype`` when given; each error names ``who``, the rule and the value."""
        where = f"as_feature_map: {who}"
        B, T, H, D = x.shape
        want = f"[B, T, H, M] = [{B}, {T}, {H}, {'M' if m is None else m}]"
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            got = f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"{where} must return a floating tensor {want} for x [B, T, H, D] = [{B}, {T}, {H}, {D}], "
                            f"got {got}")
        if out.ndim != 4 or tuple(out.shape[:3]) != (B, T, H) or (m is not None and out.shape[3] != m):
            rule = ("num_features (M) must stay the one probed or given" if out.ndim == 4
                    and tuple(out.shape[:3]) == (B, T, H) else "must keep the layout [B, T, H] of its input")
            raise ValueError(f"{where} {rule}: it must map x [B, T, H, D] = [{B}, {T}, {H}, {D}] to {want}, got "
                             f"shape {list(out.shape)}")
        if m is not None:
            bad = ~torch.isfinite(out)
            if bool(bad.any()):
                first = [int(i) for i in bad.nonzero()[0]]
                raise FloatingPointError(f"{where} must return finite features: {int(bad.sum())} of {out.numel()} are "
                                         f"not, the first at {first}: {float(out[tuple(first)])}")
        if dtype is not None and out.dtype != dtype:
            raise TypeError(f"{where} must return {dtype} features, got {out.dtype}")
        return out

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, _like(self.module).dtype)
        return self._checked(_run(self.module, x, dtype, detach=False), x, self._m, f"module {_name(self.module)}")

    def features_naive(self, x: torch.Tensor) -> torch.Tensor:
        """Float64 twin of :meth:`features`: ``naive(x)``, or the module's forward with its floating tensors
        detached and in float64 (module docstring)."""
        x = _check_x(x, self.heads, self.head_dim).to(torch.float64)
        if self.naive is not None:
            return self._checked(self.naive(x), x, self._m, f"naive {_name(self.naive)}", torch.float64)
        return self._checked(_run(self.module, x, torch.float64, detach=True), x, self._m,
                             f"the float64 twin of module {_name(self.module)} (its forward on float64 copies of its "
                             "tensors; else pass naive=)", torch.float64)

    def _features_naive(self, x, head):
        """One head ``x [T, D]`` (float64) through :meth:`features_naive`, the other heads zero (heads are
        independent: one map per head) → ``[T, M]``."""
        full = x.new_zeros(1, x.shape[0], self.heads, self.head_dim)  # [1, T, H, D]
        full[0, :, head] = x
        return self.features_naive(full)[0, :, head]


def as_feature_map(module, *, heads: int, head_dim: int, num_features: int | None = None, degree: int | None = None,
                   non_negative: bool = False, naive=None) -> ModuleMap:
    r"""Wrap a user's ``module`` (``x [B, T, H, D] -> [B, T, H, M]``) into a feature map, in one call.

    Parameters
    ----------
    module : nn.Module or callable
        The map of every head's queries or keys (one map per head: head ``h``'s features depend on head
        ``h``'s input only). It runs with ``x`` and its floating parameters in their promoted dtype, like
        the built-in maps (a float32 module on float64 input computes in float64, gradients reaching the
        float32 parameters). Its output is checked on every call: a floating tensor ``[B, T, H, M]``,
        finite.
    heads, head_dim : int
        ``H`` and ``D`` of the inputs it takes.
    num_features : int or None
        ``M``; ``None`` probes it (the module run once on a zero token).
    degree : int or None
        The polynomial degree of the kernel the map stands for (``local="poly"`` needs one); ``None``: none.
    non_negative : bool
        Whether ``φ(q)·φ(k) >= 0`` for every input (e.g. non-negative features), so a sum may divide: the
        caller's promise, not checked.
    naive : callable or None
        The float64 twin ``naive(x [B, T, H, D] float64) -> [B, T, H, M] float64``; ``None``: the module's own
        forward with its floating parameters and buffers detached and cast to float64 (a copy; the module
        is not changed).

    Returns
    -------
    ModuleMap
        A :class:`~sketchlab.featuremaps.FeatureMap`: ``features``, ``features_naive``, ``num_features``,
        ``degree``, ``non_negative``, ``num_parameters`` (the module's).

    Raises
    ------
    TypeError
        ``module`` or ``naive`` not callable; an output that is not a floating tensor (float64 for the twin).
    ValueError
        An output not of layout ``[B, T, H, M]`` (rank, leading axes or ``M``).
    FloatingPointError
        Non-finite features (the count and the first one).

    Examples
    --------
    >>> relu = as_feature_map(torch.relu, heads=2, head_dim=4, non_negative=True)
    >>> relu.num_features
    4
    """
    return ModuleMap(module, heads=heads, head_dim=head_dim, num_features=num_features, degree=degree,
                     non_negative=non_negative, naive=naive)
