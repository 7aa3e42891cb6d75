r"""Multi-query associative recall (MQAR): the synthetic task behind the shipped Q/K dump.

A sequence holds ``num_pairs`` key–value pairs ``k_1 v_1 k_2 v_2 …`` followed by a region of
filler tokens in which ``num_queries`` of the keys reappear, each once, at random positions and in
random order. At the position of a queried key the model must predict the value that followed
that key in the context (next-token prediction, as in Zoology). Every other position carries
the ignore label ``-100``.

Two layouts (``MQARConfig.layout``):

``"compact"`` (the default, the shipped dump's task)
    Token ids: ``0`` is the filler, keys are drawn without replacement from ``[1, 1 + K)`` and
    values without replacement from ``[1 + K, vocab_size)``, with ``K = (vocab_size - 1) // 2``
    key tokens; queries at uniformly random positions of the query region.
``"zoology"`` (Zoology's ``multiquery_ar`` generator, restated)
    Keys from ``[1, V/2)``, values from ``[V/2, V)`` (``V = vocab_size``, ``V/2`` rounded down);
    every key is queried once, at query-region offset ``2g`` (even offsets) where the gaps ``g``
    are drawn without replacement from ``{0, …, (T − 2P)/2 − 1}`` with probability
    ``∝ (g + 1)^{a − 1}`` (a power law, ``a = power_a = 0.01``: near queries are likelier, as
    repeated bigrams in text); every other query-region position holds a uniformly random token
    of ``[0, V)`` (Zoology's ``random_non_queries``, the default; ``random_non_queries=False``: the filler ``0``),
    so the model cannot find queries by their being the only non-filler tokens.

:class:`MQARMixture` is Zoology's training distribution: several ``(T, P)`` configurations, each
batch drawn from one of them with probability proportional to its weight (Zoology's standard
mixture :func:`zoology_mixture`: ``(64, 4), (128, 8), (256, 16), (256, 32), (256, 64)`` with
100k : 20k : 20k : 20k : 20k examples, so weights 5 : 1 : 1 : 1 : 1).

References
----------
Arora et al. *Zoology: Measuring and Improving Recall in Efficient Language Models*, 2023 (MQAR).
Arora et al. *Simple linear attention language models balance the recall-throughput tradeoff*
(BASED), 2024.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .._validation import check_positive_int

__all__ = [
    "HELDOUT_OFFSET", "IGNORE_INDEX", "MQARConfig", "MQARMixture", "ZOOLOGY_TEST", "ZOOLOGY_TRAIN", "mqar_accuracy", "mqar_batch",
    "zoology_mixture", "zoology_tests",
]

LAYOUTS = ("compact", "zoology")

ZOOLOGY_TRAIN = ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64))
"""Zoology's standard training mixture ``(seq_len T, key–value pairs P)`` (weights 5:1:1:1:1)."""
ZOOLOGY_TRAIN_WEIGHTS = (5.0, 1.0, 1.0, 1.0, 1.0)
ZOOLOGY_TEST = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256))
"""Zoology's test configurations ``(T, P)``: the training ones and longer."""

IGNORE_INDEX = -100
"""Label of positions that carry no target (``torch.nn.functional.cross_entropy`` default)."""

HELDOUT_OFFSET = 1_000_003
"""Held-out sequences come from ``seed + HELDOUT_OFFSET (+ i)``, never from the training stream ``seed``."""


