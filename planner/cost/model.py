"""The cost model: predicted kernel time as a linear function of the features of a call.

`time = sum_i coefficient_i * feature_i`, one coefficient per feature, in seconds per unit: the GNA kernel's
over planner.cost.features' FEATURES. A model may also carry a set for the sparse kernel (`sparse_coefficients`,
over planner.cost.sparse_features' SPARSE_FEATURES), one for the GNA backward pass (`backward_coefficients`, over
planner.cost.backward_features' BACKWARD_FEATURES) and, for `precision="fp8"`, the FP8 variants of the GNA and
sparse kernels (`fp8_coefficients` over FEATURES, `fp8_sparse_coefficients` over SPARSE_FEATURES: the same
work counted, a different cost per unit), and FlashAttention-4's forward and backward (`fa4_coefficients`,
`fa4_backward_coefficients`, over planner.cost.fa4_features' FA4_FEATURES), and natsim's Gluon kernel's in FP8
and in its 16-bit variant (`gluon_fp8_coefficients`, `gluon_16bit_coefficients`, over planner.cost.gluon_features'
GLUON_FEATURES); files without a set load with None there. `host_seconds` holds, per backend, the host's time to issue one call (planner.cost.host): a call never
takes less, so searches price each call at max(host, predicted kernel time). Coefficients differ per GPU and are
data: one JSON file per GPU (planner.cost.files says where they live, planner.cost.gpus which GPU a device names).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from natsim.kernels.backends.triton import check_precision

from .backward_features import BACKWARD_FEATURES
from .fa4_features import FA4_FEATURES
from .features import FEATURES
from .gluon_features import GLUON_FEATURES
from .sparse_features import SPARSE_FEATURES

FORMAT = "natsim-cost-model/1"
# Features added after coefficient files were first written: a file fitted without one loads with it at 0 (the
# model it was fitted with had no such cost), so that users' older calibrations keep working.
ADDED_FEATURES = frozenset({"narrow_head_flops", "split_head_flops", "masked_blocks"})


def _checked(coefficients: Mapping[str, float], features: Sequence[str], label: str) -> dict[str, float]:
    """`coefficients` as floats in `features` order, or a sentence error: those names (any of ADDED_FEATURES may
    be missing, at 0), each finite and non-negative."""
    names = set(coefficients)
    if not names <= set(features) or not set(features) - names <= ADDED_FEATURES:
        raise ValueError(f"{label} must name exactly the features {tuple(features)}, got {sorted(names)}.")
    values = {name: float(coefficients.get(name, 0.0)) for name in features}
    if any(not np.isfinite(v) or v < 0 for v in values.values()):
        raise ValueError(f"{label} must be finite and non-negative, got {label}={values}.")
    return values


HOST_BACKENDS = ("triton", "fa4", "gluon")  # planner.backends.PLANNED: the backends a host time is kept for
GLUON_16BIT_HOST = "gluon-16bit"  # the Gluon kernel's 16-bit variant, which issues no quantization: its own host time
OWN_ATTENTION = "sdpa"  # torch's scaled_dot_product_attention: the attention a model calls of its own
HOST_CALLS = HOST_BACKENDS + (GLUON_16BIT_HOST, OWN_ATTENTION)  # what a cost model may keep a host time for
BORROWED_HOST = "host_seconds_borrowed"  # info key: host times taken from another GPU's file (call -> that GPU)


def host_call(backend: str, precision: Optional[str]) -> str:
    """The host time that prices a call on `backend` in `precision`: the backend's own, the 16-bit variant's for
    the Gluon kernel in 16 bits."""
    return GLUON_16BIT_HOST if backend == "gluon" and check_precision(precision) is None else backend


def _checked_host(host_seconds: Mapping[str, float]) -> dict[str, float]:
    """`host_seconds` as floats, or a sentence error: calls among HOST_CALLS, each finite and non-negative."""
    values = {str(name): float(value) for name, value in host_seconds.items()}
    if not set(values) <= set(HOST_CALLS) or any(not np.isfinite(v) or v < 0 for v in values.values()):
        raise ValueError(f"host_seconds must map calls among {HOST_CALLS} to finite non-negative seconds, got "
                         f"host_seconds={host_seconds!r}.")
    return values


def _in_order(coefficients: Mapping[str, float], features: Sequence[str]) -> np.ndarray:
    """`coefficients` as a vector in `features` order."""
    return np.array([coefficients[name] for name in features])


def _per_feature(row: np.ndarray, coefficients: Mapping[str, float], features: Sequence[str]) -> dict[str, float]:
    """Predicted seconds of one feature row (columns in `features` order), per feature."""
    row = np.asarray(row, np.float64)
    return {name: float(row[i] * coefficients[name]) for i, name in enumerate(features)}


# The optional coefficient sets, by attribute (also their JSON key): the features each is over, and which kernel
# (as `natsim calibrate --kernels` names it) each prices, with the words errors use for it.
_SET_FEATURES = {
    "coefficients": FEATURES,
    "sparse_coefficients": SPARSE_FEATURES,
    "backward_coefficients": BACKWARD_FEATURES,
    "fp8_coefficients": FEATURES,
    "fp8_sparse_coefficients": SPARSE_FEATURES,
    "fa4_coefficients": FA4_FEATURES,
    "fa4_backward_coefficients": FA4_FEATURES,
    "gluon_fp8_coefficients": GLUON_FEATURES,
    "gluon_16bit_coefficients": GLUON_FEATURES,
}
OPTIONAL_SETS = tuple(name for name in _SET_FEATURES if name != "coefficients")
_KERNEL_SETS = {
    "sparse": ("sparse_coefficients", "sparse-kernel"),
    "backward": ("backward_coefficients", "backward"),
    "gna-fp8": ("fp8_coefficients", "FP8 GNA-kernel"),
    "sparse-fp8": ("fp8_sparse_coefficients", "FP8 sparse-kernel"),
    "fa4": ("fa4_coefficients", "FlashAttention-4"),
    "fa4-backward": ("fa4_backward_coefficients", "FlashAttention-4 backward"),
    "gluon-fp8": ("gluon_fp8_coefficients", "Gluon FP8"),
    "gluon-16bit": ("gluon_16bit_coefficients", "Gluon 16-bit"),
}


def coefficients_label(kernel: str) -> str:
    """The words sentences use for `kernel`'s coefficient set (a name `natsim calibrate --kernels` takes, not
    "gna" or "host"): "FlashAttention-4", "Gluon 16-bit", ..."""
    return _KERNEL_SETS[kernel][1]


def _gna_kernel(precision: Optional[str]) -> str:
    return "gna" if check_precision(precision) is None else "gna-fp8"


def _sparse_kernel(precision: Optional[str]) -> str:
    return "sparse" if check_precision(precision) is None else "sparse-fp8"


def _fa4_kernel(backward: bool) -> str:
    return "fa4-backward" if backward else "fa4"


def gluon_kernel(precision: Optional[str]) -> str:
    """The Gluon kernel's calibration name in `precision`: "gluon-fp8", or "gluon-16bit" for None (the inputs'
    bf16 or fp16)."""
    return "gluon-16bit" if check_precision(precision) is None else "gluon-fp8"


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each feature on one GPU, with how and when they were fitted (`info`).

    `coefficients` are the GNA kernel's (FEATURES); `sparse_coefficients` the sparse kernel's
    (SPARSE_FEATURES), `backward_coefficients` the GNA backward pass's (BACKWARD_FEATURES), `fp8_coefficients`
    and `fp8_sparse_coefficients` the GNA and sparse kernels' with `precision="fp8"`, `fa4_coefficients` and
    `fa4_backward_coefficients` FlashAttention-4's forward and backward calls (FA4_FEATURES, GNA and block masks
    alike), `gluon_fp8_coefficients` and `gluon_16bit_coefficients` natsim's Gluon kernel's calls in FP8 and in 16
    bits (GLUON_FEATURES); each None for a model calibrated without it.
    """

    gpu: str
    coefficients: Mapping[str, float]
    info: Mapping[str, object] = field(default_factory=dict)
    sparse_coefficients: Optional[Mapping[str, float]] = None
    backward_coefficients: Optional[Mapping[str, float]] = None
    fp8_coefficients: Optional[Mapping[str, float]] = None
    fp8_sparse_coefficients: Optional[Mapping[str, float]] = None
    fa4_coefficients: Optional[Mapping[str, float]] = None
    fa4_backward_coefficients: Optional[Mapping[str, float]] = None
    gluon_fp8_coefficients: Optional[Mapping[str, float]] = None
    gluon_16bit_coefficients: Optional[Mapping[str, float]] = None
    host_seconds: Optional[Mapping[str, float]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", _checked(self.coefficients, FEATURES, "coefficients"))
        for name in OPTIONAL_SETS:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _checked(getattr(self, name), _SET_FEATURES[name], name))
        object.__setattr__(self, "info", dict(self.info))
        if self.host_seconds is not None:
            object.__setattr__(self, "host_seconds", _checked_host(self.host_seconds))

    def host(self, backend: str) -> float:
        """Seconds the host takes to issue one call on `backend` (one of HOST_CALLS: `host_call` names the one for
        a backend in a precision), or of torch's SDPA for OWN_ATTENTION (0 where this model was calibrated without
        it; planner.cost.files borrows another GPU's file's where it has one). A model without the 16-bit Gluon
        variant's time gives the FP8 route's, which issues the same launch and more (its quantization)."""
        times = self.host_seconds or {}
        if backend == GLUON_16BIT_HOST and backend not in times:
            backend = "gluon"
        return float(times.get(backend, 0.0))

    def at_least_host(self, seconds, backend: str):
        """Predicted seconds of calls on `backend` (a number or an array), each at least the host's time to issue
        it: a call shorter than that takes the host's time."""
        return np.maximum(seconds, self.host(backend))

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

    def has(self, kernel: str) -> bool:
        """Whether this model has coefficients for `kernel`: "gna", "sparse", "backward", "gna-fp8", "sparse-fp8",
        "fa4", "fa4-backward", "gluon-fp8", "gluon-16bit"."""
        return kernel == "gna" or getattr(self, _KERNEL_SETS[kernel][0]) is not None

    def predict(self, features: np.ndarray, precision: Optional[str] = None) -> np.ndarray:
        """Predicted seconds of GNA-kernel calls for feature rows `(n, len(FEATURES))` (or one row), in
        `precision` (None: the inputs' dtype; "fp8")."""
        if precision is None:
            return np.asarray(features, np.float64) @ self.vector
        return np.asarray(features, np.float64) @ _in_order(*self._fitted(_gna_kernel(precision)))

    def breakdown(self, features: np.ndarray, precision: Optional[str] = None) -> dict[str, float]:
        """Predicted seconds of one GNA-kernel feature row, per feature."""
        if precision is None:
            return _per_feature(features, self.coefficients, FEATURES)
        return _per_feature(features, *self._fitted(_gna_kernel(precision)))

    def predict_sparse(self, features: np.ndarray, precision: Optional[str] = None) -> np.ndarray:
        """Predicted seconds of sparse-kernel calls for feature rows `(n, len(SPARSE_FEATURES))` (or one row), in
        `precision`."""
        return np.asarray(features, np.float64) @ _in_order(*self._fitted(_sparse_kernel(precision)))

    def sparse_breakdown(self, features: np.ndarray, precision: Optional[str] = None) -> dict[str, float]:
        """Predicted seconds of one sparse-kernel feature row, per feature."""
        return _per_feature(features, *self._fitted(_sparse_kernel(precision)))

    def predict_backward(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds of GNA backward calls for feature rows `(n, len(BACKWARD_FEATURES))` (or one row)."""
        return np.asarray(features, np.float64) @ _in_order(*self._fitted("backward"))

    def backward_breakdown(self, features: np.ndarray) -> dict[str, float]:
        """Predicted seconds of one backward feature row, per feature."""
        return _per_feature(features, *self._fitted("backward"))

    def predict_fa4(self, features: np.ndarray, backward: bool = False) -> np.ndarray:
        """Predicted seconds of FlashAttention-4 calls for feature rows `(n, len(FA4_FEATURES))` (or one row): the
        forward's, or with `backward` the backward's."""
        return np.asarray(features, np.float64) @ _in_order(*self._fitted(_fa4_kernel(backward)))

    def fa4_breakdown(self, features: np.ndarray, backward: bool = False) -> dict[str, float]:
        """Predicted seconds of one FlashAttention-4 feature row, per feature (the backward's with `backward`)."""
        return _per_feature(features, *self._fitted(_fa4_kernel(backward)))

    def predict_gluon(self, features: np.ndarray, precision: Optional[str]) -> np.ndarray:
        """Predicted seconds of Gluon calls for feature rows `(n, len(GLUON_FEATURES))` (or one row) in
        `precision` ("fp8", or None for the 16-bit variant)."""
        return np.asarray(features, np.float64) @ _in_order(*self._fitted(gluon_kernel(precision)))

    def gluon_breakdown(self, features: np.ndarray, precision: Optional[str]) -> dict[str, float]:
        """Predicted seconds of one Gluon feature row in `precision`, per feature."""
        return _per_feature(features, *self._fitted(gluon_kernel(precision)))

    def _fitted(self, kernel: str) -> tuple[Mapping[str, float], tuple[str, ...]]:
        """The coefficients of `kernel` (a key of _KERNEL_SETS) and their features, or a sentence error saying
        how to fit them when this model was calibrated without them."""
        attribute, label = _KERNEL_SETS[kernel]
        coefficients = getattr(self, attribute)
        if coefficients is None:
            raise ValueError(
                f"the cost model of {self.gpu} has no {label} coefficients; "
                f"run `natsim calibrate --kernels gna,{kernel}` on that GPU to fit them."
            )
        return coefficients, _SET_FEATURES[attribute]

    def to_dict(self) -> dict:
        data = {"format": FORMAT, "gpu": self.gpu, "coefficients": dict(self.coefficients)}
        for name in OPTIONAL_SETS:
            if getattr(self, name) is not None:
                data[name] = dict(getattr(self, name))
        if self.host_seconds is not None:
            data["host_seconds"] = dict(self.host_seconds)
        data["info"] = dict(self.info)
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> "CostModel":
        if not isinstance(data, Mapping):
            raise ValueError(f"a cost model must be a JSON object with format {FORMAT!r}, got a value of type "
                             f"{type(data).__name__}.")
        if data.get("format") != FORMAT:
            raise ValueError(f"a cost model must have format {FORMAT!r}, got format={data.get('format')!r}.")
        return cls(gpu=str(data["gpu"]), coefficients=data["coefficients"], info=data.get("info", {}),
                   host_seconds=data.get("host_seconds"), **{name: data.get(name) for name in OPTIONAL_SETS})

    def save(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "CostModel":
        return cls.from_dict(json.loads(Path(path).read_text()))
