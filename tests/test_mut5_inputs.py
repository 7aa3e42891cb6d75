"""Inputs read from files or numpy (issue 21, mutation round 4): a corrupt metadata file is reported as not
JSON (not as too deeply nested), numpy float arrays are accepted as they are, and a memory refusal
says what it would have allocated."""

import re

import numpy as np
import pytest
import torch

from sketchlab import load_qk, save_qk
from sketchlab._validation import as_float_tensor


def test_a_corrupt_meta_file_is_reported_as_not_json_whatever_its_letters(tmp_path):
    """Only brackets outside strings count toward the JSON depth limit: 70 stray letters in a meta file are
    a syntax error ('not JSON'), not 70 levels of nesting."""
    g = torch.Generator().manual_seed(0)
    save_qk(tmp_path / "x.npy", torch.randn(1, 1, 4, 2, generator=g), torch.randn(1, 1, 4, 2, generator=g))
    (tmp_path / "x.meta.json").write_text('{"a": ' + "X" * 70 + "}")
    with pytest.raises(ValueError, match=re.escape("x.meta.json: corrupt metadata file, not JSON")):
        load_qk(tmp_path / "x.npy")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_float_arrays_are_taken_without_a_copy(dtype):
    x = np.arange(6, dtype=dtype).reshape(2, 3)
    t = as_float_tensor(x, "x")
    assert t.dtype == torch.from_numpy(x).dtype and t.shape == (2, 3)
    x[0, 0] = 7  # the same memory (documented: converted without copying)
    assert float(t[0, 0]) == 7.0


def test_numpy_integer_arrays_are_refused_naming_the_dtype():
    with pytest.raises(TypeError, match="x must have a real floating-point dtype .*got numpy int64"):
        as_float_tensor(np.arange(3, dtype=np.int64), "x")


def test_spectrum_memory_refusal_describes_the_feature_matrix():
    """Over the budget on the feature route (n > D), the refusal names ψ_p's size: 2 heads, 20 tokens × D = 3
    features (d = 2, p = 2, symmetric basis) in float64."""
    from sketchlab.spectrum import kernel_singular_values

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 20, 2, generator=g), torch.randn(2, 20, 2, generator=g)
    with pytest.raises(ValueError, match=re.escape("psi_p of 2 head(s), 20 x 3 float64 would take")):
        kernel_singular_values(q, k, 2, max_bytes=100)
    direct = torch.linalg.svdvals((q.double() @ k.double().mT) ** 2)  # [2, 20]: σ of (q kᵀ)^∘2 per head
    torch.testing.assert_close(kernel_singular_values(q, k, 2).double(), direct, rtol=1e-9, atol=1e-9)
