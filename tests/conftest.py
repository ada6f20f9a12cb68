"""Shared test set-up.

Triton kernels run under the interpreter on machines without CUDA; the variable must be set
before any kernel module is imported, hence here at the top of the root conftest.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))
