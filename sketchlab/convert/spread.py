"""Stage 1 of :func:`sketchlab.linearize` spread over a ``torch.distributed`` group's ranks or ``processes − 1``
spawned workers: layer ``i`` trained on rank ``i % W`` by the ``train`` handed in
(:func:`sketchlab.convert.transfer._train_own`), then broadcast to every rank (DESIGN §6)."""

from __future__ import annotations

import copy
import ctypes
import datetime
import math
import numbers
import os
import signal
import sys

import torch

__all__ = ["SPREAD_TIMEOUT"]


def _check_processes(processes, layers: int) -> int:
    """``processes`` as an int in ``[1, layers]``, else a ``ValueError`` naming it (and ``layers``: refused,
    not clamped, since a process with no layer would only pay its start-up, and a silent clamp would
    report settings that did not run); ``> 1`` is refused
    inside an initialised ``torch.distributed`` group (which spreads the layers by itself) and where
    ``torch.distributed`` is not built in."""
    if isinstance(processes, bool) or not isinstance(processes, numbers.Integral) or processes < 1:
        raise ValueError(f"processes must be an integer >= 1 (the processes stage 1 spreads its layers over), "
                         f"got {processes!r}")
    if processes > 1:
        import torch.distributed as dist

        if not dist.is_available():
            raise ValueError(f"processes={processes}: this torch is built without torch.distributed, which the "
                             "spread needs: use processes=1")
        if dist.is_initialized():
            raise ValueError(f"processes={processes}: this process already belongs to a torch.distributed group "
                             "(torchrun?), over which attention transfer spreads the layers by itself: leave "
                             "processes=1")
        if processes > layers:
            raise ValueError(f"processes={processes} exceeds the {layers} layers to train (one layer per process "
                             f"at most: the others would train nothing): use processes <= {layers}")
    return int(processes)


def _check_group(group):
    """The group stage 1 spreads over: ``group`` itself (a ``ProcessGroup`` with a CPU backend, this
    process a member), or for ``None`` the default group when ``torch.distributed`` is initialised, else
    ``None`` (this process alone). A ``ValueError`` names any other value."""
    import torch.distributed as dist

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group, what = dist.group.WORLD, "the default torch.distributed group"
    else:
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        what = "group="
    if dist.get_rank(group) < 0:
        raise ValueError("attention_transfer: this process is not a member of group=")
    backend = str(dist.get_backend(group))
    if backend not in ("gloo", "mpi") and "cpu:" not in backend:
        raise ValueError(f"attention_transfer: {what} has backend {backend!r}, which cannot broadcast the CPU "
                         "tensors stage 1 trains; pass group=torch.distributed.new_group(backend=\"gloo\")")
    return group


def _trained(sketch) -> list[torch.Tensor]:
    """The tensors stage 1 changes in one converted layer: its parameters that require grad."""
    return [p for p in sketch.parameters() if p.requires_grad]


#: What :func:`_same_call` compares, in order: exactly, then to a relative 1e-6.
_SAME_EXACT = ("layers", "steps", "batch_size", "seed (high 32 bits)", "seed (low 32 bits)", "lr", "map_lr",
               "train_idx", "sum of train_idx", "valid tokens", "trained values")
_SAME_INEXACT = ("sum of the trained values", "sum of the teacher outputs")
_MESSAGE_BYTES = 600  # of a refusing rank's message, carried in the same gather


