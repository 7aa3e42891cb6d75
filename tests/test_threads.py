"""The thread count of the hot loops: never above the caller's setting, the idle cores or what the
work can share out; restored afterwards."""

import pytest
import torch

import sketchlab._threads as threads


@pytest.fixture
def machine(monkeypatch):
    def set_(cores, load, allowed):
        monkeypatch.setattr(threads.os, "cpu_count", lambda: cores)
        monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(threads.torch, "get_num_threads", lambda: allowed)
    return set_


@pytest.mark.parametrize("cores,load,allowed,work,want", [
    (2, 0.0, 2, 1e12, 2),     # idle machine, big work: the caller's two threads
    (2, 6.0, 2, 1e12, 1),     # six busy processes on two cores: one thread
    (2, 1.0, 2, 1e12, 2),     # one busy core is this process itself: two
    (16, 0.0, 16, 3e9, 6),    # work for 6 threads of MIN_WORK_PER_THREAD each
    (16, 0.0, 16, 1e6, 1),    # small work: one thread
    (16, 0.0, 1, 1e12, 1),    # the caller asked for one thread: never more
])
def test_threads_for(machine, cores, load, allowed, work, want):
    machine(cores, load, allowed)
    assert threads.threads_for(work) == want


def test_hot_loop_threads_sets_and_restores():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with threads.hot_loop_threads(0) as chosen:
            assert chosen == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            with threads.hot_loop_threads(0):
                raise RuntimeError("body fails")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
