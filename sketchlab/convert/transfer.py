"""Attention transfer (LoLCATs' stage 1) and its one loss, :func:`transfer_loss`.

Stage 1 of :func:`sketchlab.linearize` (the model family): Adam on each converted layer's feature maps,
gate and memory scalars, its sketched attention matched to the teacher's recorded output on the teacher's
own q, k, v (:class:`~sketchlab.convert.teacher.LayerIO`). Layers train independently, so they can be
spread over processes (:mod:`sketchlab.convert.spread`). The toy MQAR checkpoint family
(:mod:`sketchlab.convert.mqar`) adds the same loss, against softmax attention, to its fine-tuning."""

from __future__ import annotations

import numbers
import sys

import numpy as np
import torch
from torch import nn

from .._validation import check_nonnegative_int, check_positive_int
from .evaluate import progress_bar
from .spread import _check_group, _check_processes, _same_call, _spread, _trained
from .teacher import LayerIO

__all__ = ["attention_transfer", "transfer_loss"]


def transfer_loss(o: torch.Tensor, target: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    r"""The attention-transfer loss: the mean squared error of an attention output to its teacher's.

    Parameters
    ----------
    o : Tensor [B, T, H, D]
        The trained attention's output.
    target : Tensor [B, T, H, D]
        The teacher's output on the same q, k, v (not differentiated through by the callers: it is
        recorded, or computed without gradient).
    valid : Tensor [B, T] of bool, optional
        The tokens the mean runs over (``None``: all).

    Returns
    -------
    Tensor []
        ``mean over the valid (b, t) and every h, d of (o − target)²``.

    References
    ----------
    Zhang et al. *LoLCATs: On Low-Rank Linearizing of Large Language Models*, 2024 (attention transfer).
    """
    err = (o - target) ** 2  # [B, T, H, D]
    return err.mean() if valid is None else err[valid].mean()


def _layer_generator(seed: int, layer: int) -> torch.Generator:
    """Layer ``layer``'s batches: a generator seeded from ``(seed, layer)`` (numpy's ``SeedSequence``, so
    nearby seeds and layers give unrelated streams), the same whichever process trains the layer."""
    words = np.random.SeedSequence([seed % 2**64, layer]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(words[0]) | int(words[1]) << 32)


def _transfer_layer(sketch, io: LayerIO, mask, train_idx, gen, *, steps, lr, map_lr, batch_size,
                    bar=None) -> list[float]:
    """Adam on one layer's maps and gate (:func:`attention_transfer`); returns its loss curve (``bar``:
    advanced by one per step)."""
    params = _trained(sketch)
    # the gate and the memory's few per-head scalars (decay, β: FarParams) at lr, the maps at map_lr
    small = {id(sketch.gate)} | ({id(x) for x in sketch.far.parameters()} if getattr(sketch, "far", None) is not None
                                 else set())
    gate = [p for p in params if id(p) in small]
    maps = [p for p in params if id(p) not in small]
    groups = ([{"params": gate, "lr": lr}] if gate else []) + \
        ([{"params": maps, "lr": lr if map_lr is None else map_lr}] if maps else [])
    opt = torch.optim.Adam(groups, lr=lr)
    curve = []
    for _ in range(steps):
        sel = train_idx[torch.randint(len(train_idx), (min(batch_size, len(train_idx)),), generator=gen)]
        q, k, v = io.inputs(sel)
        valid = mask[sel].to(torch.bool)
        last = [p.detach().clone() for p in params]
        try:
            o = sketch(q, k, v, scaling=io.scaling, key_padding_mask=None if bool(valid.all()) else valid)
        except ValueError as err:  # the features of the trained maps stopped being finite: diverged
            if "must be finite" not in str(err):
                raise
            o = None
        loss = None if o is None else transfer_loss(o, io.out[sel], valid)
        if loss is not None and bool(torch.isfinite(loss)):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if loss is None or not bool(torch.isfinite(loss)) or not all(bool(torch.isfinite(p).all()) for p in params):
            with torch.no_grad():  # diverged: this layer stops at its last finite values (linearize keeps its start)
                for p, before in zip(params, last):
                    p.copy_(before)
            return curve + [float("nan")] * (steps - len(curve))
        curve.append(float(loss.detach()))
        if bar is not None:
            bar.update()
    return curve


def _train_own(sketches, layers, mask, train_idx, rank: int, world: int, *, steps, lr, map_lr, batch_size, seed,
               progress) -> list:
    """Stage 1 on the layers of rank ``rank`` of ``world`` (``rank, rank + world, …``); the other layers'
    curves ``None``."""
    losses = [None] * len(sketches)
    mine = range(rank, len(sketches), world)
    where = f" (process {rank} of {world})" if world > 1 else ""
    # one bar, this process's (rank 0's: its share runs beside the others', so its ETA is the stage's)
    with progress_bar(len(mine) * steps, f"stage 1: transfer{where}", progress and rank == 0, unit="step",
                      leave=True) as bar:
        for layer in mine:
            bar.set_postfix_str(f"layer {layer}")
            losses[layer] = curve = _transfer_layer(sketches[layer], layers[layer], mask, train_idx,
                                                    _layer_generator(seed, layer), steps=steps, lr=lr, map_lr=map_lr,
                                                    batch_size=batch_size, bar=bar)
            if progress:
                bar.write(f"transfer layer {layer}{where}: mse {curve[0]:.4g} -> {curve[-1]:.4g}" if curve
                          else f"transfer layer {layer}{where}: 0 steps", file=sys.stderr)
    return losses


def attention_transfer(sketches, layers: list[LayerIO], mask, train_idx, *, steps: int, lr: float = 1e-2,
                       map_lr: float | None = None, batch_size: int = 4, seed: int = 0, progress: bool = False,
                       processes: int = 1, group=None) -> list[list[float]]:
    r"""Stage 1: Adam on each layer's maps and gate, each layer given the teacher's q, k, v, independent of
    the others; the layers can be spread over processes.

    Parameters
    ----------
    sketches : list of SketchedAttention
        The converted layers (:func:`sketchlab.convert_attention`); trained in place.
    layers : list of LayerIO
        The teacher's recorded inputs and outputs of the same layers (:func:`teacher_attention`),
        ``q [N, T, H, D]``, ``k, v [N, T, H_kv, D]``, ``out [N, T, H, Dv]``.
    mask : Tensor [N, T]
        Valid tokens (1) of the recorded sequences.
    train_idx : Tensor [n] of int
        The sequences trained on.
    steps : int >= 0
        Adam steps per layer, each on ``batch_size`` sequences drawn with replacement from
        ``train_idx``; loss ``mean((o − o_teacher)²)`` over their valid tokens.
    lr : float >= 0
        The gate's learning rate.
    map_lr : float or None
        The feature maps' learning rate (``None``: ``lr``; ``0``: the maps stay fixed).
    batch_size : int >= 1
        Sequences per Adam step (``min(batch_size, len(train_idx))``).
    seed : int
        Layer ``i`` (its position in ``sketches``) draws its batches from its own generator seeded
        from ``(seed, i)`` (numpy's ``SeedSequence``): the same on whichever process trains it.
    progress : bool
        A progress bar over the steps on stderr (this process's layers; rank 0 only) and each layer's first and last
        loss as it finishes (with the process that trained it).
    processes : int >= 1
        ``N > 1`` (at most one per layer): this process and ``N − 1`` workers it spawns share the layers,
        layer ``i`` on process ``i % N``, all training at once with this process's thread count, the
        recording moved once into shared memory (it must fit in ``/dev/shm``: refused up front, naming
        the size), the trained values broadcast back (gloo on localhost). A worker's start-up costs
        ~4.6 CPU s (``analysis/results/transfer_spread.md``); a calling script needs the
        ``if __name__ == "__main__":`` guard; the workers end with this process (Linux). Refused inside
        an initialised ``torch.distributed`` group (use ``group``). DESIGN §6, *Spreading stage 1*.
    group : torch.distributed ProcessGroup or None
        The ranks to spread over, with a CPU backend (gloo; NCCL refused: pass
        ``torch.distributed.new_group(backend="gloo")``); ``None``: the default group when
        ``torch.distributed`` is initialised (``torchrun``), else this process alone. A collective call:
        every rank passes the same arguments (checked in one ``all_gather``, refused on every rank
        alike); rank ``r`` trains layers ``r, r + W, …``, then each layer is broadcast from its rank, so
        every rank ends with the same sketches and curves. The group's timeout must exceed the wait for
        the slowest rank.

    Returns
    -------
    list of list of float
        Each layer's loss curve (``steps`` values), the same on every process.

    Notes
    -----
    Spread or not, each layer runs the same operations on the same data and the broadcasts copy values
    exactly: at equal threads per process the result is bitwise that of one process.
    """
    group = _check_group(group)
    world = 1 if group is None else torch.distributed.get_world_size(group)
    try:  # with a group of several ranks, a refusal here reaches every rank (_same_call), none left waiting
        train_idx, options, processes = _checked(sketches, layers, mask, train_idx, steps=steps, lr=lr, map_lr=map_lr,
                                                 batch_size=batch_size, seed=seed, progress=progress,
                                                 processes=processes)
        if processes > 1 and group is not None:
            raise ValueError(f"processes={processes} spawns its own workers; with group= the layers spread over "
                             "that group: give one or the other")
    except ValueError as err:
        if world > 1:
            _same_call(sketches, layers, mask, train_idx, group, problem=str(err))
        raise
    return _spread(_train_own, sketches, layers, mask, train_idx, group, processes, options)


def _checked(sketches, layers, mask, train_idx, *, steps, lr, map_lr, batch_size, seed, progress, processes):
    """:func:`attention_transfer`'s arguments checked on this process: ``(train_idx as a tensor, the
    options, processes)``, else a ``ValueError`` naming the first bad one."""
    if map_lr is not None and not (isinstance(map_lr, (int, float)) and not isinstance(map_lr, bool)
                                   and 0 <= map_lr < float("inf")):
        raise ValueError(f"map_lr must be None or a finite number >= 0, got {map_lr!r}")
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 <= lr < float("inf")):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    steps = check_nonnegative_int(steps, "steps")
    batch_size = check_positive_int(batch_size, "batch_size")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    for name, items, kind, what in (("layers", layers, LayerIO, "LayerIO records (teacher_attention)"),
                                    ("sketches", sketches, nn.Module, "converted attention modules (convert_attention)")):
        bad = next((type(x).__name__ for x in items if not isinstance(x, kind)), None)
        if bad is not None:
            raise ValueError(f"{name} must be {what}, got an item of type {bad}")
    if len(sketches) != len(layers):
        raise ValueError(f"attention transfer: {len(sketches)} sketches for {len(layers)} recorded layers; "
                         "give one recorded layer (LayerIO) per converted layer")
    processes = _check_processes(processes, len(sketches))
    if any(not _trained(s) for s in sketches):
        raise ValueError("attention transfer: the converted layers have no trainable parameters (learn=False?)")
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and all(
            tuple(io.out.shape[:2]) == tuple(mask.shape) for io in layers)):
        raise ValueError(f"mask must be a tensor [N, T] matching the recorded layers' sequences "
                         f"{[tuple(io.out.shape[:2]) for io in layers[:1]]}, got {getattr(mask, 'shape', mask)!r}")
    try:
        idx = torch.as_tensor(train_idx)
    except (TypeError, ValueError, RuntimeError):
        idx = None
    if idx is None or idx.dim() != 1 or idx.numel() == 0 or idx.is_floating_point() or idx.dtype == torch.bool \
            or idx.is_complex() or int(idx.min()) < 0 or int(idx.max()) >= mask.shape[0]:
        shown = idx.tolist() if idx is not None else train_idx
        raise ValueError(f"train_idx must be a non-empty list of integer sequence indices in [0, {mask.shape[0]}) "
                         f"(not a boolean mask), got {shown!r}")
    options = dict(steps=steps, lr=float(lr), map_lr=None if map_lr is None else float(map_lr),
                   batch_size=batch_size, seed=int(seed), progress=progress)
    return idx, options, processes