def _same_call(sketches, layers, mask, train_idx, group, problem=None, **options) -> None:
    """Refuse (on every rank alike, so none waits forever in a collective) a spread call that a rank
    refused by itself (``problem``: its error message, then re-raised there and named on the others), or
    whose ranks disagree on what they train: layer count, options, sequences, the maps' sizes and starting
    values, the teacher's outputs (float64 sums, compared to a relative 1e-6: the same recording on every
    rank agrees to round-off, another text or model differs at O(1)). One ``all_gather``."""
    import torch.distributed as dist

    if problem is None:
        seed = options["seed"] % 2**64  # what transfer._layer_generator uses; two float64-exact halves
        exact = [len(sketches), options["steps"], options["batch_size"], seed >> 32, seed & 0xFFFFFFFF, options["lr"],
                 -1.0 if options["map_lr"] is None else options["map_lr"], len(train_idx),
                 float(train_idx.double().sum()), float(mask.double().sum()),
                 sum(p.numel() for s in sketches for p in _trained(s))]
        with torch.no_grad():
            inexact = [sum(float(p.double().sum()) for s in sketches for p in _trained(s)),
                       sum(float(io.out.sum(dtype=torch.float64)) for io in layers)]
        text = b""
    else:
        exact, inexact = [math.nan] * len(_SAME_EXACT), [math.nan] * len(_SAME_INEXACT)
        text = problem.encode()[:_MESSAGE_BYTES]
    message = torch.zeros(_MESSAGE_BYTES, dtype=torch.float64)
    message[:len(text)] = torch.tensor(list(text), dtype=torch.float64)
    mine = torch.cat([torch.tensor([float(problem is not None), len(text), *map(float, exact), *map(float, inexact)],
                                   dtype=torch.float64), message])
    world = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every)  # [ranks, 2 + items + message bytes]
    refused = [r for r in range(world) if every[r, 0] > 0]
    if problem is not None:
        raise ValueError(problem)
    if refused:
        r = refused[0]
        n = int(every[r, 1])
        said = bytes(int(b) for b in every[r, -_MESSAGE_BYTES:][:n]).decode(errors="replace")
        raise ValueError(f"attention_transfer over {world} processes: rank {r} refused its arguments ({said}); "
                         "every rank must call it with the same, valid arguments")
    values = every[:, 2:-_MESSAGE_BYTES]
    for j, name in enumerate([*_SAME_EXACT, *_SAME_INEXACT]):
        col = values[:, j]
        spread = float(col.max() - col.min())
        if (spread > 0) if j < len(_SAME_EXACT) else spread > 1e-6 * max(1.0, float(col.abs().max())):
            raise ValueError(f"attention_transfer over {len(col)} processes: the ranks disagree on {name} "
                             f"({', '.join(f'{float(x):.10g}' for x in col)} on ranks 0..{len(col) - 1}); "
                             "every rank must call it with the same sketches, recorded layers, mask, train_idx "
                             "and options")


