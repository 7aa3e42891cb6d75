r"""Decayed linear attention (the additive state, optionally forgetting): :mod:`.naive` (the float64 loop, the
definition), :mod:`.chunk` (the chunked form, differentiable by autograd) and :mod:`.decay` (the decay of a
step from the far parameters), :mod:`.recurrent` (the lean decoding step's decay), layout ``[B, T, H, ·]``:

.. math:: S_t = \gamma_t S_{t-1} + \phi(k_t) v_t^\top,\quad z_t = \gamma_t z_{t-1} + \phi(k_t),\quad
          \text{num}_t = S_t^\top \phi(q_t),\quad \text{den}_t = z_t\cdot\phi(q_t),

with :math:`\gamma_t = e^{\text{log\_decay}_t}` in ``(0, 1]``. The memory mechanisms run their far part through it
(DESIGN §7: a stream of ``T`` events, a null event ``φ = 0, v = 0``).

References
----------
S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. *Gated Linear Attention Transformers with Hardware-Efficient
Training*, ICML 2024.
"""
