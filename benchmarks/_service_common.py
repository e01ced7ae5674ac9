"""Helpers shared by the service benchmarks (service.py, replicas.py); not a benchmark itself."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def stats(times):
    t = np.asarray(times)
    return float(np.percentile(t, 50) * 1e3), float(np.percentile(t, 99) * 1e3), float(t.mean())


def timed(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def build_store(root: Path, n_train: int, n_inner: int, n_outer: int, names=("logistic-x",)) -> None:
    from service.store import OperatorStore
    from service.training import TrainSpec, train_operator

    store = OperatorStore(root)
    store.open()
    try:
        spec = TrainSpec("logistic", "x", n=n_train, n_inner=n_inner, n_outer=n_outer, threshold=-3.0,
                         inner_factors=(0.25,), width_factors=(2.0,), random_state=0, n_jobs=1)
        for name in names:
            jit, _, info = train_operator(spec)
            store.create(name, jit, {"training": info, "threshold": -3.0})
    finally:
        store.close()
