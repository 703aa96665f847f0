"""Shared test settings: deterministic, small, and no stray files in TMPDIR."""

import os

import pytest
import torch
from hypothesis import settings

from comera_rec.tensor import kernels

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    # an xdist worker (make test) gets its share of the cores: two workers' OpenMP pools on two
    # cores spin against each other (a short sequence run: 6x the wall, 9x the CPU). The thread
    # count tests set their own counts.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["kernel", "torch"])
def lookup_path(request):
    """Run a test once through the fused CPU kernels (TTM lookup, TT linear) and once
    through the PyTorch path.

    The kernel is expected to build wherever the suite runs (a C++ compiler is part of
    the set-up): a failed build fails the "kernel" runs instead of skipping them.
    """
    use_kernel = request.param == "kernel"
    if use_kernel:
        assert kernels.cpu_kernel_enabled(), "the fused CPU kernels did not build (see the log for the compiler error)"
    kernels.set_cpu_kernel_enabled(use_kernel)
    yield request.param
    kernels.set_cpu_kernel_enabled(True)


@pytest.fixture
def kernels_on():
    """The fused CPU kernels built and on (a failed build fails the test); switched back on
    afterwards, whatever the test switched."""
    assert kernels.cpu_kernel_enabled(), "the fused CPU kernels did not build (see the log for the compiler error)"
    yield
    kernels.set_cpu_kernel_enabled(True)
