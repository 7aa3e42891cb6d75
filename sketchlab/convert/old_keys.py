"""The key layouts of converted layers saved before today's (acaf206 and earlier), renamed on load.

:func:`upgrade_keys` is what :class:`~sketchlab.convert.sketched.SketchedAttention` calls on every load: the maps'
keys before the one layer core (:data:`OLD_KEYS`), the fitted-sketch adapter's copies, the fitted registered maps
saved under the query side, and the removed ``PSFLearnedMap``'s keys.
"""

from __future__ import annotations

from torch import nn

from ..featuremaps.normed import upgrade_psf_learned_keys
from ..io.formats import rename_keys

__all__ = ["OLD_KEYS", "upgrade_keys"]


#: The keys of a converted layer's maps before :class:`~sketchlab.convert.sketched.SketchedAttention` became an adapter over the one layer core
#: (saved by acaf206 and earlier) -> today's.
OLD_KEYS = (("feature_map_q.", "map_q."), ("feature_map_k.", "map_k."))


def _sketch_adapter_keys(state_dict: dict, prefix: str) -> list[tuple[str, str]]:
    """``(old, new)`` key pairs under ``prefix`` of a module sketch saved through acaf206's ``SketchMap`` adapter
    (``convert_attention(feature_map=<fitted Sketch>)``: the MLP and element-wise sketches), whose every side held
    the whole sketch: ``map_q.sketch.w1_q`` → ``map_q.w1``, ``map_k.sketch.theta_k`` → ``map_k.theta`` (the
    element-wise sketch's rank-1 ``[H, D, M]`` given today's rank axis, ``[H, 1, D, M]``, in ``state_dict`` here).
    The other side's tensors of each copy (``map_q.sketch.w1_k``: never read by the query side) are dropped from
    ``state_dict`` here; any other key under ``.sketch.`` is left, to be named as unexpected."""
    pairs = []
    for side, other in (("q", "k"), ("k", "q")):
        inner = f"map_{side}.sketch."
        for key in [k for k in state_dict if k.startswith(prefix + inner)]:
            name = key.removeprefix(prefix + inner)
            if name == f"theta_{side}" and state_dict[key].ndim == 3:  # ElementwiseSketch: [H, D, M]
                state_dict[key] = state_dict[key].unsqueeze(1)
            if name.endswith(f"_{side}"):
                pairs.append((inner + name, f"map_{side}.{name.removesuffix(f'_{side}')}"))
            elif name.endswith(f"_{other}"):
                del state_dict[key]
    return pairs


#: Where acaf206's adapter saved a registered map fitted by ``fit_sketch`` (``convert_attention(feature_map=
#: fit_sketch("hedgehog" | "psf-learned" | ..., ...).sketch)``: a ``FeatureMapSketch`` under one ``SketchMap`` that
#: served q and k): the fit's query map, and its key map (saved, never read).
FITTED_MAP_Q, FITTED_MAP_K = "feature_map_q.sketch.map_q.", "feature_map_q.sketch.map_k."