def _share(sketches, losses, steps: int, group) -> list[list[float]]:
    """Every layer's trained parameters and loss curve broadcast from its owner (rank ``layer %
    world``) to the other ranks, in place; returns the curves, the same on every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    curves = []
    with torch.no_grad():
        for layer, sketch in enumerate(sketches):
            src = dist.get_global_rank(group, layer % world)
            for p in _trained(sketch):
                buf = p.detach() if p.is_contiguous() else p.detach().contiguous()
                dist.broadcast(buf, src=src, group=group)
                if buf.data_ptr() != p.data_ptr():
                    p.copy_(buf)
            curve = torch.tensor(losses[layer] if layer % world == rank else [0.0] * steps, dtype=torch.float64)
            if steps:
                dist.broadcast(curve, src=src, group=group)
            curves.append(curve.tolist())
    return curves


#: How long a process of a ``processes=N`` spread waits in the group's rendezvous for the others to finish
#: their shares (about one layer's training plus the difference in start-up; the broadcasts then wait on nothing).
SPREAD_TIMEOUT = datetime.timedelta(hours=24)


def _end_with(parent: int) -> None:
    """Linux: this process gets SIGTERM when ``parent`` (its parent) ends, so a spawned worker never
    outlives a killed caller (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the call
        os._exit(1)


def _worker(index, port, world, threads, train, sketches, layers, mask, train_idx, options, parent):
    """Rank ``index + 1`` of a ``processes=N`` spread (:func:`~sketchlab.convert.transfer.attention_transfer`; run by
    ``torch.multiprocessing`` in a spawned process, ``layers`` in shared memory): trains its layers at
    once, alongside this process's parent, then says it is ready and joins the group for the broadcasts."""
    import torch.distributed as dist

    _end_with(parent)
    rank = index + 1
    torch.set_num_threads(threads)
    mine = copy.deepcopy(sketches)  # the layers are read in place; the sketches, which train, are our own
    losses = train(mine, layers, mask, train_idx, rank, world, **options)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=SPREAD_TIMEOUT)
    store.set(f"ready/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=SPREAD_TIMEOUT)
    try:
        _share(mine, losses, options["steps"], dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _shared(layers, mask, train_idx) -> None:
    """The recording moved into shared memory (``/dev/shm`` on Linux) in place, once, before the workers
    are spawned; a ``RuntimeError`` naming ``/dev/shm``, the size needed and ``processes=1`` when it does
    not fit (a container's small ``/dev/shm``: Docker's default is 64 MiB)."""
    tensors = [mask, train_idx, *(t for io in layers for t in (io.q, io.k, io.v, io.out))]
    storages = {t.untyped_storage().data_ptr(): t for t in tensors if not t.is_shared()}
    need = sum(t.untyped_storage().nbytes() for t in storages.values())
    free = _shm_free()
    if free is not None and need > free:
        raise RuntimeError(_shm_message(need, f"{free / 2**20:.1f} MiB free"))
    try:
        for t in storages.values():
            t.share_memory_()
    except RuntimeError as err:
        raise RuntimeError(_shm_message(need, str(err).splitlines()[0] if str(err) else type(err).__name__)) from err


def _shm_free() -> int | None:
    """Bytes free in ``/dev/shm``, ``None`` where there is none to ask (not Linux)."""
    try:
        st = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _shm_message(need: int, why: str) -> str:
    return (f"attention_transfer, processes>1: the recorded layers ({need / 2**20:.1f} MiB) do not fit in shared "
            f"memory /dev/shm ({why}); give /dev/shm at least that much (Docker: --shm-size) or use processes=1")


def _stop(ctx, wait: float = 5.0) -> None:
    """The spawned workers ended: terminated if still running, joined (no zombies), killed if they do not
    end within ``wait`` seconds."""
    for proc in ctx.processes:
        if proc.is_alive():
            proc.terminate()
    for proc in ctx.processes:
        proc.join(wait)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _spawned(train, sketches, layers, mask, train_idx, processes: int, options: dict) -> list[list[float]]:
    """Stage 1 spread over this process (rank 0) and ``processes − 1`` spawned workers (gloo on localhost),
    each running ``train`` on its share at once; the trained parameters reach this process's ``sketches``
    through the broadcasts once every process has trained its share."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    _shared(layers, mask, train_idx)
    store = dist.TCPStore("127.0.0.1", 0, processes, is_master=True, wait_for_workers=False, timeout=SPREAD_TIMEOUT)
    ctx = mp.start_processes(_worker, nprocs=processes - 1, join=False, start_method="spawn",
                             args=(store.port, processes, torch.get_num_threads(), train, copy.deepcopy(sketches),
                                   layers, mask, train_idx, options, os.getpid()))  # copies: ours stay put
    try:  # this process's layers train while the workers start and train theirs (the same call everywhere:
        # no _same_call); the group forms once every process has trained its share
        losses = train(sketches, layers, mask, train_idx, 0, processes, **options)
        for rank in range(1, processes):  # every worker done training before the group
            while not store.check([f"ready/{rank}"]):
                ctx.join(timeout=0.05)  # raises ProcessException when a worker failed
                if ctx.processes[rank - 1].exitcode is not None and not store.check([f"ready/{rank}"]):
                    raise RuntimeError(f"attention_transfer, processes={processes}: spawned worker {rank} ended "
                                       f"(exit code {ctx.processes[rank - 1].exitcode}) before training its layers")
        dist.init_process_group("gloo", store=store, rank=0, world_size=processes, timeout=SPREAD_TIMEOUT)
        try:
            try:
                losses = _share(sketches, losses, options["steps"], dist.group.WORLD)
            except RuntimeError as err:  # gloo's error when a peer is gone: the worker's own error too, if any
                try:
                    ctx.join(timeout=10)
                except ProcessException as worker_err:
                    raise RuntimeError(f"attention_transfer, processes={processes}: {err}; a spawned worker "
                                       f"failed: {worker_err}") from err
                raise
            while not ctx.join():  # the workers leave the group first, then this process
                pass
        finally:
            dist.destroy_process_group()
    except ProcessException as err:  # a worker failed: its exception and traceback
        raise RuntimeError(f"attention_transfer, processes={processes}: a spawned worker failed: {err}") from None
    finally:
        _stop(ctx)
    return losses


def _spread(train, sketches, layers, mask, train_idx, group, processes: int, options: dict) -> list[list[float]]:
    """``train(sketches, layers, mask, train_idx, rank, world, **options)`` on every process's share of the
    layers, the trained values and loss curves then shared: over ``processes − 1`` spawned workers, over the
    ranks of ``group`` (its arguments checked alike on every rank first), or on this process alone."""
    import torch.distributed as dist

    if processes > 1:
        return _spawned(train, sketches, layers, mask, train_idx, processes, options)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    if world == 1:
        return train(sketches, layers, mask, train_idx, rank, world, **options)
    _same_call(sketches, layers, mask, train_idx, group, **options)
    return _share(sketches, train(sketches, layers, mask, train_idx, rank, world, **options), options["steps"], group)
