"""analysis/bench_hybrid_tiles.py: its multiply-add counts agree with the tile model's local terms, its band is the
right keys, and its command line (a smoke run at tiny shapes; bad input exits 2)."""

import importlib.util
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1] / "analysis"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _ROOT / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


tiles = _load("bench_hybrid_tiles")
bench = _load("bench_attention")


def _local_macs(T, *, C, D, window, b, backward):
    """The tile model's local terms per query chunk (its ``local_fwd`` / ``local_bwd``), D = Dv = M, no sinks."""
    h = bench.tile_macs(T, C=C, D=D, Dv=D, M=D, p=2, window=window, local_block=b)
    return (4 if backward else 2) * C * h["n_loc"] * b * D + (2 if backward else 1) * h["n_far"] * C * b * D


def test_macs_match_the_tile_model():
    gen = torch.Generator().manual_seed(0)
    N, BH, C, D, w = 4, 2, 16, 8, 16
    old = tiles.today_pieces(N, BH, C, D, w, gen)
    new = tiles.sub_block_pieces(N, BH, C, D, w, 8, gen, overlap=False)
    assert (old["n_loc"], old["n_far"], new["n_loc"], new["n_far"]) == (2, 1, 3, 1)
    for pieces, b in ((old, C), (new, 8)):
        for backward in (False, True):
            per_chunk = _local_macs(N * C, C=C, D=D, window=w, b=b, backward=backward)
            assert pieces["macs_bwd" if backward else "macs_fwd"] == N * BH * per_chunk
    # the model's hybrid count minus its pure count differs by the local part alone between the two tilings
    f_old = bench.tile_macs(4096, C=64, D=128, Dv=128, M=128, p=2, window=64)["fwd"]
    f_new = bench.tile_macs(4096, C=64, D=128, Dv=128, M=128, p=2, window=64, local_block=32)["fwd"]
    assert f_old - f_new == (64 * 128 * 128 * 2 + 64 * 64 * 128) - (64 * 96 * 128 * 2 + 64 * 32 * 128)


def test_band_holds_the_window_keys_oldest_first():
    """Query sub-block s's band is key sub-blocks s − 2, s − 1, s (indices s, s + 1, s + 2 of ``k``, whose first
    two sub-blocks precede the queries), oldest first; the lags: w = 64, b = 32 → lags 0, 1 local, 2 split."""
    gen = torch.Generator().manual_seed(1)
    p = tiles.sub_block_pieces(3, 2, 8, 4, 8, 4, gen, overlap=False)  # 6 sub-blocks of 4, w = 8: n_loc = 3
    k, band = p["k"], p["band_k"]
    assert band.shape == (6, 2, 12, 4)
    for s in range(6):
        assert torch.equal(band[s], torch.cat([k[s], k[s + 1], k[s + 2]], 1))
    assert tiles._band_lags(64, 32) == (3, [2])
    assert tiles._band_lags(64, 64) == (2, [1])
    assert tiles._band_lags(1, 64) == (1, [0])


def test_command_line(tmp_path, capsys):
    out = tmp_path / "tiles.md"
    rc = tiles.main(["--chunks", "2", "--heads", "1", "--dim", "16", "--rounds", "1", "--overlap", "--out",
                     str(out)])
    assert rc == 0
    text = out.read_text()
    assert "| local logits |" in text and "| band copy of k, v |" in text and "overlapping view" in text
    assert "sub-blocks of b = 32: a band of 3·32 keys, 1 far tile(s) of 32 × 32" in text
    assert tiles.main(["--sub-block", "48"]) == 2
    assert "--sub-block must divide" in capsys.readouterr().err
    for flag in ("--rounds", "--chunks", "--dim", "--heads", "--chunk-size"):
        assert tiles.main([flag, "0"]) == 2
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
