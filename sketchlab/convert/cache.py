"""Decoding state for converted transformers models: a ``Cache`` of :class:`AttentionState` s.

transformers' attention calls ``cache.update(key, value, layer_idx)`` before the attention
function and attends to what it returns. :class:`SketchStateCache` returns the new keys and values
unchanged and keeps, per layer, only the :class:`sketchlab.attention.AttentionState` that the
converted attention (:func:`sketchlab.convert.sketched.hf_attention`) continues from and replaces —
``S [B, H, M, Dv]``, ``z [B, H, M]``, the last ``w`` keys and values and the sinks' — so memory
stays constant in the context length. ``get_seq_length`` counts the tokens seen (positions and
rotary angles continue from it).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention.state import TensorState

__all__ = ["SketchStateCache", "StateLayer"]


def _state_map(state, fn):
    """``state`` with ``fn`` applied to each of its tensor fields (batch on axis 0); the base's map, so a
    :class:`MemoryState`'s decoding layout is laid out again from the new fields."""
    return None if state is None else TensorState.map_tensors(state, fn)


class StateLayer(CacheLayerMixin):
    """One layer of :class:`SketchStateCache`: its :class:`AttentionState` (``None`` before the
    first call) and the number of tokens seen.

    While decoding, the layer holds its lean decoder instead (:attr:`decoder`:
    :meth:`SketchedAttention.decoder <sketchlab.convert.sketched.SketchedAttention.decoder>`, in place);
    reading :attr:`state` writes the state out of it (and ends it), setting it replaces both."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self._state, self.decoder = None, None
        self.seen = 0

    @property
    def state(self):
        if self.decoder is not None:
            self._state, self.decoder = self.decoder.state(), None
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state, self.decoder = value, None

    @property
    def offset(self) -> int:
        """Tokens the state holds (without writing a decoder's state out)."""
        held = self.decoder if self.decoder is not None else self._state
        return getattr(held, "offset", 0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Count the new tokens; return their keys and values as given (the attention folds them
        into :attr:`state`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.seen, self.is_initialized = None, 0, False  # (the decoder too)

    def offload(self):  # the state is small: it stays where it is
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = _state_map(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = _state_map(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = _state_map(self.state, lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("SketchStateCache cannot crop: a recurrent state cannot forget tokens "
                             "(assisted and speculative decoding are not supported)")


class SketchStateCache(Cache):
    """A transformers ``Cache`` with one :class:`StateLayer` per layer of a converted model.

    ``generate()`` of a model converted by :func:`sketchlab.convert_attention` creates one by
    default; pass one as ``cache=`` (with ``use_cache=True``) to a forward call to continue a
    sequence from the previous call's end.

    Parameters
    ----------
    num_layers : int
        The model's decoder layers (``config.num_hidden_layers``).
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[StateLayer() for _ in range(int(num_layers))])

    def state_bytes(self) -> int:
        """Bytes held by the states (or the decoders' buffers) of every layer (constant in the context length)."""
        return sum(held.nbytes for layer in self.layers
                   if (held := layer.decoder if layer.decoder is not None else layer._state) is not None)
