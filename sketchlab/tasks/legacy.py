"""Older toy checkpoints: the state-dict keys of the toy kernels before
:class:`~sketchlab.tasks.attention.ToyKernel` (LLoPSKernel, PSFKernel, BasedKernel; commit c37f5c5), and of
the ``"psf-learned"`` map before it was ``InputNormed(MLPMap)`` (``PSFLearnedMap``; 3fa1d18), renamed on load so
those checkpoints give the outputs they gave."""

from __future__ import annotations

from torch import nn

from ..featuremaps.normed import upgrade_psf_learned_keys
from ..io.formats import rename_keys

__all__ = ["OLD_KEYS", "upgrade_keys"]

#: Feature-map name -> ``(old key or key prefix, today's)`` pairs; ``None``: not saved then (BASED's projection,
#: fixed by the config), taken from the kernel as built. The other kernels kept their keys.
OLD_KEYS = {"llops": (("theta_q", "map_q.theta"), ("theta_k", "map_k.theta")),
            "psf-random": (("weight_", "map_q.weights_"),),
            "based-taylor": ((None, "map_q.proj"),), "based-expand": ((None, "map_q.proj"),)}


def upgrade_keys(kernel: nn.Module, state_dict: dict, prefix: str = "") -> dict:
    """Rename, in place, the keys under ``prefix`` that ``kernel``'s map (``kernel.map_name``) had in the older
    classes (:data:`OLD_KEYS`; ``"psf-learned"``: :func:`~sketchlab.featuremaps.normed.upgrade_psf_learned_keys`) and
    return it; ``ToyKernel``'s ``load_state_dict`` calls it, and so does the checkpoint's key check."""
    pairs = OLD_KEYS.get(kernel.map_name, ())
    for old, new in pairs:
        if old is None:
            state_dict.setdefault(prefix + new, kernel.get_buffer(new))
    rename_keys(state_dict, prefix, [(old, new) for old, new in pairs if old is not None])
    return upgrade_psf_learned_keys(state_dict, prefix) if kernel.map_name == "psf-learned" else state_dict
