"""The hybrid's recurrent state when calls with and without a key-padding mask alternate (issue 21,
mutation round 5): a first call with a mask over part of the sink tokens, then calls without one that
add more sinks, equal the whole sequence in one call with the masks joined (ones where none was given).

float64 tolerance 1e-10, as test_attention_state.py: the split and the whole call add the same terms in
another order (round-off ~1e-15 per term on O(1) outputs).
"""

import pytest
import torch

from sketchlab.attention import llops_attention

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
    whole = llops_attention(q, k, v, theta, theta, key_padding_mask=mask, **kw)
    outs, state = [], None
    bounds = [0, *cuts, T]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, state = llops_attention(q[:, a:b], k[:, a:b], v[:, a:b], theta, theta,
                                     key_padding_mask=first if i == 0 else None, initial_state=state,
                                     output_final_state=True, **kw)
        outs.append(out)
    assert state.offset == T and state.k_sink.shape[2] == sinks
    assert torch.equal(state.mask_sink, mask[:, :sinks])
    assert (torch.cat(outs, 1) - whole).abs().max() < TOL64
