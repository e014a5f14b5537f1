"""Fitting cost-model coefficients to measured times: non-negative least squares on relative error.

Pure numpy, so it is tested on CPU with synthetic timings from known coefficients. Each measurement is
weighted by 1 / its time (a 10 ms and a 1 s configuration count alike: the fit minimises relative error),
features are rescaled to unit columns (they span FLOPs to a constant 1) and the coefficients are kept
non-negative (no feature makes a kernel faster) by the Lawson-Hanson active-set method.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .features import FEATURES


def nnls(a: np.ndarray, b: np.ndarray, max_iterations: int = 0) -> np.ndarray:
    """`argmin ||a x - b||` subject to `x >= 0` (Lawson and Hanson, 1974, chapter 23)."""
    m, n = a.shape
    max_iterations = max_iterations or 3 * n
    tolerance = 10 * np.finfo(np.float64).eps * np.linalg.norm(a, 1) * max(m, n)
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    gradient = a.T @ (b - a @ x)
    for _ in range(max_iterations):
        if passive.all() or gradient[~passive].max() <= tolerance:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            shrinking = passive & (z <= 0)
            step = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + step * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
        gradient = a.T @ (b - a @ x)
    return x


def fit_coefficients(
    features: np.ndarray, times: np.ndarray, names: Sequence[str] = FEATURES
) -> dict[str, float]:
    """Coefficients (seconds per unit, by feature name) that best explain `times` from `features`.

    `features` is `(n, len(names))`, columns in `names` order: the GNA kernel's FEATURES
    (planner.cost.features.feature_matrix) unless told otherwise (the sparse kernel's SPARSE_FEATURES);
    `times` the `n` measured seconds.
    """
    names = tuple(names)
    features = np.asarray(features, np.float64)
    times = np.asarray(times, np.float64)
    if features.ndim != 2 or features.shape[1] != len(names):
        raise ValueError(
            f"features must be (n, {len(names)}) with columns {names}, got shape {features.shape}."
        )
    if times.shape != (features.shape[0],):
        raise ValueError(f"times must hold one time per feature row ({features.shape[0]}), got shape {times.shape}.")
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError("times must be positive and finite, got a non-positive or non-finite time.")
    if features.shape[0] < len(names):
        raise ValueError(
            f"fitting {len(names)} coefficients needs at least as many measurements, got {features.shape[0]}."
        )
    weighted = features / times[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0
    solution = nnls(weighted / scale, np.ones_like(times)) / scale
    return {name: float(value) for name, value in zip(names, solution)}


def relative_errors(
    features: np.ndarray, times: np.ndarray, coefficients: Mapping[str, float], names: Sequence[str] = FEATURES
) -> np.ndarray:
    """(predicted - measured) / measured per measurement (feature columns in `names` order)."""
    vector = np.array([coefficients[name] for name in names])
    return (np.asarray(features, np.float64) @ vector - times) / times
