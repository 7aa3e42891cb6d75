r"""The sparse exact cache of far keys (DESIGN §7): keys that leave the window stay exact while their recall score
(the far state's error for them) ranks among the ``K`` greatest; the least is evicted into the far state.
:mod:`.score` is that score, :mod:`.schedule` takes those choices (no gradient) for a whole call, :mod:`.chunk` reads the exact keys per
query chunk, :mod:`.recurrent` is one decoding step of every memory mechanism (the lean step's compiled choice is in
:mod:`sketchlab.attention.ops.fused_recurrent`). The definition, token by token in float64, is :mod:`.naive`
(:func:`sketchlab.attention.memory.memory_attention_naive` checks and calls it); the fast path
:mod:`sketchlab.attention.memory_fast`.
"""
