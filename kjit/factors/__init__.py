"""Directed, sampleable factors f(x_out | x_in), one module each, and a registry of them by name.

The only thing kjit needs of a factor is a sampler of its output given its inputs (SPEC §2:
"any factor that can be sampled") and the message family of each variable; a factor module
adds, beside the factor, everything specific to it (exact rules per recipient, default training
distribution, default JIT threshold, default served recipients) — see :mod:`kjit.factors.base`.

Every module of this package (other than ``base``) is a built-in factor module: it is imported
here, registers its factors, and its ``__all__`` is re-exported, so ``from kjit.factors import
Logistic`` works and adding a built-in factor is adding one file.  Users add a factor with
:class:`SampledFactor` (or a subclass) and :func:`register_factor`, or from their own package
through the ``kjit.factors`` entry-point group.
"""

from __future__ import annotations

import importlib
import pkgutil

from . import base
from .base import *  # noqa: F401,F403
from .base import _REGISTRY, __all__ as _base_all  # noqa: F401  (tests reach the registry itself)

__all__ = list(_base_all)
BUILTIN_MODULES: tuple[str, ...] = tuple(
    sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base" and not m.name.startswith("_"))
)


def _export_builtins() -> None:
    for name in BUILTIN_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for key, value in base._exported(module).items():
            globals()[key] = value
            if key not in __all__:
                __all__.append(key)


_export_builtins()
