"""Load a benchmark script (benchmarks/ is not a package) as a module, for the tests of its flags and keys."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(filename: str, module_name: str | None = None):
    """A fresh module of ``benchmarks/<filename>`` (executed anew on each call)."""
    spec = importlib.util.spec_from_file_location(module_name or f"{Path(filename).stem}_bench", BENCHMARKS / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
