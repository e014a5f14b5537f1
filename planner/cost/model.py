"""The cost model: predicted kernel time as a linear function of the features of a call.

`time = sum_i coefficient_i * feature_i`, one coefficient per feature, in seconds per unit: the GNA kernel's
over planner.cost.features' FEATURES. A model may also carry a second set for the sparse kernel
(`sparse_coefficients`, over planner.cost.sparse_features' SPARSE_FEATURES, JSON key "sparse_coefficients") and a
third for the GNA backward pass (`backward_coefficients`, over planner.cost.backward_features'
BACKWARD_FEATURES); files without them load with None there. Coefficients differ per GPU and are data: one JSON
file per GPU (planner.cost.files says where they live, planner.cost.gpus which GPU a device names).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from .backward_features import BACKWARD_FEATURES
from .features import FEATURES
from .sparse_features import SPARSE_FEATURES

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


def _in_order(coefficients: Mapping[str, float], features: Sequence[str]) -> np.ndarray:
    """`coefficients` as a vector in `features` order."""
    return np.array([coefficients[name] for name in features])


def _per_feature(row: np.ndarray, coefficients: Mapping[str, float], features: Sequence[str]) -> dict[str, float]:
    """Predicted seconds of one feature row (columns in `features` order), per feature."""
    row = np.asarray(row, np.float64)
    return {name: float(row[i] * coefficients[name]) for i, name in enumerate(features)}


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
        return _in_order(self.coefficients, FEATURES)

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
        return _per_feature(features, self.coefficients, FEATURES)

    def predict_sparse(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds of sparse-kernel calls for feature rows `(n, len(SPARSE_FEATURES))` (or one row)."""
        return np.asarray(features, np.float64) @ _in_order(*self._fitted("sparse"))

    def sparse_breakdown(self, features: np.ndarray) -> dict[str, float]:
        """Predicted seconds of one sparse-kernel feature row, per feature."""
        return _per_feature(features, *self._fitted("sparse"))

    def predict_backward(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds of GNA backward calls for feature rows `(n, len(BACKWARD_FEATURES))` (or one row)."""
        return np.asarray(features, np.float64) @ _in_order(*self._fitted("backward"))

    def backward_breakdown(self, features: np.ndarray) -> dict[str, float]:
        """Predicted seconds of one backward feature row, per feature."""
        return _per_feature(features, *self._fitted("backward"))

    def _fitted(self, kernel: str) -> tuple[Mapping[str, float], tuple[str, ...]]:
        """The coefficients of `kernel` ("sparse" or "backward") and their features, or a sentence error saying
        how to fit them when this model was calibrated without them."""
        coefficients, features, label = {
            "sparse": (self.sparse_coefficients, SPARSE_FEATURES, "sparse-kernel"),
            "backward": (self.backward_coefficients, BACKWARD_FEATURES, "backward"),
        }[kernel]
        if coefficients is None:
            raise ValueError(
                f"the cost model of {self.gpu} has no {label} coefficients; "
                f"run `natsim calibrate --kernels gna,{kernel}` on that GPU to fit them."
            )
        return coefficients, features

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
