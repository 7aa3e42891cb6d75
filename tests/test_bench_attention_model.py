"""The tile FLOP model of analysis/bench_attention.py (hybrid against pure LLoPS, per query chunk).

Exact integer counts written out by hand at the benchmark's shapes (C = 64, D = Dv = M = 128, p = 2,
t = 1, 16 chunks per block), so a changed term in the model fails here.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "analysis" / "bench_attention.py"
_spec = importlib.util.spec_from_file_location("bench_attention", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_attention"] = bench
_spec.loader.exec_module(bench)

SHAPE = dict(C=64, D=128, Dv=128, M=128, p=2)
FEAT = 2 * 64 * 128 * 2 * 128  # x @ Θ_flat for q and k
STATE = 64 * 128 * 128  # one C·M·Dv GEMM
PREFIX = 128 * 128  # M·Dv per key chunk of the prefix matrix


def test_pure_chunk_counts():
    m = bench.tile_macs(4096, **SHAPE)
    assert m["fwd"] == FEAT + STATE + 16 * PREFIX + STATE + 64 * 64 * (128 + 128)
    assert m["bwd"] == 2 * FEAT + (STATE + 16 * PREFIX) + 2 * STATE + 16 * PREFIX + 2 * STATE + 64 * 64 * 4 * 128
    assert m["exp"] == 0


def test_hybrid_w64_counts_and_ratio():
    """w = C = 64 with 4 sinks: two local key chunks (lag 0 and 1), lag 1 partly far, one held window chunk."""
    h = bench.tile_macs(4096, **SHAPE, window=64, sinks=4)
    assert (h["n_loc"], h["n_far"], h["chunks_per_block"]) == (2, 1, 16)
    band = 2 * 64 + 4
    upd = STATE * 17 / 16
    assert h["fwd"] == FEAT + upd + 17 * PREFIX + STATE + 64 * band * 128 + 64 * 64 * 128 + 64 * band * 128
    assert h["bwd"] == (2 * FEAT + (upd + 17 * PREFIX) + 2 * STATE + 17 * PREFIX + 2 * upd
                        + 2 * 64 * band * 128 + 2 * 64 * 64 * 128 + 2 * 64 * band * 128)
    assert h["exp"] == 64 * band
    pure = bench.tile_macs(4096, **SHAPE)
    assert abs(h["fwd"] / pure["fwd"] - 9322496 / 7602176) < 1e-12  # 1.226


def test_window_geometry():
    """w = 1: only lag 0, partly far; w = 66 > C + 1: three local key chunks, lags 1 and 2 partly far; a short
    sequence has fewer chunks per block."""
    one = bench.tile_macs(4096, **SHAPE, window=1)
    assert (one["n_loc"], one["n_far"]) == (1, 1)
    wide = bench.tile_macs(4096, **SHAPE, window=66)
    assert (wide["n_loc"], wide["n_far"]) == (3, 2)
    assert bench.tile_macs(256, **SHAPE)["chunks_per_block"] == 4


def test_sub_block_local_tiling():
    """local_block = 32 at w = 64: per sub-block of 32 queries one band of three key sub-blocks (lags 0, 1 local,
    lag 2 split: its lower triangle far) and the sinks, one 32 × 32 far tile; the state stays per chunk of 64."""
    h = bench.tile_macs(4096, **SHAPE, window=64, sinks=4, local_block=32)
    assert (h["n_loc"], h["n_far"], h["chunks_per_block"]) == (3, 1, 16)
    band = 3 * 32 + 4
    upd = STATE * 17 / 16
    assert h["fwd"] == FEAT + upd + 17 * PREFIX + STATE + 64 * band * 128 + 64 * 32 * 128 + 64 * band * 128
    assert h["bwd"] == (2 * FEAT + (upd + 17 * PREFIX) + 2 * STATE + 17 * PREFIX + 2 * upd
                        + 2 * 64 * band * 128 + 2 * 64 * 32 * 128 + 2 * 64 * band * 128)
    assert h["exp"] == 64 * band
    assert bench.tile_macs(4096, **SHAPE, window=64, sinks=4, local_block=64) == bench.tile_macs(
        4096, **SHAPE, window=64, sinks=4)
    for bad in (0, 48, 128):
        with pytest.raises(ValueError, match="local_block"):
            bench.tile_macs(4096, **SHAPE, window=64, local_block=bad)
