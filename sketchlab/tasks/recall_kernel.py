r"""The kernel-only recall harness: Zoology's continuous MQAR, where the attention kernel alone must recall.

Zoology's ``stacked_mqar`` / ``mqar_continuous`` (its ``zoology/data/stacked_mqar.py``): a vocabulary of ``V``
frozen random unit vectors ("spherical" embeddings, ``d = d_model`` coordinates), keys from the first half,
values from the second. A sequence holds ``P`` key-value tokens, each the concatenation ``[e_key | e_value]``
(``2d`` coordinates, the pairs in random order), then the ``P`` keys again as queries ``[e_key | 0]`` (another
random order): ``T = 2P`` tokens. At a query the model must output the value paired with its key; the
logits are the output's inner products with the ``V/2`` value embeddings (cross-entropy over them, accuracy
of their argmax).

The model (:class:`RecallModel`, Zoology's ``ContinuousInputModel`` with one layer and no state mixer) is

.. math:: h = W_{in} x,\qquad h \leftarrow h + \mathrm{Attn}(\mathrm{LN}(h)),\qquad
          \mathrm{logits} = (W_{out}\,\mathrm{LN}_f(h))\,E_{values}^\top,

with the toy model's :class:`~sketchlab.tasks.model.CausalSelfAttention` (q, k, v, o projections and any
registered kernel; no positional encoding; a short convolution only if the protocol asks): the embeddings
are frozen and there is no MLP, so only the projections and the kernel (its feature map, gate, decay, β)
learn. Recall per state byte here measures the kernel, not a model that routes around it.

:func:`attention_matrix_errors` then asks, on the trained q and k, how far each kernel's attention weights are
from exact softmax attention and from exact degree-2 polynomial attention: does a lower approximation error
buy recall?

References
----------
Arora et al. *Zoology: Measuring and Improving Recall in Efficient Language Models*, ICLR 2024 (and its
repository's ``mqar_continuous`` experiments, 2026).
"""

from __future__ import annotations

import torch
from torch import nn

from .._validation import check_positive_int, check_real
from ..attention import poly_attention_naive, softmax_attention_naive
from ..attention.options import AttentionOptions
from .model import CausalSelfAttention, TransformerConfig, TransformerLM, adamw_groups
from .mqar import HELDOUT_OFFSET, IGNORE_INDEX
from .train import training_steps

__all__ = ["RecallModel", "attention_matrix", "attention_matrix_errors", "continuous_mqar", "spherical_embeddings",
           "train_recall"]

#: Sequences whose q, k give the attention-matrix errors.
_ERROR_SEQUENCES = 16


def spherical_embeddings(vocab: int, dim: int, *, generator: torch.Generator) -> torch.Tensor:
    """``vocab`` random unit vectors ``[V, dim]`` (Gaussian rows over their norms: uniform on the sphere)."""
    vocab, dim = check_positive_int(vocab, "vocab"), check_positive_int(dim, "dim")
    e = torch.randn(vocab, dim, generator=generator)
    return e / e.norm(dim=-1, keepdim=True)


