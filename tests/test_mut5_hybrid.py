"""The hybrid's recurrent state when calls with and without a key-padding mask alternate (issue 21,
mutation round 5): a first call with a mask over part of the sink tokens, then calls without one that
add more sinks, equal the whole sequence in one call with the masks joined (ones where none was given).

float64 tolerance 1e-10, as test_attention_state.py: the split and the whole call add the same terms in
another order (round-off ~1e-15 per term on O(1) outputs).
"""

import pytest
import torch
from attention_calls import run_llops

TOL64 = 1e-10


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("cuts", [[2, 3, 9], [2, 9], [1, 4]])
@pytest.mark.parametrize("local", ["softmax", "poly"])
def test_a_masked_call_then_unmasked_calls_inside_the_sinks_equal_the_whole(backend, cuts, local):
    T, sinks = 13, 5
    q, k, v = _rand(2, T, 2, 4, seed=1), _rand(2, T, 2, 4, seed=2), _rand(2, T, 2, 3, seed=3)
    theta = (_rand(2, 1, 1, 4, 5, seed=4) / 2).expand(2, 1, 2, 4, 5).clone()
    first = torch.tensor([[True, False], [False, True]])[:, : cuts[0]]  # padding among the first sinks
    mask = torch.cat([first, torch.ones(2, T - cuts[0], dtype=torch.bool)], 1)
    kw = dict(window=3, sinks=sinks, local=local, backend=backend, chunk_size=4)
    whole = run_llops(q, k, v, theta, theta, key_padding_mask=mask, **kw)
    outs, state = [], None
    bounds = [0, *cuts, T]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, state = run_llops(q[:, a:b], k[:, a:b], v[:, a:b], theta, theta,
                                     key_padding_mask=first if i == 0 else None, initial_state=state,
                                     output_final_state=True, **kw)
        outs.append(out)
    assert state.offset == T and state.k_sink.shape[2] == sinks
    assert torch.equal(state.mask_sink, mask[:, :sinks])
    assert (torch.cat(outs, 1) - whole).abs().max() < TOL64


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_denominator_check_raise_warn_and_off(window, causal):
    """Signed features with normalize='sum' give some rows a denominator <= 0: 'raise' stops with a
    FloatingPointError naming the count, 'warn' warns with it, 'off' says nothing (the chunked torch path)."""
    import warnings

    from attention_calls import run_chunked

    T = 12
    q, k, v = _rand(2, T, 2, 4, seed=21), _rand(2, T, 2, 4, seed=22), _rand(2, T, 2, 3, seed=23)
    fq, fk = _rand(2, T, 2, 6, seed=24), _rand(2, T, 2, 6, seed=25)  # signed: φ(q)·Σφ(k) < 0 on some rows
    gate = torch.full((2,), -30.0, dtype=torch.float64)  # the far (linear) part alone in the hybrid
    kw = dict(q=q, k=k, degree=2, causal=causal, normalize="sum", chunk_size=4)
    if window:
        kw.update(window=window, sinks=0, gate=gate)
    with pytest.raises(FloatingPointError, match=r"\d+ of \d+ query rows have a normalising denominator <= 0"):
        run_chunked(fq, fk, v, denominator_check="raise", **kw)
    with pytest.warns(RuntimeWarning, match=r"\d+ of \d+ query rows have a normalising denominator <= 0"):
        run_chunked(fq, fk, v, denominator_check="warn", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_chunked(fq, fk, v, denominator_check="off", **kw)


def test_a_state_whose_masks_are_not_bool_tensors_is_refused_naming_them():
    """initial_state.mask_window / mask_sink: None or a bool tensor [B, held]; anything else is refused with
    what it got (a list's value, a tensor's shape), and a window key of another width by its shape."""
    import dataclasses
    import re

    q, k, v = _rand(2, 6, 2, 4, seed=31), _rand(2, 6, 2, 4, seed=32), _rand(2, 6, 2, 3, seed=33)
    theta = (_rand(2, 1, 1, 4, 5, seed=34) / 2).expand(2, 1, 2, 4, 5).clone()
    kw = dict(window=3, sinks=1, backend="torch")
    mask = torch.tensor([[True] * 6, [False] + [True] * 5])
    _, state = run_llops(q, k, v, theta, theta, key_padding_mask=mask, output_final_state=True, **kw)
    again = dict(initial_state=None, **kw)
    for name, bad, shown in (("mask_window", [[True] * 3] * 2, repr([[True] * 3] * 2)),
                             ("mask_sink", torch.ones(2, 2, dtype=torch.bool), "(2, 2)"),
                             ("mask_window", torch.ones(2, 3), "(2, 3)")):
        again["initial_state"] = dataclasses.replace(state, **{name: bad})
        held = 3 if name == "mask_window" else 1
        with pytest.raises(ValueError, match=re.escape(f"initial_state.{name} must be None or a bool tensor [2, {held}], "
                                                       f"got {shown}")):
            run_llops(q[:, :1], k[:, :1], v[:, :1], theta, theta, **again)
    again["initial_state"] = dataclasses.replace(state, k_window=state.k_window[..., :3])
    with pytest.raises(ValueError, match=re.escape("initial_state.k_window must have shape [2, 2, 3, 4]")):
        run_llops(q[:, :1], k[:, :1], v[:, :1], theta, theta, **again)
