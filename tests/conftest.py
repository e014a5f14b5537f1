"""Run Triton kernels in the CPU interpreter on machines without an NVIDIA GPU, and keep the user's
coefficient folder out of the tests.

`@triton.jit` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test module
imports natsim.kernels. With a GPU the kernel tests run on CUDA tensors instead.
"""

import gc
import importlib
import logging
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# Property tests that do not set their own count draw 15 examples (hypothesis' default is 100; those that set one
# are sized alike): a fresh clone keeps no example database, so every CI run draws new ones (the suite's coverage
# grows run by run), and the brute-force references behind these tests are the suite's bulk on a 2-core machine.
# Hypothesis' too_slow health check fails a test whose input generation took over a second, which a loaded 2-core
# machine gave one draw of a cheap strategy (tests/test_distributed.py, 9 inputs in 1.2 s): a check of the machine's
# load, not of the test, so it is off.
settings.register_profile("natsim", max_examples=15, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("natsim")

# Python's cyclic garbage collector runs after every 700 allocations more than deallocations, and every so often
# over every object alive: torch, Dynamo, sympy and the test modules leave half a million of them and more (a full
# collection took 0.4 s), and the collections took about a tenth of a worker's time. Collecting after 50,000, and
# half as often in the older generations, took half as long. No test relies on a collection to free something
# (none calls gc itself).
gc.set_threshold(50_000, 20)

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["TRITON_INTERPRET"] = "1"

# pytest-xdist's workers (scripts/test.sh starts one per core) each started torch's and numpy's thread pools
# at the machine's full size: more threads than cores, whose parallel regions waited for one another while the
# other workers held the cores (on 2 cores the suite took 15% longer, with 12% more CPU time). A share of the
# cores each instead, set before anything imports torch or numpy and inherited by the processes tests spawn.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

# Before Inductor's first CPU code on a fresh inductor cache, it builds and loads a probe library for each vector
# instruction set the CPU reports, to see that the compiler can target it (6 s here, in the first test that
# compiles with Inductor). Without a GPU the CPU's report is taken as it is: the probes pass on the machines this
# suite runs on, so Inductor picks the same instruction set and generates the same code. A value already in the
# environment is kept.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_options import prepare_the_interpreter

    prepare_the_interpreter()

# A fresh clone's venv holds no bytecode (scripts/setup.sh compiles none), and every pytest-xdist worker imports
# the same modules while collecting: both compiled torch, sympy, numba and the rest at the same time, each for
# itself. Each worker first imports its share instead (the first torch and Dynamo, which the test modules import
# through natsim; the second what those do not import before they get to sympy), so that each module is compiled
# once and the other worker finds its bytecode when it gets there: collection took 19-25 s per worker on 2 cores
# from a fresh clone, 12-16 s so.
_SHARES = (("torch", "torch._dynamo"),
           ("sympy", "numba", "hypothesis", "rich", "typer", "huggingface_hub", "pygments", "requests", "yaml"))
if _WORKERS > 1:
    for _module in _SHARES[int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % len(_SHARES)]:
        try:
            importlib.import_module(_module)
        except ImportError:
            pass


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


# Tests that start other processes or torch.compile's Inductor (names as they are today).
_FRONT = ("compile", "test_gloo_world")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh), move the tests that spawn process groups or compile with Inductor
    to the front, keeping every other test's order. `--dist worksteal` gives each worker a contiguous half of
    the list and lets an idle worker take tests from the back of a busy one's queue: these long tests then
    start first on one worker, instead of one of them finishing alone at the end, and on a fresh machine
    Inductor's one-time work (probing the CPU's vector instructions, building its precompiled header: about
    8 s) runs once instead of in both workers at the same time."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not any(name in item.name for name in _FRONT))


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
    """Keep pytest's log capture off torch's structured trace while a test runs.

    pytest attaches its capture handlers to every logger that does not propagate, and torch's structured trace
    (the `torch.__trace` logger, written to files under TORCH_TRACE) is one of them: torch writes a trace record
    wherever that logger has a handler, so under pytest every Dynamo, AOTAutograd and Inductor compile serialised
    its graphs, guards and timing events into the captured logs (about 10 s of CPU time over the suite). Outside
    pytest a compile writes none without TORCH_TRACE; here neither, and torch's own handler stays where it is."""
    trace = logging.getLogger("torch.__trace")
    for handler in [h for h in trace.handlers if type(h).__module__ == "_pytest.logging"]:
        trace.removeHandler(handler)
    return (yield)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End a pytest-xdist worker as soon as pytest is done in it, without the interpreter's shutdown.

    By then the worker has reported every result to the main process, which waits for it to exit before it
    prints its summary: the shutdown's garbage collections over everything torch, Dynamo, sympy and the tests
    left in memory took 5 to 8 s on 2 cores, and what pytest still does after this hook (a last garbage
    collection to catch unraisable exceptions) reports nowhere in a worker. The main process and a run without
    workers end as usual."""
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
