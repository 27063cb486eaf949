"""Test setup: without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set before
Triton compiles anything). Tests pick `device` = cuda when present, else cpu."""
import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_speedups
    interpreter_speedups.install()

try:
    import tpsample.kernels  # noqa: F401  (kernels/ installs as tpsample.kernels)
except ImportError as e:
    import tpsample
    pytest.exit(f"tpsample is imported from {os.path.dirname(tpsample.__file__)} without its kernels "
                f"({e}). The checkout's kernels/ and launch/ only become tpsample.kernels and "
                "tpsample.launch when installed: run `pip install -e .` once, or, with a non-editable "
                "install, run `pytest` rather than `python -m pytest` from the repository root "
                "(which puts the source tree first on sys.path).", returncode=4)

# From the repository root (`python -m pytest`) the checkout's top-level kernels/ (installed as
# tpsample.kernels) shadows Hugging Face's `kernels` package, which transformers imports when it
# finds one; no test imports a top-level `kernels`, so that name is made absent while ours.
_spec = importlib.util.find_spec("kernels")
if _spec is not None and _spec.origin and os.path.dirname(os.path.dirname(
        os.path.abspath(_spec.origin))) == os.path.dirname(os.path.dirname(os.path.abspath(__file__))):
    sys.modules["kernels"] = None

HAS_CUDA = torch.cuda.is_available()
KERNEL_OK = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"


def _cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist, which may be absent)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest-xdist): one worker per CPU, at most 8. The interpreted kernels keep
    a worker on one core; more workers than 8 mostly start more gloo processes at once."""
    return max(1, min(_cpus(), 8))


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # a worker: its share of the CPUs for torch
    torch.set_num_threads(max(1, _cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (pytest -q -m gpu tests on a GPU machine)")
    skip_multi = pytest.mark.skip(reason="needs several CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
