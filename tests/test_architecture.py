"""The rules of the house, checked on the source tree (docs/architecture.md is the map).

Every import statement of the installed rooms counts: module level, inside functions and under
`TYPE_CHECKING` alike, since each is a path along which one module needs another. The rooms and their
import names come from pyproject.toml's package-dir mapping, so a new room is checked without editing
this file.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Which room may import which: a room imports only rooms of a lower rank (and itself). The simulator is at the
# bottom and the command line at the top; masks and context parallelism use the kernels, the planner uses all
# of those, and model integrations may use everything but the command line.
RANKS = {
    "natsim": 0,
    "natsim.kernels": 1,
    "natsim.masks": 2,
    "natsim.distributed": 2,
    "natsim.planner": 3,
    "natsim.integrations": 4,
    "natsim.cli": 5,
}
# Modules that may call into a torch reference: each family's operators (their CPU path) and the dispatchers that
# pick the kernel or the reference for one call. Kernel modules never do.
REFERENCE_CALLERS = ("natsim.kernels.gna.ops", "natsim.kernels.sparse.ops", "natsim.kernels.gna.dispatch",
                     "natsim.kernels.sparse.dispatch", "natsim.kernels.gluon.ops")
# What the rooms above the kernels may import of them: the package face (natsim.kernels, its __init__) and the
# backends' seam (natsim.kernels.backends and its modules: capability tables, the Triton kernels' public face), so
# that a new backend plugs in without the rooms above importing its internals.
KERNEL_FACE = "natsim.kernels"
KERNEL_SEAM = "natsim.kernels.backends"


def _package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Every module of the distribution: dotted name -> file."""
    modules: dict[str, Path] = {}
    packages = _package_dirs()
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            name = ".".join([package, *parts])
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            owner = max((p for p in packages if name == p or name.startswith(p + ".")), key=len)
            if owner == package:  # a folder mapped on its own belongs to its own mapping
                modules[name] = path
    return modules


def test_every_package_folder_is_installed():
    """Every folder with an `__init__.py` under a mapped room is a package pyproject.toml lists: one it leaves out
    is missing from a wheel (an editable install finds it anyway, so nothing else here would fail)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in _package_dirs().items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join([package, *parts]))
    assert found - set(config["packages"]) == set()


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the distribution that `name` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _room(module: str) -> str:
    return max((room for room in RANKS if module == room or module.startswith(room + ".")), key=len)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def _kernel_internals(graph: dict[str, set[str]]) -> list[str]:
    """The imports of kernel modules past the kernels' face by modules of the rooms above."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if RANKS[_room(name)] > RANKS["natsim.kernels"]
        for target in targets
        if _room(target) == "natsim.kernels" and target != KERNEL_FACE and not _within(target, (KERNEL_SEAM,))
    )


def test_the_checker_finds_a_circle_and_resolves_relative_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    modules = {"natsim.kernels": Path("x/__init__.py"), "natsim.kernels.common": Path("x/common/__init__.py"),
               "natsim.kernels.common.operators": Path("x/common/operators.py"),
               "natsim.kernels.gna": Path("x/gna/__init__.py"), "natsim.kernels.gna.api": Path("x/gna/api.py")}
    source = "from ..common import operators\nfrom . import api\nfrom natsim.kernels import gna\n"
    path = ROOT / "build" / "architecture-probe.py"
    path.parent.mkdir(exist_ok=True)
    try:
        path.write_text(source)
        assert _imports("natsim.kernels.gna.probe", path, modules) == {
            "natsim.kernels.common.operators", "natsim.kernels.gna.api", "natsim.kernels.gna"}
    finally:
        path.unlink()


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_every_module_belongs_to_a_ranked_room():
    unranked = sorted({name for name in _modules() if not any(name == r or name.startswith(r + ".")
                                                               for r in RANKS)})
    assert unranked == []


def test_rooms_import_only_rooms_below_them():
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in _graph().items()
        for target in targets
        if RANKS[_room(target)] > RANKS[_room(name)]
    )
    assert upward == []


def test_the_face_rule_finds_kernel_internals():
    graph = {
        "natsim.planner.catalog": {"natsim.kernels", "natsim.kernels.backends.triton", "natsim.kernels.gna.tiles"},
        "natsim.masks.gna": {"natsim.kernels.backends", "natsim.kernels.sparse.mask"},
        "natsim.integrations.diffusers.masks": {"natsim.kernels.common.fp8"},
        "natsim.kernels.gna.ops": {"natsim.kernels.gna.dispatch"},
    }
    assert _kernel_internals(graph) == ["natsim.integrations.diffusers.masks -> natsim.kernels.common.fp8",
                                        "natsim.masks.gna -> natsim.kernels.sparse.mask",
                                        "natsim.planner.catalog -> natsim.kernels.gna.tiles"]


def test_rooms_above_the_kernels_see_them_through_their_face():
    assert _kernel_internals(_graph()) == []


def test_the_simulator_never_imports_torch_or_triton():
    offenders = []
    for name, path in _modules().items():
        if _room(name) != "natsim":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = []
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = [node.module.split(".")[0]]
            offenders += [f"{name} imports {root}" for root in roots if root in ("torch", "triton")]
    assert offenders == []


def test_only_the_operators_and_dispatchers_call_into_references():
    graph = _graph()
    callers = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if target.rpartition(".")[2] == "reference" and _room(name) == "natsim.kernels"
        and name not in REFERENCE_CALLERS and not name.endswith(".reference")
        and name != target.rpartition(".")[0]  # a family's front door re-exports its reference
        and name != "natsim.kernels"
    )
    assert callers == []


def test_import_natsim_loads_neither_torch_nor_numba():
    code = "import sys, natsim; print('torch' in sys.modules, 'numba' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["False", "False"]
