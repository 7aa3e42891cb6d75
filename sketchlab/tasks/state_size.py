r"""The recurrent state of one attention layer in bytes, counted as Zoology counts it.

:func:`state_bytes` is the formula of each mechanism (Zoology's ``state_size`` of its mixers, times 4 bytes
per float32 number as its ``_compute_state_size``); :func:`layer_state_bytes` applies it to a layer of
:class:`~sketchlab.tasks.TransformerLM`, reading the number of features the far state really holds from
the layer's kernel (a self-tensored map holds ``M²``; the identity map under a normalised additive state is
self-tensored by default).

========== =================================== ==================================================
mechanism  numbers held                        Zoology
========== =================================== ==================================================
additive   ``H·(M·Dv + M)`` (``S`` and ``z``)   ``Based.state_size``: kv heads × head_dim × expanded
                                               + kv heads × expanded
delta      ``H·M·Dv`` (``S``; ``M = d_k``)      ``DeltaNet.state_size``, ``GatedDeltaNet``'s
window     ``2·w·d`` (keys and values)          ``SlidingAttn.state_size``: block_size × d_model × 2
softmax    ``2·d·L`` (the KV cache at ``L``)    ``MHA.state_size``: 2 × d_model × sequence_length
========== =================================== ==================================================

A hybrid (a feature map with ``window > 0``) holds its far state and its window. A learned decay or gate is
a number per head and is not counted (Zoology counts none either).
"""

from __future__ import annotations

import torch

from .._validation import check_nonnegative_int, check_positive_int
from .model import TransformerConfig

__all__ = ["MECHANISMS", "layer_state_bytes", "state_bytes"]

#: The mechanisms :func:`state_bytes` counts.
MECHANISMS = ("additive", "delta", "window", "softmax")


def state_bytes(mechanism: str, *, d_model: int, heads: int = 1, features: int = 0, window: int = 0,
                seq_len: int = 0, bytes_per_number: int = 4) -> int:
    """Bytes of one layer's state (module docstring's table).

    Parameters
    ----------
    mechanism : {"additive", "delta", "window", "softmax"}
    d_model : int
        Model width ``d`` (``H`` heads of ``Dv = d / H`` value coordinates each).
    heads : int
        ``H``.
    features : int
        ``M``, features per head the far state holds (additive, delta; ``d_k`` for the delta rule).
    window : int
        ``w``, keys of a sliding window (window).
    seq_len : int
        ``L``, the length at which softmax's KV cache is counted (softmax).
    bytes_per_number : int
        4 (float32), as Zoology.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {list(MECHANISMS)}, got {mechanism!r}")
    d, H = check_positive_int(d_model, "d_model"), check_positive_int(heads, "heads")
    if d % H:
        raise ValueError(f"d_model must be divisible by heads, got d_model={d}, heads={H}")
    need = {"additive": "features", "delta": "features", "window": "window", "softmax": "seq_len"}[mechanism]
    size = check_positive_int({"features": features, "window": window, "seq_len": seq_len}[need],
                              f"{need} (mechanism {mechanism!r})")
    numbers = {"additive": H * (size * (d // H) + size), "delta": H * size * (d // H), "window": 2 * size * d,
               "softmax": 2 * d * size}[mechanism]
    return numbers * check_positive_int(bytes_per_number, "bytes_per_number")


def layer_state_bytes(config: TransformerConfig, *, seq_len: int = 0) -> int:
    """Bytes of the state of one attention layer of a :class:`~sketchlab.tasks.TransformerLM` of ``config``.

    ``"softmax"``: its KV cache at ``seq_len``; ``"sliding-window"``: its window; a feature-map kernel: its far
    state (``additive`` or ``delta``, the features counted on the kernel's own state after two tokens) plus
    its window's keys and values when ``window > 0``.
    """
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
    seq_len = check_nonnegative_int(seq_len, "seq_len")
    d, H, opts = config.d_model, config.n_heads, config.attention_options
    if config.attention == "softmax":
        return state_bytes("softmax", d_model=d, seq_len=seq_len)
    if config.attention == "sliding-window":
        return state_bytes("window", d_model=d, window=opts["window"])
    from .model import _ATTENTION

    kernel = _ATTENTION[config.attention](config, 0)
    if getattr(kernel, "map_q", None) is None:
        raise ValueError(f"attention {config.attention!r} keeps no fixed-size state (exact attention): "
                         "it has no state size to count")
    x = torch.ones(1, 2, H, config.head_dim)
    with torch.no_grad():
        _, state = kernel.step(x, x, x, None)  # S [1, H, M, Dv]
    far = state_bytes(opts.get("state", "additive"), d_model=d, heads=H, features=state.S.shape[-2])
    window = opts.get("window", 0)
    return far + (state_bytes("window", d_model=d, window=window) if window else 0)
