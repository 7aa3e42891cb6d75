"""Suite-wide setup.

Without a CUDA device the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, fp32
only). The variable must be set before ``triton`` is first imported, so it is set here, before any
test module is collected. On a CUDA machine it is left alone and the kernels are compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
