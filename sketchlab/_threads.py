"""Intra-op thread counts for the library's hot loops.

The fits, their reports and the optimum run long loops of small and medium tensor operations
(per-head matrices of a few hundred rows). With more intra-op threads than idle cores, PyTorch's
OpenMP threads wait on each other at every operation: on a loaded 2-core machine a fit of d = 32,
n = 16k took 226 s with two threads against 24 s with one (``analysis/results/threads.md``).
:func:`hot_loop_threads` runs a loop with no more threads than the cores that are idle (from the
1-minute load average) and one thread when the loop's work is too small to share out; it never
raises the count above what the caller set (``torch.set_num_threads``), so one thread stays one.
"""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["hot_loop_threads", "threads_for"]

#: Below this many multiply-adds per thread a loop's operations are too small to share out.
MIN_WORK_PER_THREAD = 5e8


def threads_for(work: float) -> int:
    """Intra-op threads for a loop of ``work`` multiply-adds in total.

    ``min(torch.get_num_threads(), idle cores, work / MIN_WORK_PER_THREAD)``, at least 1. Idle
    cores are ``os.cpu_count()`` minus the 1-minute load average, plus the one this process runs
    on; where the load average is unavailable (Windows) every core counts as idle.
    """
    allowed = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    idle = int((os.cpu_count() or 1) - load + 1)
    by_work = int(work // MIN_WORK_PER_THREAD)
    return max(1, min(allowed, idle, by_work))


@contextlib.contextmanager
def hot_loop_threads(work: float):
    """Run the body with :func:`threads_for` ``(work)`` intra-op threads, then restore the setting.

    ``torch.set_num_threads`` is process-wide: the body's other threads see the count too.
    """
    before = torch.get_num_threads()
    chosen = threads_for(work)
    if chosen != before:
        torch.set_num_threads(chosen)
    try:
        yield chosen
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
