"""A chi-square goodness-of-fit test without scipy (Wilson-Hilferty approximation)."""

from __future__ import annotations

import math

import numpy as np


def chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value that `observed` counts come from `expected_probs`; small cells are pooled."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    expected = np.asarray(expected_probs, dtype=np.float64).ravel() * observed.sum()
    order = np.argsort(expected)
    pooled_o, pooled_e, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o += observed[i]
        acc_e += expected[i]
        if acc_e >= min_expected:
            pooled_o.append(acc_o)
            pooled_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0 and pooled_e:
        pooled_o[-1] += acc_o
        pooled_e[-1] += acc_e
    o, e = np.array(pooled_o), np.array(pooled_e)
    if (e == 0).any() and (o[e == 0] > 0).any():
        return 0.0
    dof = len(o) - 1
    if dof < 1:
        return 1.0
    chi2 = float(((o - e) ** 2 / e).sum())
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))
