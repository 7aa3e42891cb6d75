r"""Multi-query associative recall (MQAR): the synthetic task behind the shipped Q/K dump.

A sequence holds ``num_pairs`` key–value pairs ``k_1 v_1 k_2 v_2 …`` followed by a region of
filler tokens in which ``num_queries`` of the keys reappear, each once, at random positions and in
random order. At the position of a queried key the model must predict the value that followed
that key in the context (next-token prediction, as in Zoology). Every other position carries
the ignore label ``-100``.

Token ids: ``0`` is the filler, keys are drawn without replacement from ``[1, 1 + K)`` and values
without replacement from ``[1 + K, vocab_size)``, with ``K = (vocab_size - 1) // 2`` key tokens.

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

__all__ = ["IGNORE_INDEX", "MQARConfig", "mqar_accuracy", "mqar_batch"]

IGNORE_INDEX = -100
"""Label of positions that carry no target (``torch.nn.functional.cross_entropy`` default)."""


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
        Keys queried per sequence (each at most once); ``None`` queries every key.
    """

    vocab_size: int
    num_pairs: int
    seq_len: int
    num_queries: int | None = None

    def __post_init__(self):
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

    @property
    def num_keys(self) -> int:
        """Size of the key alphabet ``K = (vocab_size - 1) // 2``."""
        return (self.vocab_size - 1) // 2

    @property
    def queries(self) -> int:
        """Queries per sequence (``num_queries``, or ``num_pairs`` when that is ``None``)."""
        return self.num_pairs if self.num_queries is None else self.num_queries

    def to_dict(self) -> dict:
        return asdict(self)


def mqar_batch(
    config: MQARConfig, batch_size: int, *, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` MQAR sequences.

    Parameters
    ----------
    config : MQARConfig
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
    if not isinstance(config, MQARConfig):
        raise TypeError(f"config must be an MQARConfig, got {type(config).__name__}")
    B = check_positive_int(batch_size, "batch_size")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
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
