"""What the Triton kernels were launched with: a spy in place of each kernel that records its `USE_TMA` and
`LAYOUT` switches and launches the kernel, so that a test of a path can check that path really ran
(tests/test_portable_paths.py on the CPU, tests/test_portable_paths_gpu.py on a GPU).

The launchers reach their kernels through module globals (the GNA forward's through `launch.KERNELS`, which
`PreboundKernel` reads once per distinct call), so a fresh call cache is needed for a GNA forward call to be
seen: `spy_on_kernels` empties the GNA call caches.
"""

from __future__ import annotations

from typing import Iterator, Optional

import pytest
import torch

from natsim.kernels.gna import api as gna_api
from natsim.kernels.gna import backward as gna_backward
from natsim.kernels.gna import dispatch as gna_dispatch
from natsim.kernels.gna import launch as gna_launch
from natsim.kernels.sparse import backward as sparse_backward
from natsim.kernels.sparse import forward as sparse_forward
from natsim.kernels import set_tensor_descriptors, tensor_descriptors_enabled


class LaunchSpy:
    """Stands for one Triton kernel: `spy[grid](...)` records the launch's switches in `launches` and launches
    the kernel; every other attribute is the kernel's (PreboundKernel reads `fn` and `arg_names`)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[dict[str, Optional[object]]] = []

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append({name: kwargs.get(name) for name in ("USE_TMA", "LAYOUT", "FP8")})
            return launch(*args, **kwargs)

        return run


class Spies(dict):
    """The spies by kernel name: "gna_static", "gna_dynamic", "gna_dkdv", "gna_dq", "sparse_forward",
    "sparse_backward"."""

    def launches(self, *names: str) -> list[dict[str, Optional[object]]]:
        """The launches of the named kernels (every one without names), in order per kernel."""
        return [launch for name in (names or tuple(self)) for launch in self[name].launches]

    def clear(self) -> None:
        for spy in self.values():
            spy.launches.clear()


def spy_on_kernels(monkeypatch: pytest.MonkeyPatch) -> Spies:
    """Replace every descriptor-capable kernel by a `LaunchSpy` for the test (and empty the GNA call caches, the
    dispatcher's and `gna_attention_permuted`'s, so that calls are prepared, and their kernels launched through
    the spies, afresh)."""
    spies = Spies()
    for kv_tiling in ("static", "dynamic"):
        spies[f"gna_{kv_tiling}"] = LaunchSpy(gna_launch.KERNELS[kv_tiling])
        monkeypatch.setitem(gna_launch.KERNELS, kv_tiling, spies[f"gna_{kv_tiling}"])
    for name, module, attribute in (("gna_dkdv", gna_backward, "dkdv_kernel"), ("gna_dq", gna_backward, "dq_kernel"),
                                    ("sparse_forward", sparse_forward, "sparse_forward_kernel"),
                                    ("sparse_backward", sparse_backward, "sparse_backward_kernel")):
        spies[name] = LaunchSpy(getattr(module, attribute))
        monkeypatch.setattr(module, attribute, spies[name])
    monkeypatch.setattr(gna_dispatch, "_calls", {})
    gna_api._permuted_call.cache_clear()
    return spies


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def spies(monkeypatch):
    """The kernels' launch spies, fresh call caches."""
    return spy_on_kernels(monkeypatch)


@pytest.fixture
def no_descriptors() -> Iterator[None]:
    """Tensor descriptors off for the test, as they are on a GPU without them; the setting back after."""
    before = tensor_descriptors_enabled()
    set_tensor_descriptors(False)
    yield
    set_tensor_descriptors(before)
