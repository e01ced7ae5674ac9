"""Errors shared by the oracles and the factors' exact rules."""

from __future__ import annotations

import numpy as np

__all__ = ["OracleError", "LowESSError"]


class OracleError(RuntimeError):
    """An oracle could not produce a trustworthy message."""


class LowESSError(OracleError):
    """Importance sampling produced too small an effective sample size for some rows."""

    def __init__(self, rows, ess, min_ess):
        self.rows = np.asarray(rows)
        self.ess = np.asarray(ess)
        self.min_ess = min_ess
        super().__init__(
            f"importance sampling failed for {self.rows.size} message(s): effective sample size "
            f"{float(np.min(self.ess)):.3g} < min_ess={min_ess} (rows {self.rows[:10].tolist()}"
            f"{'…' if self.rows.size > 10 else ''}); use a better proposal or more samples"
        )
