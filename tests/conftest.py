import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Under pytest-xdist (the README's `-n 2`) each worker gets one core's worth of threads: two workers with two
# threads each on a 2-core machine would oversubscribe it.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

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
        # the Ray tests share one session-scoped local cluster (tests/launch/conftest.py): under xdist's loadgroup
        # scheduling they all run on one worker, so a run starts one cluster, not one per worker
        if os.path.basename(str(item.fspath)).startswith("test_ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        # markers, not keywords: a keyword also matches a folder named "cuda" / "npu" on the test's path
        if item.get_closest_marker("cuda") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if item.get_closest_marker("npu") and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))
