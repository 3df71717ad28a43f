import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    try:
        import torch_npu  # noqa: F401

        has_npu = True
    except ImportError:
        has_npu = False
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        # the marker, not the keyword: every test under tests/npu/ has the keyword "npu" (its folder), and those
        # run the NPU backend under the torch_npu CPU emulation
        if item.get_closest_marker("npu") is not None and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))
