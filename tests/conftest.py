"""Test setup: without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set before
Triton compiles anything). Tests pick `device` = cuda when present, else cpu."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import tpsample.kernels  # noqa: F401  (kernels/ installs as tpsample.kernels)
except ImportError as e:
    import tpsample
    pytest.exit(f"tpsample is imported from {os.path.dirname(tpsample.__file__)} without its kernels "
                f"({e}). The checkout's kernels/ and launch/ only become tpsample.kernels and "
                "tpsample.launch when installed: run `pip install -e .` once, or, with a non-editable "
                "install, run `pytest` rather than `python -m pytest` from the repository root "
                "(which puts the source tree first on sys.path).", returncode=4)

HAS_CUDA = torch.cuda.is_available()
KERNEL_OK = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the device machine)")
    skip_multi = pytest.mark.skip(reason="needs several CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
