import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(min(2, torch.get_num_threads()))

# Without a GPU, the CUDA backend's Triton kernels run on CPU tensors through Triton's interpreter (small-shape
# tests in tests/ops/test_triton_kernels.py). It must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    try:
        import torch_npu  # noqa: F401

        has_npu = True
    except ImportError:
        has_npu = False
    for item in items:
        # markers, not keywords: a keyword also matches a folder named "cuda" / "npu" on the test's path
        if item.get_closest_marker("cuda") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if item.get_closest_marker("npu") and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))
