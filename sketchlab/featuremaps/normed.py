r"""Any map on layer-normalised input: :class:`InputNormed` (the registry's ``input_norm=True``), and the keys
PolySketchFormer's learned sketch was saved under while it was a class of its own (:data:`PSF_LEARNED_OLD_KEYS`:
today it is an ``InputNormed`` over an :class:`~sketchlab.featuremaps.mlp.MLPMap`,
:func:`~sketchlab.featuremaps.psf.psf_learned_map`)."""

from __future__ import annotations

import torch
from torch import nn

from ..io.formats import rename_keys
from .base import FeatureMap, WrappedMap
from .mlp import MLPMap

__all__ = ["PSF_LEARNED_OLD_KEYS", "InputNormed", "upgrade_psf_learned_keys"]

#: The keys of PolySketchFormer's learned sketch while it was a class of its own (``PSFLearnedMap``, 3fa1d18 and
#: earlier) -> today's, under the map's prefix: its layer norm's affine is the :class:`InputNormed`'s of
#: :func:`~sketchlab.featuremaps.psf.psf_learned_map`, its MLP the inner :class:`~sketchlab.featuremaps.mlp.MLPMap`'s.
PSF_LEARNED_OLD_KEYS = (("ln_weight", "weight"), ("ln_bias", "bias"), ("w1", "inner.w1"), ("b1", "inner.b1"),
                        ("w2", "inner.w2"), ("b2", "inner.b2"))


def upgrade_psf_learned_keys(state_dict: dict, prefix: str = "") -> dict:
    """Rename, in place, the keys of every ``PSFLearnedMap`` saved under ``prefix`` (found by its ``ln_weight``, a
    key no other map has; :data:`PSF_LEARNED_OLD_KEYS`, at any depth: self-tensored, input-normed) and return
    ``state_dict``. :class:`InputNormed` renames its own on load; a file's keys are matched to a model's before
    it loads by the toy kernel's and the converted layer's key upgrades, which call this
    (:func:`sketchlab.tasks.legacy.upgrade_keys`, :func:`sketchlab.convert.old_keys.upgrade_keys`)."""
    for key in [k for k in state_dict if k.startswith(prefix) and k.rsplit(".", 1)[-1] == "ln_weight"]:
        rename_keys(state_dict, key.removesuffix("ln_weight"), PSF_LEARNED_OLD_KEYS)
    return state_dict


class InputNormed(WrappedMap):
    r"""The map ``inner`` applied to per-head layer-normalised input with a learnable per-head affine,
    :math:`\phi(\gamma_h \odot (x - \bar x)/\sqrt{\mathrm{var}(x) + \epsilon} + \beta_h)` (as
    PolySketchFormer's learned sketch normalises its input): bounds a polynomial map's magnitude, which
    otherwise grows as ``|x|^p`` (DESIGN §6).

    Parameters
    ----------
    inner : FeatureMap
        The map of the normalised input; its ``num_features``, ``degree`` and ``non_negative`` are this map's.

    Attributes
    ----------
    weight, bias : Parameter ``[H, D]``
        The affine, started at 1 and 0 (in ``inner``'s dtype); ``eps = 1e-5``.

    Notes
    -----
    Over an :class:`~sketchlab.featuremaps.mlp.MLPMap` it is PolySketchFormer's learned sketch, which was saved as
    ``PSFLearnedMap`` (``ln_weight, ln_bias, w1, b1, w2, b2``): ``load_state_dict`` renames those keys
    (:data:`PSF_LEARNED_OLD_KEYS`), so such a file loads into today's map, which computes what it computed.
    """

    eps = 1e-5

    def __init__(self, inner: FeatureMap):
        super().__init__()
        if not isinstance(inner, FeatureMap):
            raise TypeError(f"InputNormed wraps a FeatureMap, got {type(inner).__name__}")
        self.inner, self.heads, self.head_dim = inner, inner.heads, inner.head_dim
        dtype = next((t.dtype for t in inner.parameters() if t.is_floating_point()), torch.get_default_dtype())
        self.weight = nn.Parameter(torch.ones(self.heads, self.head_dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.heads, self.head_dim, dtype=dtype))

    def _load_from_state_dict(self, state_dict, prefix, *args):  # saved as PSFLearnedMap (3fa1d18 and earlier)
        if isinstance(self.inner, MLPMap):
            rename_keys(state_dict, prefix, PSF_LEARNED_OLD_KEYS)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.weight.dtype)
        y = nn.functional.layer_norm(x.to(dtype), (self.head_dim,), eps=self.eps)  # [B, T, H, D]
        return self.inner._features(y * self.weight.to(dtype) + self.bias.to(dtype))

    def _features_naive(self, x, head):
        w, b = self.weight[head].detach().double(), self.bias[head].detach().double()
        y = torch.empty_like(x)
        for j, row in enumerate(x):  # [D]
            mean = row.sum() / row.numel()
            var = ((row - mean) ** 2).sum() / row.numel()
            y[j] = (row - mean) / torch.sqrt(var + self.eps) * w + b
        return self.inner._features_naive(y, head)
