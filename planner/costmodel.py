"""The cost model: predicted GNA kernel time as a linear function of the features (planner.features).

`time = sum_i coefficient_i * feature_i`, one coefficient per feature, in seconds per unit. Coefficients
differ per GPU and are data: one JSON file per GPU in planner/coefficients/, named after the GPU
(`torch.cuda.get_device_name()`), written by `natsim calibrate` (planner.calibrate). Without a file for
the GPU at hand there is no cost model, and the planner ranks by simulated tiles alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np
import torch

from .features import FEATURES

COEFFICIENTS_DIR = Path(__file__).resolve().parent / "coefficients"
FORMAT = "natsim-cost-model/1"


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each feature on one GPU, with how and when they were fitted (`info`)."""

    gpu: str
    coefficients: Mapping[str, float]
    info: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = set(self.coefficients)
        if names != set(FEATURES):
            raise ValueError(
                f"coefficients must name exactly the features {FEATURES}, got {sorted(names)}."
            )
        values = {name: float(self.coefficients[name]) for name in FEATURES}
        if any(not np.isfinite(v) or v < 0 for v in values.values()):
            raise ValueError(f"coefficients must be finite and non-negative, got coefficients={values}.")
        object.__setattr__(self, "coefficients", values)
        object.__setattr__(self, "info", dict(self.info))

    @property
    def vector(self) -> np.ndarray:
        """The coefficients in FEATURES order."""
        return np.array([self.coefficients[name] for name in FEATURES])

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds for feature rows `(n, len(FEATURES))` (or one row)."""
        return np.asarray(features, np.float64) @ self.vector

    def breakdown(self, features: np.ndarray) -> dict[str, float]:
        """Predicted seconds of one feature row, per feature."""
        row = np.asarray(features, np.float64)
        return {name: float(row[i] * self.coefficients[name]) for i, name in enumerate(FEATURES)}

    def to_dict(self) -> dict:
        return {"format": FORMAT, "gpu": self.gpu, "coefficients": dict(self.coefficients), "info": dict(self.info)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "CostModel":
        if data.get("format") != FORMAT:
            raise ValueError(f"a cost model must have format {FORMAT!r}, got format={data.get('format')!r}.")
        return cls(gpu=str(data["gpu"]), coefficients=data["coefficients"], info=data.get("info", {}))

    def save(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "CostModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


def gpu_file_name(gpu: str) -> str:
    """The coefficient file of a GPU: its name in lower case, runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json"


def gpu_of(device: Union[None, str, torch.device]) -> Optional[str]:
    """The name of the GPU that `device` means (None: the current CUDA device), or None for no GPU."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must name a torch device like 'cuda:0' or 'cpu', got {device=}.") from None
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} names a CUDA device, but torch sees no CUDA GPU.")
    return torch.cuda.get_device_name(device)


def cost_model_for(gpu: Optional[str], directory: Path = COEFFICIENTS_DIR) -> Optional[CostModel]:
    """The stored cost model of `gpu`, or None when there is no GPU or no coefficients for it."""
    if gpu is None:
        return None
    path = directory / gpu_file_name(gpu)
    return CostModel.load(path) if path.is_file() else None
