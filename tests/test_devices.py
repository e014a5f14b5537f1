"""Launches run on their tensors' GPU (kernels/common/devices.py), checked without one: a tensor that says it lives
on `cuda:1` while `cuda:0` is current, and a recording stand-in for `torch.cuda.device`; and, on the source
tree, that every Triton launch of natsim.kernels runs in such a guard. tests/test_devices_gpu.py runs the entry
points on a second GPU."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch

from natsim.kernels.common import devices
from natsim.kernels.common.devices import current_device_of, on_their_device

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


class OnGpu(torch.Tensor):
    """A CPU tensor that reports itself on `cuda:1`."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 1)

    def get_device(self):
        return 1


@pytest.fixture
def switches(monkeypatch):
    """The devices made current, in order; `cuda:0` current throughout."""
    made_current = []

    @contextlib.contextmanager
    def device(which):
        made_current.append(torch.device(which))
        yield

    monkeypatch.setattr(devices.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(devices.torch.cuda, "device", device)
    return made_current


def test_a_launcher_makes_its_first_cuda_tensors_device_current(switches):
    seen = []

    @on_their_device
    def launcher(x, y, *, scale):
        seen.append((x, y, scale))
        return "launched"

    on_gpu = torch.Tensor._make_subclass(OnGpu, torch.empty(2))
    cpu = torch.empty(2)
    assert launcher(cpu, on_gpu, scale=0.5) == "launched"
    assert switches == [torch.device("cuda", 1)] and seen[-1][2] == 0.5
    assert launcher(cpu, cpu, scale=1.0) == "launched"  # no CUDA tensor: nothing to switch
    assert launcher(cpu, y=cpu, scale=on_gpu) == "launched"  # keyword tensors count too
    assert switches == [torch.device("cuda", 1)] * 2
    assert launcher.__name__ == "launcher" and len(seen) == 3


def test_the_current_device_and_cpu_tensors_need_no_switch(switches, monkeypatch):
    on_gpu = torch.Tensor._make_subclass(OnGpu, torch.empty(2))
    with current_device_of(torch.empty(2)):
        pass
    monkeypatch.setattr(devices.torch.cuda, "current_device", lambda: 1)
    with current_device_of(on_gpu):
        pass
    assert switches == []


def _launches(tree: ast.AST):
    """Each Triton launch `name_kernel[grid](...)` with the function around it and the `with` statements over it."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        launched = node.func.value
        name = launched.id if isinstance(launched, ast.Name) else getattr(launched, "attr", "")
        if not name.endswith("kernel"):
            continue  # a registry lookup (resolvers[key](...)), not a launch
        function, guards, at = None, [], node
        while at in parents and function is None:
            at = parents[at]
            if isinstance(at, ast.With):
                guards += [ast.unparse(item.context_expr) for item in at.items]
            if isinstance(at, ast.FunctionDef):
                function = at
        yield name, function, guards


def test_every_triton_launch_runs_on_its_tensors_device():
    """A launcher is decorated with `on_their_device`, or launches inside `current_device_of(...)`: a new kernel's
    launch that forgets it fails here, not on a user's second GPU."""
    found, unguarded = 0, []
    for path in sorted(KERNELS.rglob("*.py")):
        for name, function, guards in _launches(ast.parse(path.read_text())):
            found += 1
            decorated = function is not None and any(ast.unparse(d) == "on_their_device"
                                                     for d in function.decorator_list)
            if not (decorated or any(g.startswith("current_device_of(") for g in guards)):
                unguarded.append(f"{path.relative_to(KERNELS.parent)}: {name} in {getattr(function, 'name', None)}")
    assert found >= 13, found  # the scan sees the launches (a rename of the pattern would hide them)
    assert not unguarded, unguarded
    # GNA's forward kernels launch through PreboundKernel (`self.fn[grid](...)`, `kernel.run(...)`), whose call
    # switches to its tensors' device before `_launch`
    prebound = ast.parse((KERNELS / "gna" / "prebound.py").read_text())
    call = next(node for node in ast.walk(prebound) if isinstance(node, ast.FunctionDef) and node.name == "__call__")
    assert any(isinstance(node, ast.With) and "torch.cuda.device(" in ast.unparse(node.items[0].context_expr)
               and "self._launch(" in ast.unparse(node) for node in ast.walk(call))
