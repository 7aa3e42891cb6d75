"""One conformance test for the attention op (issue 40): every mechanism × every path × the hybrid on and off.

Mechanisms (one ``AttentionOptions`` each): the additive state, a fixed / per-head / input decay, the delta rule
(β per head, β from the input), the gated delta rule (delta + input decay), the sparse exact cache (hybrid only:
it shares the window's normalisation), and the short convolution of q and k. Paths: ``naive`` (the float64 twin,
``backend="reference"``), ``chunk`` (``backend="torch"``: the chunked training / prefill path), ``recurrent``
(the same op one token at a time, carrying the state: the decoding step), and the fused Triton kernel in its
CPU interpreter where it takes the mechanism (the additive LLoPS map, plain and hybrid). For each: outputs
and final state equal across paths, a state split anywhere equals the whole, and a float64 gradcheck of every
parameter (q, k, v, the map, the gate, the far parameters).

Tolerances: float64 paths 1e-10 (the chunked sums and the token loop add the same terms in another order;
O(1) values, T = 9); the Triton interpreter runs float32: 2e-5 relative to the output's scale (sums of ~T·M
float32 products, as ``test_attention_triton.py`` explains); gradcheck at its float64 defaults.
"""

import pytest
import torch

from sketchlab.attention import AttentionOptions, FarParams, linear_attention
from sketchlab.featuremaps import HedgehogMap, LLoPSMap

B, T, H, D = 1, 9, 2, 3
TOL64 = 1e-10
MECHANISMS = {
    "additive": dict(),
    "decay_fixed": dict(decay=0.8),
    "decay_head": dict(decay="head"),
    "decay_input": dict(decay="input"),
    "delta": dict(state="delta"),
    "delta_beta_input": dict(state="delta", beta="input"),
    "gated_delta": dict(state="delta", decay="input"),
    "cache": dict(cache=2),
    "qk_conv": dict(qk_conv=3),
}
HYBRID = {"pure": dict(), "hybrid": dict(window=3, sinks=1)}
#: every (mechanism, layout) that exists: the cache needs the hybrid's window
CASES = [(m, h) for m in MECHANISMS for h in HYBRID if not (m == "cache" and h == "pure")]
MAPS = ("llops", "hedgehog")


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


class _Layer(torch.nn.Module):
    """The map, the gate and the far parameters of one layer, so gradcheck can see every parameter."""

    def __init__(self, fmap: str, options: AttentionOptions):
        super().__init__()
        self.map = (LLoPSMap(H, D, m=4, seed=1, dtype=torch.float64) if fmap == "llops"
                    else HedgehogMap(H, D, m=4, seed=1, dtype=torch.float64))
        self.options = options
        self.gate = torch.nn.Parameter(_rand(H, seed=2)) if options.window else None
        self.far = FarParams(options, H, D, gate=False, dim=D).double()
        with torch.no_grad():  # away from the initial values, so every tensor matters
            for i, (_, x) in enumerate(sorted(self.far.named_parameters())):
                x.add_(_rand(*x.shape, seed=10 + i, scale=0.3))
            for i, x in enumerate(self.map.parameters()):
                x.add_(_rand(*x.shape, seed=20 + i, scale=0.1))

    def forward(self, q, k, v, *, backend="torch", initial_state=None, output_final_state=False):
        return linear_attention(q, k, v, self.map, options=self.options.replace(backend=backend), params=self.far,
                                gate=self.gate, initial_state=initial_state, output_final_state=output_final_state)


def _case(fmap, mechanism, layout):
    options = AttentionOptions(chunk_size=4, normalize="sum", **MECHANISMS[mechanism], **HYBRID[layout])
    q, k, v = (_rand(B, T, H, D, seed=s, scale=0.7) for s in (30, 31, 32))
    return _Layer(fmap, options), q, k, v


def _state_tensors(state):
    """The state's far sum and its carried tails, the parts every mechanism has in common."""
    return [x for x in (state.S, getattr(state, "conv_q", None)) if x is not None]


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("mechanism, layout", CASES)
def test_paths_agree_split_and_decode(fmap, mechanism, layout):
    layer, q, k, v = _case(fmap, mechanism, layout)
    chunk, s_chunk = layer(q, k, v, output_final_state=True)
    naive, s_naive = layer(q, k, v, backend="reference", output_final_state=True)
    assert (chunk - naive).abs().max() < TOL64, "chunk vs naive"
    for a, b in zip(_state_tensors(s_chunk), _state_tensors(s_naive)):
        assert (a - b).abs().max() < TOL64, "final state: chunk vs naive"
    for cut in (1, 4, T - 1):  # a state split anywhere equals the whole
        first, state = layer(q[:, :cut], k[:, :cut], v[:, :cut], output_final_state=True)
        rest, s_end = layer(q[:, cut:], k[:, cut:], v[:, cut:], initial_state=state, output_final_state=True)
        assert (torch.cat([first, rest], 1) - chunk).abs().max() < TOL64, f"split at {cut}"
        for a, b in zip(_state_tensors(s_end), _state_tensors(s_chunk)):
            assert (a - b).abs().max() < TOL64, f"final state after a split at {cut}"
    steps, state = [], None  # the recurrent path: one token at a time, as decoding
    for t in range(T):
        o, state = layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], initial_state=state, output_final_state=True)
        steps.append(o)
    assert (torch.cat(steps, 1) - chunk).abs().max() < TOL64, "recurrent vs chunk"
    for a, b in zip(_state_tensors(state), _state_tensors(s_chunk)):
        assert (a - b).abs().max() < TOL64, "final state: recurrent vs chunk"


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("mechanism, layout", CASES)
def test_gradcheck_every_parameter(fmap, mechanism, layout):
    layer, q, k, v = _case(fmap, mechanism, layout)
    names = [n for n, p in layer.named_parameters() if p.requires_grad]
    params = tuple(p.detach().clone().requires_grad_() for n, p in layer.named_parameters() if p.requires_grad)
    leaves = tuple(x.clone().requires_grad_() for x in (q, k, v))

    def f(q, k, v, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (q, k, v))[0]

    assert names and torch.autograd.gradcheck(f, leaves + params)


TRITON_CASES = [("additive", "pure"), ("additive", "hybrid")]  # the mechanisms the fused kernel takes


@pytest.mark.parametrize("mechanism, layout", TRITON_CASES)
def test_triton_interpreter_agrees(mechanism, layout):
    layer, q, k, v = _case("llops", mechanism, layout)
    naive, s_naive = layer(q, k, v, backend="reference", output_final_state=True)
    layer = layer.float()
    fused, s_fused = layer(q.float(), k.float(), v.float(), backend="triton", output_final_state=True)
    scale = naive.abs().max()
    assert (fused.double() - naive).abs().max() < 2e-5 * scale
    assert (s_fused.S.double() - s_naive.S).abs().max() < 2e-5 * s_naive.S.abs().max()
