"""The cost model: predicted GNA kernel time as a linear function of the features (planner.features).

`time = sum_i coefficient_i * feature_i`, one coefficient per feature, in seconds per unit. A model may also
carry a second set for the sparse kernel (`sparse_coefficients`, over planner.sparse_features'
SPARSE_FEATURES, JSON key "sparse_coefficients") and a third for the GNA backward pass (`backward_coefficients`,
over planner.backward_features' BACKWARD_FEATURES); files without them load with None there. Coefficients
differ per GPU and are data: one JSON file per GPU, named after the GPU (`torch.cuda.get_device_name()`).
The planner looks in the user's folder first (`user_coefficients_dir()`, where `natsim calibrate` writes),
then in the files shipped with natsim (planner/coefficients/). Without a file for the GPU at hand there is
no cost model, and the planner ranks by simulated tiles alone. A GPU with coefficients can also be named
(`device="h100"`), so that a machine without it plans for it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch

from .backward_features import BACKWARD_FEATURES
from .features import FEATURES
from .sparse_features import SPARSE_FEATURES

COEFFICIENTS_DIR = Path(__file__).resolve().parent / "coefficients"
DATA_DIR_ENV = "NATSIM_DATA_DIR"
FORMAT = "natsim-cost-model/1"


def _checked(coefficients: Mapping[str, float], features: Sequence[str], label: str) -> dict[str, float]:
    """`coefficients` as floats in `features` order, or a sentence error: exactly those names, each finite and
    non-negative."""
    names = set(coefficients)
    if names != set(features):
        raise ValueError(f"{label} must name exactly the features {tuple(features)}, got {sorted(names)}.")
    values = {name: float(coefficients[name]) for name in features}
    if any(not np.isfinite(v) or v < 0 for v in values.values()):
        raise ValueError(f"{label} must be finite and non-negative, got {label}={values}.")
    return values


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each feature on one GPU, with how and when they were fitted (`info`).

    `coefficients` are the GNA kernel's (FEATURES); `sparse_coefficients` the sparse kernel's
    (SPARSE_FEATURES) and `backward_coefficients` the GNA backward pass's (BACKWARD_FEATURES), each None for a
    model calibrated without it.
    """

    gpu: str
    coefficients: Mapping[str, float]
    info: Mapping[str, object] = field(default_factory=dict)
    sparse_coefficients: Optional[Mapping[str, float]] = None
    backward_coefficients: Optional[Mapping[str, float]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", _checked(self.coefficients, FEATURES, "coefficients"))
        if self.sparse_coefficients is not None:
            sparse = _checked(self.sparse_coefficients, SPARSE_FEATURES, "sparse_coefficients")
            object.__setattr__(self, "sparse_coefficients", sparse)
        if self.backward_coefficients is not None:
            backward = _checked(self.backward_coefficients, BACKWARD_FEATURES, "backward_coefficients")
            object.__setattr__(self, "backward_coefficients", backward)
        object.__setattr__(self, "info", dict(self.info))

    @property
    def vector(self) -> np.ndarray:
        """The coefficients in FEATURES order."""
        return np.array([self.coefficients[name] for name in FEATURES])

    @property
    def kv_tilings(self) -> tuple[str, ...]:
        """The KV tiling modes whose kernels this model was calibrated or checked on (`info["kv_tilings"]`, by
        `natsim calibrate` since the dynamic kernel; older files: the static kernel only). The planner
        scores only these modes with it."""
        return tuple(self.info.get("kv_tilings", ("static",)))

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds for feature rows `(n, len(FEATURES))` (or one row)."""
        return np.asarray(features, np.float64) @ self.vector

    def breakdown(self, features: np.ndarray) -> dict[str, float]:
        """Predicted seconds of one feature row, per feature."""
        row = np.asarray(features, np.float64)
        return {name: float(row[i] * self.coefficients[name]) for i, name in enumerate(FEATURES)}

    def predict_sparse(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds of sparse-kernel calls for feature rows `(n, len(SPARSE_FEATURES))` (or one row)."""
        if self.sparse_coefficients is None:
            raise ValueError(
                f"the cost model of {self.gpu} has no sparse-kernel coefficients; "
                "run `natsim calibrate --kernels gna,sparse` on that GPU to fit them."
            )
        vector = np.array([self.sparse_coefficients[name] for name in SPARSE_FEATURES])
        return np.asarray(features, np.float64) @ vector

    def predict_backward(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds of GNA backward calls for feature rows `(n, len(BACKWARD_FEATURES))` (or one row)."""
        if self.backward_coefficients is None:
            raise ValueError(
                f"the cost model of {self.gpu} has no backward coefficients; "
                "run `natsim calibrate --kernels gna,backward` on that GPU to fit them."
            )
        vector = np.array([self.backward_coefficients[name] for name in BACKWARD_FEATURES])
        return np.asarray(features, np.float64) @ vector

    def backward_breakdown(self, features: np.ndarray) -> dict[str, float]:
        """Predicted seconds of one backward feature row, per feature."""
        self.predict_backward(features)  # the sentence error without backward coefficients
        row = np.asarray(features, np.float64)
        return {name: float(row[i] * self.backward_coefficients[name]) for i, name in enumerate(BACKWARD_FEATURES)}

    def to_dict(self) -> dict:
        data = {"format": FORMAT, "gpu": self.gpu, "coefficients": dict(self.coefficients)}
        if self.sparse_coefficients is not None:
            data["sparse_coefficients"] = dict(self.sparse_coefficients)
        if self.backward_coefficients is not None:
            data["backward_coefficients"] = dict(self.backward_coefficients)
        data["info"] = dict(self.info)
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> "CostModel":
        if data.get("format") != FORMAT:
            raise ValueError(f"a cost model must have format {FORMAT!r}, got format={data.get('format')!r}.")
        return cls(gpu=str(data["gpu"]), coefficients=data["coefficients"], info=data.get("info", {}),
                   sparse_coefficients=data.get("sparse_coefficients"),
                   backward_coefficients=data.get("backward_coefficients"))

    def save(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "CostModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _slug(name: str) -> str:
    """A GPU name in lower case, runs of other characters as '-': 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def gpu_file_name(gpu: str) -> str:
    """The coefficient file of a GPU: its name in lower case, runs of other characters as '-'."""
    return _slug(gpu) + ".json"


def user_coefficients_dir() -> Path:
    """The user's coefficient folder, where `natsim calibrate` writes and the planner looks first:
    `$NATSIM_DATA_DIR/coefficients`, else `$XDG_DATA_HOME/natsim/coefficients`, else
    `~/.local/share/natsim/coefficients`."""
    root = os.environ.get(DATA_DIR_ENV)
    if root:
        return Path(root).expanduser() / "coefficients"
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "natsim" / "coefficients"


def coefficient_dirs() -> tuple[Path, Path]:
    """Where the planner looks for a GPU's coefficients, in order: the user's folder, then natsim's own."""
    return (user_coefficients_dir(), COEFFICIENTS_DIR)


def known_gpus() -> list[str]:
    """The GPUs that have cost-model coefficients here (the user's and those shipped with natsim), by name.

    Files that do not load as a cost model, or whose name is not their GPU's file name, are passed over.
    """
    found: dict[str, str] = {}
    for directory in coefficient_dirs():
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            try:
                gpu = CostModel.load(path).gpu
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if path.name == gpu_file_name(gpu):
                found.setdefault(path.name, gpu)
    return sorted(found.values())


def _words_of(alias: str, gpu: str) -> bool:
    """True when `alias` (slugged) is a run of whole words of `gpu`'s name: 'h100' names 'NVIDIA H100 80GB HBM3'."""
    return bool(alias) and f"-{alias}-" in f"-{_slug(gpu)}-"


def gpu_alias(gpu: str, gpus: Sequence[str]) -> str:
    """The shortest name that picks `gpu` alone among `gpus`: its words from the first one with a digit
    (the model, 'h100'), as many as it takes; else its full name in lower case."""
    words = _slug(gpu).split("-")
    start = next((i for i, word in enumerate(words) if any(c.isdigit() for c in word)), 0)
    for end in range(start + 1, len(words) + 1):
        alias = "-".join(words[start:end])
        if [g for g in gpus if _words_of(alias, g)] == [gpu]:
            return alias
    return _slug(gpu)


def describe_gpus(gpus: Sequence[str], everyone: Optional[Sequence[str]] = None) -> str:
    """'NVIDIA H100 80GB HBM3 (--device h100)' for each GPU, aliases unique among `everyone` (default: `gpus`)."""
    everyone = gpus if everyone is None else everyone
    if not gpus:
        return "none"
    return ", ".join(f"{gpu} (--device {gpu_alias(gpu, everyone)})" for gpu in gpus)


def gpu_named(name: str) -> str:
    """The GPU with coefficients that `name` means: its full name (any case) or a run of its name's words
    that no other such GPU has ('h100' for 'NVIDIA H100 80GB HBM3')."""
    gpus = known_gpus()
    key = _slug(name)
    exact = [gpu for gpu in gpus if _slug(gpu) == key]
    if exact:
        return exact[0]
    matches = [gpu for gpu in gpus if _words_of(key, gpu)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(
            f"device={name!r} matches more than one GPU with cost-model coefficients: "
            f"{describe_gpus(matches, gpus)}; name one of them by its full name or its alias."
        )
    raise ValueError(
        "device must name a torch device like 'cuda:0' or 'cpu', or a GPU with cost-model coefficients "
        f"({describe_gpus(gpus)}), got device={name!r}."
    )


def gpu_of(device: Union[None, str, torch.device]) -> Optional[str]:
    """The name of the GPU that `device` means, or None for no GPU.

    `device` is None (the current CUDA device, if any), a torch device or device string ('cuda:0', 'cpu'),
    or the name or alias of a GPU with cost-model coefficients ('NVIDIA H100 80GB HBM3', 'h100'), which
    need not be present: that is how a machine plans for another GPU.
    """
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        if isinstance(device, str):
            return gpu_named(device)
        raise ValueError(f"device must name a torch device like 'cuda:0' or 'cpu', got {device=}.") from None
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} names a CUDA device, but torch sees no CUDA GPU.")
    return torch.cuda.get_device_name(device)


def cost_model_for(gpu: Optional[str], directory: Optional[Path] = None) -> Optional[CostModel]:
    """The stored cost model of `gpu`, or None when there is no GPU or no coefficients for it.

    Looks in `directory` if given, else in the user's folder and then in the coefficients shipped with natsim.
    """
    if gpu is None:
        return None
    for folder in coefficient_dirs() if directory is None else (Path(directory),):
        path = folder / gpu_file_name(gpu)
        if path.is_file():
            return CostModel.load(path)
    return None
