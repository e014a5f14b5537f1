"""Run Triton kernels in the CPU interpreter on machines without an NVIDIA GPU, and keep the user's
coefficient folder out of the tests.

`@triton.jit` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test module
imports natsim.kernels. With a GPU the kernel tests run on CUDA tensors instead.
"""

import os

import pytest

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _private_coefficient_folder(tmp_path_factory, monkeypatch):
    """Point the user's coefficient folder ($NATSIM_DATA_DIR/coefficients) at an empty temporary one, so that
    coefficients calibrated on the machine running the tests neither change what the planner picks nor get
    written over."""
    monkeypatch.setenv("NATSIM_DATA_DIR", str(tmp_path_factory.mktemp("natsim-data")))


@pytest.fixture
def reference_path(monkeypatch):
    """CPU tensors take the torch reference (no interpreter) for the duration of a test, without the one-time
    CPU warnings (`use_triton` reads TRITON_INTERPRET per call)."""
    from natsim.kernels.gna import dispatch as gna_dispatch
    from natsim.kernels.sparse import dispatch as sparse_dispatch

    if os.path.exists("/dev/nvidia0"):
        pytest.skip("the reference path is the CPU path")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(gna_dispatch, "_warned_cpu", True)
    monkeypatch.setattr(sparse_dispatch, "_warned_cpu", True)