def continuous_mqar(embeddings: torch.Tensor, num_pairs: int, batch: int, *,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``batch`` continuous MQAR sequences of ``num_pairs`` pairs (module docstring).

    Parameters
    ----------
    embeddings : Tensor ``[V, d]``
        Keys are rows ``0 … V/2 − 1``, values rows ``V/2 … 2·⌊V/2⌋ − 1``.
    num_pairs : int
        ``P`` (at most ``V/2``): distinct keys and distinct values per sequence.
    batch : int
    generator : torch.Generator
        The only source of randomness.

    Returns
    -------
    inputs : Tensor ``[B, 2P, 2d]``
        Tokens ``0 … P−1``: ``[e_{key} | e_{value}]``; tokens ``P … 2P−1``: ``[e_{key} | 0]``.
    targets : LongTensor ``[B, 2P]``
        ``IGNORE_INDEX`` on the pairs; at a query, its value's index ``j`` (row ``V/2 + j``).
    """
    if not isinstance(embeddings, torch.Tensor) or embeddings.ndim != 2 or not embeddings.is_floating_point():
        raise ValueError(f"embeddings must be a floating tensor [V, d], got {getattr(embeddings, 'shape', embeddings)}")
    half = embeddings.shape[0] // 2
    P, B = check_positive_int(num_pairs, "num_pairs"), check_positive_int(batch, "batch")
    if P > half:
        raise ValueError(f"num_pairs must be at most V/2 = {half} (distinct keys per sequence), got {P}")
    draw = lambda n: torch.rand(B, n, generator=generator).argsort(-1)  # noqa: E731  a permutation per row
    keys, values = draw(half)[:, :P], draw(half)[:, :P]  # [B, P]: key i pairs with value i
    shown, asked = draw(P), draw(P)  # [B, P]: the pairs' order, the queries' order
    key_e, value_e = embeddings[:half], embeddings[half:2 * half]
    k_shown, v_shown = keys.gather(1, shown), values.gather(1, shown)
    k_asked, v_asked = keys.gather(1, asked), values.gather(1, asked)
    pairs = torch.cat([key_e[k_shown], value_e[v_shown]], -1)  # [B, P, 2d]
    queries = torch.cat([key_e[k_asked], torch.zeros_like(key_e[k_asked])], -1)  # [B, P, 2d]
    targets = torch.cat([torch.full((B, P), IGNORE_INDEX, dtype=torch.long), v_asked], 1)
    return torch.cat([pairs, queries], 1), targets


class _Block(nn.Module):
    """``h + Attn(LN(h))``: the one layer (no MLP)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attention = CausalSelfAttention(config, 0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.attention(self.ln_1(h))


class RecallModel(nn.Module):
    """The kernel-only model (module docstring): ``(inputs [B, T, 2d], mask [B, T]) → logits [N, V/2]``.

    Parameters
    ----------
    config : TransformerConfig
        ``d_model``, heads, the attention and its options, ``short_conv`` (0: none, the harness's), and
        ``vocab_size`` ``V`` (the frozen embeddings' rows); ``n_layers`` must be 1 and ``rope_base`` None (the
        harness has one layer and no positions), ``mlp_ratio`` is unused.
    embed_seed : int
        Seeds the frozen embeddings (a buffer, saved with the model).
    """

    def __init__(self, config: TransformerConfig, *, embed_seed: int = 0):
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        if config.n_layers != 1 or config.rope_base is not None:
            raise ValueError(f"the kernel-only harness has one layer and no positional encoding: config must have "
                             f"n_layers=1 and rope_base=None, got {config.n_layers} and {config.rope_base}")
        if config.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2 (keys and values), got {config.vocab_size}")
        self.config, d = config, config.d_model
        gen = torch.Generator().manual_seed(int(embed_seed))
        self.register_buffer("embeddings", spherical_embeddings(config.vocab_size, d, generator=gen))
        self.in_proj = nn.Linear(2 * d, d)
        self.blocks = nn.ModuleList([_Block(config)])  # `blocks[0].attention.attn`: as TransformerLM's
        self.ln_f = nn.LayerNorm(d)
        self.out_proj = nn.Linear(d, d)
        self.apply(TransformerLM.init_weights)

    @property
    def values(self) -> torch.Tensor:
        """The value embeddings ``[V/2, d]`` the logits score against."""
        half = self.config.vocab_size // 2
        return self.embeddings[half:2 * half]

    def forward(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V/2]`` at the ``N`` positions where ``mask [B, T]``."""
        d = self.config.d_model
        if not isinstance(inputs, torch.Tensor) or inputs.ndim != 3 or inputs.shape[-1] != 2 * d:
            raise ValueError(f"inputs must be [B, T, 2·d_model] = [B, T, {2 * d}], got "
                             f"{tuple(getattr(inputs, 'shape', ()))}")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != inputs.shape[:2]:
            raise ValueError(f"mask must be a bool tensor [B, T] = {list(inputs.shape[:2])}")
        h = self.blocks[0](self.in_proj(inputs))
        return self.out_proj(self.ln_f(h[mask])) @ self.values.T

    def kernel_parameters(self) -> list[nn.Parameter]:
        """The attention kernel's own parameters (Θ, gates, decay, β)."""
        return list(self.blocks[0].attention.attn.parameters())

    def configure_optimizers(self, *, lr: float, weight_decay: float, kernel_lr: float = 1.0) -> torch.optim.AdamW:
        """AdamW in :func:`~sketchlab.tasks.model.adamw_groups` (the kernel at ``kernel_lr`` times the rate).

        ``kernel_lr = 0`` freezes the kernel: its parameters stop requiring gradients (in place), so they are in
        no group, never step and leave the clip's norm; the kernel stays at its start (an ablation of Θ's
        training)."""
        if check_real(kernel_lr, "kernel_lr", positive=False) == 0:
            for p in self.kernel_parameters():
                p.requires_grad_(False)
            return adamw_groups(self, [], lr=lr, weight_decay=weight_decay)
        return adamw_groups(self, self.kernel_parameters(), lr=lr, weight_decay=weight_decay, kernel_lr=kernel_lr)


# ------------------------------------------------------------------------------------------------ the kernel's matrix
def attention_matrix(kernel: nn.Module, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    r"""The attention weights ``A [B, H, T, T]`` a layer's kernel applies to its values, or None.

    ``kernel(q, k, v)`` is linear in ``v`` for softmax, exact polynomial, sliding-window and every feature map
    with the additive state (the hybrid too): ``o_t = Σ_s A_{ts} v_s``, so ``v = I`` (``Dv = T``, one value per
    position) gives ``A`` itself, row ``t`` normalised as the kernel normalises. A memory option (decay, the
    delta rule, the cache) makes the output depend on ``v`` otherwise (the cache's choice reads the state, an
    input decay or β reads ``v``): None.
    """
    options = getattr(kernel, "options", None)  # a feature-map kernel's AttentionOptions (the layer core's)
    if isinstance(options, AttentionOptions) and options.memory:
        return None
    B, T, H, _ = q.shape
    eye = torch.eye(T, dtype=q.dtype, device=q.device)[None, :, None, :].expand(B, T, H, T)
    with torch.no_grad():
        return kernel(q, k, eye.contiguous()).transpose(1, 2)  # [B, T, H, T] -> [B, H, T, T]


def _exact_weights(q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """Causal softmax attention of ``s = qᵀk/√D`` and degree-2 polynomial attention ``s²/Σ s²`` (the toy model's
    scales: softmax logits ``qᵀk/√D``, maps on ``x·D^{-1/4}``), as weights ``[B, H, T, T]``: the float64 twins
    :func:`~sketchlab.attention.softmax_attention_naive` and :func:`~sketchlab.attention.poly_attention_naive`
    (``ε = 0``) on ``v = I``, as :func:`attention_matrix` reads a kernel."""
    q, k = q.double(), k.double()
    B, T, H, D = q.shape
    eye = torch.eye(T, dtype=torch.float64)[None, :, None, :].expand(B, T, H, T)
    s = D ** -0.25
    soft = softmax_attention_naive(q, k, eye)  # [B, T, H, T]
    poly = poly_attention_naive(q * s, k * s, eye, 2, eps=0.0)
    return {"softmax": soft.transpose(1, 2), "poly2": poly.transpose(1, 2)}


def attention_matrix_errors(model: RecallModel, inputs: torch.Tensor) -> dict | None:
    r"""How far the layer's attention weights are from exact attention, on the q, k it computes for ``inputs``.

    Returns ``{"softmax": e, "poly2": e}``, each the mean over sequences and heads of
    :math:`\|A - A^\ast\|_F / \|A^\ast\|_F` (causal rows, float64), ``A`` the kernel's weights
    (:func:`attention_matrix`), ``A^\ast`` softmax attention of ``s = q^\top k/\sqrt D`` or the degree-2
    polynomial attention ``s^2 / \sum s^2``; None where the kernel's output is not linear in ``v``.
    """
    kernel = model.blocks[0].attention.attn
    seen = {}

    def keep(module, args, out):  # returns None: the output is left as it is
        seen["qk"] = args[:2]

    hook = kernel.register_forward_hook(keep)
    try:
        with torch.no_grad():
            model(inputs, torch.ones(inputs.shape[:2], dtype=torch.bool))
    finally:
        hook.remove()
    q, k = seen["qk"]
    A = attention_matrix(kernel, q, k)
    if A is None:
        return None
    A = A.double()
    out = {}
    for name, ref in _exact_weights(q, k).items():
        err = (A - ref).flatten(2).norm(dim=-1) / ref.flatten(2).norm(dim=-1)  # [B, H]
        out[name] = float(err.mean())
    return out


# ------------------------------------------------------------------------------------------------ one run
def _accuracy(model: RecallModel, num_pairs: int, sequences: int, generator: torch.Generator) -> tuple[int, int]:
    correct = total = 0
    for start in range(0, sequences, 64):
        inputs, targets = continuous_mqar(model.embeddings, num_pairs, min(64, sequences - start), generator=generator)
        mask = targets != IGNORE_INDEX
        correct += int((model(inputs, mask).argmax(-1) == targets[mask]).sum())
        total += int(mask.sum())
    return correct, total


def train_recall(model: RecallModel, protocol, *, lr: float, seed: int, kernel_lr: float = 1.0) -> dict:
    """Train ``model`` on the kernel-only harness of ``protocol`` (a :class:`~sketchlab.tasks.frontier.KernelProtocol`:
    its training mixture, schedule and test slices) at rate ``lr`` from ``seed`` (the kernel at ``kernel_lr``
    times it; 0: frozen, :meth:`RecallModel.configure_optimizers`); then score it.

    Returns ``{"slices", "attention_error", "diverged"}``: per test slice ``{"seq_len", "num_pairs", "accuracy",
    "queries"}`` on held-out sequences (streams ``seed + 1_000_003 + i``); :func:`attention_matrix_errors` on
    held-out sequences of the longest training slice (None where it is not defined); a diverged run's message
    (its slices then score 0).
    """
    opt = model.configure_optimizers(lr=lr, weight_decay=protocol.weight_decay, kernel_lr=kernel_lr)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.tensor(protocol.train_weights, dtype=torch.float64)

    def batch():
        _, P = protocol.train_pairs[int(torch.multinomial(weights, 1, generator=gen))]
        return continuous_mqar(model.embeddings, P, protocol.batch, generator=gen)

    try:
        for _ in training_steps(model, opt, batch, start=0, end=protocol.steps, total=protocol.steps, lr=lr,
                                warmup=protocol.warmup, clip=1.0):
            pass
    except FloatingPointError as err:
        return {"slices": [{"seq_len": T, "num_pairs": P, "accuracy": 0.0, "queries": 0}
                           for T, P in protocol.test_pairs], "attention_error": None, "diverged": str(err)}
    model.eval()
    with torch.no_grad():
        slices = []
        for i, (T, P) in enumerate(protocol.test_pairs):
            held = torch.Generator().manual_seed(seed + HELDOUT_OFFSET + i)
            correct, total = _accuracy(model, P, protocol.eval_sequences, held)
            slices.append({"seq_len": T, "num_pairs": P, "accuracy": correct / total, "queries": total})
        longest = max(P for _, P in protocol.train_pairs)
        held = torch.Generator().manual_seed(seed + 2 * HELDOUT_OFFSET)
        inputs, _ = continuous_mqar(model.embeddings, longest, _ERROR_SEQUENCES, generator=held)
        error = attention_matrix_errors(model, inputs)
    return {"slices": slices, "attention_error": error, "diverged": None}
