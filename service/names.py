"""Operator names: the one rule, shared by the store and the shared update logs."""

from __future__ import annotations

import re

__all__ = ["NAME_RE", "check_name"]

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def check_name(name: str) -> str:
    """``name`` if it is a valid operator name, else ``ValueError``."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"invalid operator name {name!r}")
    return name
