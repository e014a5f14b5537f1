"""Where each GPU's cost model is stored: one JSON file per GPU, named after the GPU.

A file is named after `torch.cuda.get_device_name()` (`gpu_file_name`). The planner looks in the user's
folder first (`user_coefficients_dir()`, where `natsim calibrate` writes), then in the files shipped with
natsim (planner/cost/coefficients/). Without a file for the GPU at hand there is no cost model, and the
planner ranks by simulated tiles alone. The user's folder, GPU names as file names and the interconnect files
(`link_for`) are natsim.stored's, re-exported here.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator, Optional

from natsim.stored import gpu_file_name, gpu_slug, json_files, link_file_name, link_for, user_coefficients_dir

from .model import BORROWED_HOST, CostModel

__all__ = ["COEFFICIENTS_DIR", "gpu_slug", "gpu_file_name", "user_coefficients_dir", "load_stored", "coefficient_dirs",
           "known_gpus", "cost_model_for", "borrowing_host", "own_host", "link_file_name", "link_for"]

COEFFICIENTS_DIR = Path(__file__).resolve().parent / "coefficients"


def load_stored(path: Path) -> CostModel:
    """The cost model in the file at `path`, read once per version of the file (its modification time and size):
    the planner looks its GPU's file up on every call, and lists every file for `device` names and reports."""
    return _load(path, *_stamp(path))


def _stamp(path: Path) -> tuple[int, int]:
    """A version of the file at `path`: its modification time and size."""
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=64)
def _load(path: Path, modified_ns: int, size: int) -> CostModel:
    return CostModel.load(path)


def coefficient_dirs() -> tuple[Path, Path]:
    """Where the planner looks for a GPU's coefficients, in order: the user's folder, then natsim's own."""
    return (user_coefficients_dir(), COEFFICIENTS_DIR)


def known_gpus() -> list[str]:
    """The GPUs that have cost-model coefficients here (the user's and those shipped with natsim), by name.

    Files that do not load as a cost model, or whose name is not their GPU's file name, are passed over.
    """
    found: dict[str, str] = {}
    for path, model in _stored(json_files(coefficient_dirs())):
        if path.name == gpu_file_name(model.gpu):
            found.setdefault(path.name, model.gpu)
    return sorted(found.values())


def _stored(paths: Iterable[Path]) -> Iterator[tuple[Path, CostModel]]:
    """The files among `paths` that load as a cost model, with it; the others passed over."""
    for path in paths:
        try:
            model = load_stored(path)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        yield path, model


def cost_model_for(gpu: Optional[str], directory: Optional[Path] = None) -> Optional[CostModel]:
    """The stored cost model of `gpu`, or None when there is no GPU or no coefficients for it.

    Looks in `directory` if given, else in the user's folder and then in the coefficients shipped with natsim.
    A host time the file lacks (a backend not installed when `natsim calibrate --kernels host` ran there) is taken
    from the other GPUs' files in those folders (`borrowing_host`).
    """
    if gpu is None:
        return None
    folders = coefficient_dirs() if directory is None else (Path(directory),)
    for folder in folders:
        path = folder / gpu_file_name(gpu)
        if path.is_file():
            others = tuple((other, *_stamp(other)) for other in json_files(folders) if other.name != path.name)
            return _borrowing_host(path, *_stamp(path), others)
    return None


@functools.lru_cache(maxsize=64)
def _borrowing_host(path: Path, modified_ns: int, size: int, others: tuple) -> CostModel:
    """The model stored at `path` (as of its stamp), with `borrowing_host` from the files `others`
    ((path, stamp) each: the stamps key the cache)."""
    donors = [model for _, model in _stored(other for other, *_ in others)]
    return borrowing_host(_load(path, modified_ns, size), donors)


def own_host(model: CostModel) -> tuple[dict[str, float], dict]:
    """`model`'s host times and info without what `borrowing_host` lent it: what a calibration extending it
    keeps as this GPU's."""
    info = dict(model.info)
    borrowed = info.pop(BORROWED_HOST, {})
    return {call: s for call, s in (model.host_seconds or {}).items() if call not in borrowed}, info


def borrowing_host(model: CostModel, donors: Iterable[CostModel]) -> CostModel:
    """`model` with each host time it lacks (of HOST_CALLS) set to the largest the other GPUs' models in `donors`
    measured, and named in its info (`BORROWED_HOST`: call -> that GPU), so that `natsim calibrate` does not keep
    them as its own. A call's host time is the host's, not the GPU's: another machine's is an estimate, and far
    closer than none (FlashAttention-4's 0.27 ms on the H200 machine, priced as 0 on a GPU calibrated without it,
    let plans pick it for calls a Triton launch issues in 0.04 ms)."""
    own = dict(model.host_seconds or {})
    borrowed: dict[str, tuple[float, str]] = {}
    for donor in donors:
        if donor.gpu == model.gpu:
            continue
        for call, seconds in (donor.host_seconds or {}).items():
            if call not in own and seconds > borrowed.get(call, (-1.0, ""))[0]:
                borrowed[call] = (seconds, donor.gpu)
    if not borrowed:
        return model
    info = {**model.info, BORROWED_HOST: {call: gpu for call, (_, gpu) in sorted(borrowed.items())}}
    return replace(model, host_seconds={**own, **{call: seconds for call, (seconds, _) in borrowed.items()}},
                   info=info)