def _fitted_map_keys(state_dict: dict, prefix: str, module: nn.Module, layer: int | None) -> None:
    r"""Give the tensors of a registered map fitted by ``fit_sketch`` and saved through acaf206's adapter (keys under
    ``prefix`` + :data:`FITTED_MAP_Q`) today's names and heads, in place in ``state_dict``.

    acaf206's adapter served the queries and the keys with the fit's query map, so its tensors become ``map_q.*``
    and, where the layer has a key map of its own, ``map_k.*`` too (the same values: the same outputs); the fit's
    key map, saved and never read (:data:`FITTED_MAP_K`), is dropped. Of a fit of batch ``[L, H]`` the adapter held
    the selection of layer ``l`` from the map of all ``L·H`` heads, one level deeper (``FITTED_MAP_Q + "inner."``):
    its heads ``l·H … l·H + H − 1`` are taken (the rule of :meth:`sketchlab.Fit.layer`), ``l = layer``. Of a fit of
    batch ``[]`` it held one map of one head, which served every head: its tensors are repeated over the ``H`` heads.

    Parameters
    ----------
    state_dict : dict
        The file's tensors, under the file's keys.
    prefix : str
        The converted layer's (``"model.layers.0.self_attn.sketch."``).
    module : SketchedAttention
        The layer: its maps are what the saved one must match.
    layer : int or None
        The layer's index among the model's attention layers (exact ones counted).

    Raises
    ------
    ValueError
        Naming the file's key: a saved map whose tensors are not those of the layer's map (another map, or
        another structure), or one of ``L·H`` heads when ``layer`` is None (only
        :func:`~sketchlab.convert.saved.load_linearized` knows it) or the fit holds no layer ``layer``.
    """
    saved = [key.removeprefix(prefix + FITTED_MAP_Q) for key in state_dict if key.startswith(prefix + FITTED_MAP_Q)]
    if not saved:
        return
    own = {key: tuple(t.shape) for key, t in module.state_dict().items()}
    for key in [key for key in state_dict if key.startswith(prefix + FITTED_MAP_K)]:
        del state_dict[key]
    want = {key.removeprefix("map_q."): shape for key, shape in own.items() if key.startswith("map_q.")}
    candidates = [(False, {name: name for name in saved})]  # today's name -> saved name
    if all(name.startswith("inner.") for name in saved):  # one layer's selection of a fit of batch [L, H]
        candidates.append((True, {name.removeprefix("inner."): name for name in saved}))
    for selected, names in candidates:
        if set(upgrade_psf_learned_keys(names)) == set(want):  # PSFLearnedMap's keys renamed as well
            break
    else:
        raise ValueError(f"{prefix}{FITTED_MAP_Q}: the fitted map saved by acaf206's adapter has the tensors "
                         f"{sorted(saved)}, which are not those of this layer's map ({sorted(want)}): convert the "
                         "model with a fit of the same method and options first")
    keys_too = {key.removeprefix("map_k.") for key in own if key.startswith("map_k.")}
    if keys_too and keys_too != set(want):
        raise ValueError(f"{prefix}{FITTED_MAP_Q}: the keys went through this map (acaf206's adapter), and this layer's "
                         f"key map has other tensors ({sorted(keys_too)}, the query map {sorted(want)}): convert "
                         "the model with a fit of the same method and options first")
    for name, old in names.items():
        key, tensor, shape = prefix + FITTED_MAP_Q + old, state_dict.pop(prefix + FITTED_MAP_Q + old), want[name]
        heads = shape[0] if shape else 0
        if selected and tuple(tensor.shape) != shape and heads and tuple(tensor.shape[1:]) == shape[1:] \
                and tensor.shape[0] % heads == 0:
            if layer is None:
                raise ValueError(f"{key}: the fitted map's {tensor.shape[0]} heads are those of "
                                 f"{tensor.shape[0] // heads} layers, of which this layer took its {heads}: which ones "
                                 "is known from the layer's index only; load the save with "
                                 "sketchlab.convert.load_linearized")
            if (layer + 1) * heads > tensor.shape[0]:
                raise ValueError(f"{key}: the fitted map holds the heads of {tensor.shape[0] // heads} layers, and "
                                 f"this is layer {layer}: the save and the model do not match")
            tensor = tensor[layer * heads:(layer + 1) * heads]
        elif not selected and tensor.shape[:1] == (1,) and heads > 1 and tuple(tensor.shape[1:]) == shape[1:]:
            tensor = tensor.expand(shape).clone()  # a fit of batch []: its one head's map for every head
        state_dict[prefix + "map_q." + name] = tensor
        if keys_too:
            state_dict[prefix + "map_k." + name] = tensor


def upgrade_keys(state_dict: dict, prefix: str, module: nn.Module, layer: int | None = None) -> dict:
    """Rename, in place, the keys of the converted layer ``module`` at ``prefix`` (``"model.layers.0.self_attn.
    sketch."``) saved before the one layer core (``feature_map_q.*``, ``feature_map_k.*``: :data:`OLD_KEYS`) to
    today's (``map_q.*``, ``map_k.*``), those of a fitted registered map saved through acaf206's adapter (its query
    map for both sides, one layer's heads: :func:`_fitted_map_keys`; ``layer``: the layer's index in the model),
    those of a fitted module sketch saved through that adapter (``map_q.sketch.w1_q`` → ``map_q.w1``:
    :func:`_sketch_adapter_keys`) and those of a map saved as ``PSFLearnedMap``
    (:func:`~sketchlab.featuremaps.normed.upgrade_psf_learned_keys`), and return it; :class:`SketchedAttention`
    calls it on load (no ``layer``), and :func:`~sketchlab.convert.saved.load_linearized` before it matches the saved
    names to the model's."""
    _fitted_map_keys(state_dict, prefix, module, layer)
    rename_keys(state_dict, prefix, OLD_KEYS)
    rename_keys(state_dict, prefix, _sketch_adapter_keys(state_dict, prefix))
    return upgrade_psf_learned_keys(state_dict, prefix)
