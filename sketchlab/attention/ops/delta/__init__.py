r"""The (gated) delta rule: :mod:`.naive` (the float64 loop, the definition), :mod:`.chunk` (the chunked WY/UT
form, differentiable by autograd) and :mod:`.beta` (the write strength β and the unit keys), :mod:`.recurrent` (the lean decoding step's write), layout ``[B, T, H, ·]``; the state overwrites what it holds for a key
instead of adding to it:

.. math:: S_t = \alpha_t S_{t-1} + \beta_t k_t (v_t - \alpha_t S_{t-1}^\top k_t)^\top,\qquad o_t = S_t^\top q_t,

with :math:`\alpha_t = e^{\text{log\_alpha}_t}` in ``(0, 1]`` (1: the plain delta rule). The memory mechanisms
run their far part through it under ``state="delta"`` (DESIGN §7).

References
----------
S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim. *Parallelizing Linear Transformers with the Delta Rule over
Sequence Length*, NeurIPS 2024. — S. Yang, J. Kautz, A. Hatamizadeh. *Gated Delta Networks*, ICLR 2025.
"""