@dataclass(frozen=True)
class MQARConfig:
    """Parameters of an MQAR distribution.

    Parameters
    ----------
    vocab_size : int
        Number of token ids, including the filler ``0``; must leave ``num_pairs`` distinct keys
        and ``num_pairs`` distinct values (``vocab_size >= 2 * num_pairs + 1``).
    num_pairs : int
        Key–value pairs in the context.
    seq_len : int
        Sequence length ``T``; the query region has ``T - 2 * num_pairs`` positions, which must
        hold the ``num_queries`` queries.
    num_queries : int or None
        Keys queried per sequence (each at most once); ``None`` queries every key (the only
        choice of the ``"zoology"`` layout).
    layout : {"compact", "zoology"}
        Token and query layout (module docstring). ``"zoology"`` needs ``seq_len`` even and
        ``seq_len >= 4 * num_pairs`` (one even query slot per pair), as Zoology asserts.
    power_a : float in (0, 1]
        Power-law exponent of the ``"zoology"`` query gaps (``1``: uniform); ignored by ``"compact"``.
    random_non_queries : bool
        ``"zoology"``: the query region's other positions hold uniformly random tokens (Zoology's default)
        or, ``False``, the filler ``0`` (Zoology's ``random_non_queries=False``); ``"compact"`` takes only ``True``
        (its filler is always ``0``).
    """

    vocab_size: int
    num_pairs: int
    seq_len: int
    num_queries: int | None = None
    layout: str = "compact"
    power_a: float = 0.01
    random_non_queries: bool = True

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        a = self.power_a
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0 < a <= 1):
            raise ValueError(f"power_a must be a number in (0, 1], got {a!r}")
        if not isinstance(self.random_non_queries, bool):
            raise TypeError(f"random_non_queries must be True or False, got {self.random_non_queries!r}")
        if self.layout == "compact" and not self.random_non_queries:
            raise ValueError("random_non_queries=False is the 'zoology' layout's option (the compact layout's "
                             "non-queries are always the filler 0)")
        if self.layout == "zoology":
            self._check_zoology()
            return
        check_positive_int(self.vocab_size, "vocab_size")
        check_positive_int(self.num_pairs, "num_pairs")
        check_positive_int(self.seq_len, "seq_len")
        if self.num_queries is not None:
            check_positive_int(self.num_queries, "num_queries")
            if self.num_queries > self.num_pairs:
                raise ValueError(
                    f"num_queries must be <= num_pairs (each key is queried at most once), "
                    f"got num_queries={self.num_queries}, num_pairs={self.num_pairs}"
                )
        if self.num_keys < self.num_pairs or self.vocab_size - 1 - self.num_keys < self.num_pairs:
            raise ValueError(
                f"vocab_size must be >= 2 * num_pairs + 1 so that keys and values are distinct "
                f"tokens, got vocab_size={self.vocab_size}, num_pairs={self.num_pairs}"
            )
        if self.seq_len - 2 * self.num_pairs < self.queries:
            raise ValueError(
                f"seq_len must be >= 2 * num_pairs + num_queries = {2 * self.num_pairs + self.queries} "
                f"(context plus one position per query), got seq_len={self.seq_len}"
            )

    def _check_zoology(self) -> None:
        for name in ("vocab_size", "num_pairs", "seq_len"):
            check_positive_int(getattr(self, name), name)
        if self.num_queries not in (None, self.num_pairs):
            raise ValueError(f"num_queries must be None (every key is queried) with layout 'zoology', "
                             f"got num_queries={self.num_queries}")
        if self.vocab_size // 2 - 1 < self.num_pairs:
            raise ValueError(f"vocab_size must be >= 2 * num_pairs + 2 with layout 'zoology' (keys in [1, V/2)), "
                             f"got vocab_size={self.vocab_size}, num_pairs={self.num_pairs}")
        if self.seq_len % 2 or self.seq_len < 4 * self.num_pairs:
            raise ValueError(f"seq_len must be even and >= 4 * num_pairs = {4 * self.num_pairs} with layout "
                             f"'zoology' (one even query slot per pair), got seq_len={self.seq_len}")

    @property
    def num_keys(self) -> int:
        """Size of the key alphabet: ``(vocab_size - 1) // 2`` (compact), ``vocab_size // 2 - 1`` (zoology)."""
        return self.vocab_size // 2 - 1 if self.layout == "zoology" else (self.vocab_size - 1) // 2

    @property
    def queries(self) -> int:
        """Queries per sequence (``num_queries``, or ``num_pairs`` when that is ``None``)."""
        return self.num_pairs if self.num_queries is None else self.num_queries

    def to_dict(self) -> dict:
        """The fields as a dict; the compact layout omits ``layout`` and ``power_a``, and ``random_non_queries``
        is omitted when ``True`` (earlier runs' identity)."""
        out = asdict(self)
        if self.layout == "compact":
            del out["layout"], out["power_a"]
        if self.random_non_queries:
            del out["random_non_queries"]
        return out


@dataclass(frozen=True)
class MQARMixture:
    """A training distribution over several :class:`MQARConfig` (Zoology's data mixture).

    Each batch comes from one component, drawn with probability ``weights[i] / Σ weights`` from
    the batch generator (so a batch has one sequence length). All components share ``vocab_size``.
    """

    components: tuple
    weights: tuple

    def __post_init__(self):
        comps, weights = tuple(self.components), tuple(self.weights)
        if not comps or not all(isinstance(c, MQARConfig) for c in comps):
            raise TypeError(f"components must be a non-empty sequence of MQARConfig, got {self.components!r}")
        if len(weights) != len(comps):
            raise ValueError(f"weights must have one entry per component ({len(comps)}), got {len(weights)}")
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w > 0 and w < float("inf")):
                raise ValueError(f"weights must be finite numbers > 0, got {weights!r}")
        vocab = {c.vocab_size for c in comps}
        if len(vocab) != 1:
            raise ValueError(f"the components must share one vocab_size, got {sorted(vocab)}")
        object.__setattr__(self, "components", comps)
        object.__setattr__(self, "weights", tuple(float(w) for w in weights))

    @property
    def vocab_size(self) -> int:
        return self.components[0].vocab_size

    def to_dict(self) -> dict:
        return {"mixture": [c.to_dict() for c in self.components], "weights": list(self.weights)}


def zoology_mixture(vocab_size: int = 8192, pairs=ZOOLOGY_TRAIN, weights=ZOOLOGY_TRAIN_WEIGHTS,
                    power_a: float = 0.01, random_non_queries: bool = True) -> MQARMixture:
    """Zoology's training mixture: one ``"zoology"``-layout component per ``(seq_len, num_pairs)`` of ``pairs``."""
    comps = tuple(MQARConfig(vocab_size, P, T, layout="zoology", power_a=power_a,
                             random_non_queries=random_non_queries) for T, P in pairs)
    return MQARMixture(comps, tuple(weights))


