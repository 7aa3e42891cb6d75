r"""The additive state: plain causal linear attention, :math:`S_t = S_{t-1} + \phi(k_t) v_t^\top`,
:math:`z_t = z_{t-1} + \phi(k_t)`, :math:`o_t = S_t^\top\phi(q_t) / (z_t\cdot\phi(q_t) + \varepsilon)` (layout
``[B, T, H, ·]``), and the sliding-window hybrid over it. :mod:`.chunk` (the linear block core and the chunked
driver, chunk_attention), :mod:`.far` (the far state both block cores share), :mod:`.chunk_hybrid` (the hybrid's
block core), :mod:`.hybrid_driver` (the hybrid's blocks and non-causal band), :mod:`.recurrent` (one decoding
step), :mod:`.parallel` (one chunk, the masked quadratic form); :mod:`.naive` is the float64 twin
(:func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive`).
"""
