"""Compile, over all cores, the bytecode of the installed modules the test suite imports.

scripts/setup.sh installs without bytecode (compiling all of torch's, sympy's and diffusers' modules would take
longer than the suite needs). Compiled on first import instead, the same modules were compiled by both
pytest-xdist workers at once, each for itself: a fresh clone's suite ran about 45 s longer than one whose
bytecode was there. This compiles what scripts/bytecode-manifest.txt lists (paths under site-packages, made by
running the suite with NATSIM_IMPORT_MANIFEST set: tests/conftest.py) once, split over the cores. A listed file
that is not installed is skipped; a module the list misses is compiled on first import, as before; bytecode
already up to date is left as it is.

    python scripts/compile_bytecode.py [manifest]
"""

from __future__ import annotations

import compileall
import os
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MANIFEST = Path(__file__).with_name("bytecode-manifest.txt")


def _compile(paths: list[str]) -> int:
    """The number of files that did not compile (they are compiled, or refused, on import as before)."""
    return sum(not compileall.compile_file(path, quiet=2) for path in paths)


def main(argv: list[str]) -> int:
    manifest = Path(argv[0]) if argv else MANIFEST
    packages = Path(sysconfig.get_paths()["purelib"])
    paths = [str(packages / line) for line in manifest.read_text().split() if (packages / line).is_file()]
    workers = max(1, os.cpu_count() or 1)
    shares = [paths[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        failed = sum(pool.map(_compile, shares))
    if failed:
        print(f"compile_bytecode: {failed} of {len(paths)} listed modules did not compile", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