def zoology_tests(vocab_size: int = 8192, pairs=ZOOLOGY_TEST, power_a: float = 0.01,
                  random_non_queries: bool = True) -> tuple:
    """Zoology's test configurations as ``"zoology"``-layout :class:`MQARConfig` (one per ``(T, P)``)."""
    return tuple(MQARConfig(vocab_size, P, T, layout="zoology", power_a=power_a,
                            random_non_queries=random_non_queries) for T, P in pairs)


def mqar_batch(
    config: MQARConfig | MQARMixture, batch_size: int, *, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` MQAR sequences.

    Parameters
    ----------
    config : MQARConfig or MQARMixture
        A mixture first draws its component (one per batch) from ``generator``.
    batch_size : int
    generator : torch.Generator
        The only source of randomness: the same generator state gives the same batch.

    Returns
    -------
    inputs : LongTensor ``[B, T]``
        ``k_1 v_1 … k_P v_P`` then the query region (filler ``0`` and the queried keys).
    targets : LongTensor ``[B, T]``
        The value of the queried key at each query position, ``IGNORE_INDEX`` elsewhere.

    Notes
    -----
    Key ``i`` of a sequence is ``1 + perm_K[i]`` and its value ``1 + K + perm_V[i]`` with random
    permutations, so keys (and values) within a sequence are distinct. Query positions are a
    uniformly random subset of the query region, and the queried keys a random subset of the
    pairs in random order.
    """
    if not isinstance(config, (MQARConfig, MQARMixture)):
        raise TypeError(f"config must be an MQARConfig or MQARMixture, got {type(config).__name__}")
    B = check_positive_int(batch_size, "batch_size")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if isinstance(config, MQARMixture):
        w = torch.tensor(config.weights, dtype=torch.float64)
        config = config.components[int(torch.multinomial(w, 1, generator=generator))]
    if config.layout == "zoology":
        return _zoology_batch(config, B, generator)
    P, T, Q, K = config.num_pairs, config.seq_len, config.queries, config.num_keys
    V = config.vocab_size - 1 - K  # size of the value alphabet
    R = T - 2 * P  # query-region length

    keys = 1 + torch.rand(B, K, generator=generator).argsort(dim=1)[:, :P]  # [B, P]
    values = 1 + K + torch.rand(B, V, generator=generator).argsort(dim=1)[:, :P]  # [B, P]
    which = torch.rand(B, P, generator=generator).argsort(dim=1)[:, :Q]  # [B, Q] pair queried
    where = torch.rand(B, R, generator=generator).argsort(dim=1)[:, :Q]  # [B, Q] query slot

    inputs = torch.zeros(B, T, dtype=torch.long)
    inputs[:, 0 : 2 * P : 2] = keys
    inputs[:, 1 : 2 * P : 2] = values
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    pos = 2 * P + where  # [B, Q] absolute query positions
    inputs.scatter_(1, pos, keys.gather(1, which))
    targets.scatter_(1, pos, values.gather(1, which))
    return inputs, targets


def _zoology_batch(config: MQARConfig, B: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``"zoology"`` layout (module docstring): keys ``[1, V/2)``, values ``[V/2, V)``, power-law gaps."""
    P, T, V = config.num_pairs, config.seq_len, config.vocab_size
    half = V // 2
    keys = 1 + torch.rand(B, half - 1, generator=generator).argsort(dim=1)[:, :P]  # [B, P] in [1, V/2)
    values = half + torch.rand(B, V - half, generator=generator).argsort(dim=1)[:, :P]  # [B, P] in [V/2, V)
    space = (T - 2 * P) // 2  # even query slots
    prob = config.power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (config.power_a - 1)  # [space]
    gaps = torch.multinomial(prob.expand(B, space), P, replacement=False, generator=generator)  # [B, P]
    inputs = (torch.randint(0, V, (B, T), generator=generator) if config.random_non_queries
              else torch.zeros(B, T, dtype=torch.long))  # the non-query tokens
    inputs[:, 0 : 2 * P : 2] = keys
    inputs[:, 1 : 2 * P : 2] = values
    pos = 2 * P + 2 * gaps  # [B, P] query positions, key i queried at the i-th drawn gap
    inputs.scatter_(1, pos, keys)
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    targets.scatter_(1, pos, values)
    return inputs, targets


def mqar_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of query positions (``targets != IGNORE_INDEX``) whose argmax is the target.

    ``logits`` is ``[B, T, vocab]``, ``targets`` ``[B, T]``.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits [B, T, vocab] and targets [B, T] disagree: {tuple(logits.shape)} vs {tuple(targets.shape)}"
        )
    mask = targets != IGNORE_INDEX
    if not bool(mask.any()):
        raise ValueError("targets has no query position (every label is IGNORE_INDEX)")
    return float((logits.argmax(-1)[mask] == targets[mask]).float().mean())
