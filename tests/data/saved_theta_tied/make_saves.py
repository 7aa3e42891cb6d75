"""Written once with the code of acaf206 (issue 40's start): the Θ export of a tied fit as that code wrote it (both
``theta_q`` and ``theta_k``, equal, no ``tied`` key), and the block's output on it, which today's load must give
(tests/test_export.py). Run with that commit checked out elsewhere:

    git worktree add /tmp/old acaf206
    python tests/data/saved_theta_tied/make_saves.py /tmp/old tests/data/saved_theta_tied data/mqar_softmax_qk.safetensors

It writes only what is missing: a committed file stays as written.
"""
import json
import sys
from pathlib import Path

import torch

old, out, dump_file = sys.argv[1:4]
sys.path.insert(0, old)
import sketchlab as sl  # noqa: E402  (the old checkout's, put first above)
from sketchlab.io.atomic import write_text_atomic  # noqa: E402

assert sl.__file__.startswith(old), sl.__file__

out = Path(out)
if not (out / "theta.safetensors").exists():
    # PolySketch (psf-random) is one map for both sides; its exact LLoPS form is what the export writes
    dump = sl.load_qk(dump_file, layers=[0], heads=[0, 1])
    f = dump.q.shape[-1] ** -0.25
    fit = sl.fit_sketch("psf-random", dump.q[..., :64, :] * f, dump.k[..., :64, :] * f, p=2, m=4, seed=0)
    sl.export_theta(fit, out / "theta.safetensors", dump=dump, scale="sqrt-d")
    block = sl.LLoPSAttention.from_pretrained(out / "theta.safetensors", layer=0, dtype=torch.float64, window=4,
                                              sinks=1)
    x = torch.randn(1, 10, block.embed_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        write_text_atomic(out / "theta_expected.json", json.dumps(
            {"x": x.tolist(), "y": block(x).tolist(), "written_by": "acaf206", "block": {"window": 4, "sinks": 1}}))
