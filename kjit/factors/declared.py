"""A factor known only by its variables and their message families: the server side of a factor
whose oracle runs on its clients ("bring your own sampler").

``DeclaredFactor(label, variables={"x": "gaussian", "y": "gaussian", "z": "gaussian"}, output="z")``
has no sampler and no exact rule; an operator for it learns only from (incoming, belief) pairs its
clients compute (the initial batch, then observations), and its oracle is
:class:`kjit.oracles.ClientOracle`.  Everything that identifies it is in its parameters, so it is
rebuilt by name from a saved state (``get_factor("declared", **params)``) on a server that never
saw the client's code.
"""

from __future__ import annotations

from typing import Mapping

from .base import Factor, register_factor
from ..errors import quoted
from ..families import FAMILIES, family_name

__all__ = ["DeclaredFactor"]


class DeclaredFactor(Factor):
    """Variables and families only (see the module docstring).

    ``ValueError`` messages start with the offending field: ``label``, ``variables.<name>`` or
    ``output``.
    """

    name = "declared"

    def __init__(self, label: str, variables: Mapping[str, str], output: str):
        if not isinstance(label, str) or not label.isidentifier():
            raise ValueError(f"label: {quoted(label)} is not an identifier (letters, digits, _; not starting with a digit)")
        if not isinstance(variables, Mapping) or not variables:
            raise ValueError("variables: give at least one variable and its message family")
        fams = {}
        for v, fam in variables.items():
            if not isinstance(v, str) or not v.isidentifier():
                raise ValueError(f"variables.{v}: {quoted(v)} is not an identifier (letters, digits, _; not starting "
                                 f"with a digit)")
            if fam not in FAMILIES:
                raise ValueError(f"variables.{v}: unknown family {quoted(fam)}; known: {', '.join(sorted(FAMILIES))}")
            fams[v] = FAMILIES[fam]
        if output not in fams:
            raise ValueError(f"output: {quoted(output)} is not one of the variables ({', '.join(fams)})")
        self.label = label
        self._variables = {v: str(f) for v, f in variables.items()}
        self.inputs = tuple(v for v in fams if v != output)
        self.output = output
        self.families = {**{v: fams[v] for v in self.inputs}, output: fams[output]}

    #: stands for a factor whose code is elsewhere (Factor.mismatch asks this side)
    declared = True

    def params(self) -> dict:
        return {"label": self.label, "variables": dict(self._variables), "output": self.output}

    def mismatch(self, other, theirs: str = "the other", mine: str = "this one") -> str | None:
        """As :meth:`Factor.mismatch` for another declared factor or a recorded ``(name, params)``; a factor
        with code — the client's own, which this declaration stands for — is this one when its variables and
        their families and its output are these, all a declaration says (found in review: a served declared operator's
        client-side oracle was refused as "another factor")."""
        if isinstance(other, Factor) and not getattr(other, "declared", False):
            here = dict(self._variables)
            there = {v: family_name(f) for v, f in other.families.items()}
            if there != here:
                return (f"{theirs} and {mine} are for different factors: variables and families {there} for {theirs}, "
                        f"{here} for {mine} (declared as {self.label!r})")
            if getattr(other, "output", None) != self.output:
                # (a sampler of x = y·z taken as the oracle of z = x·y, its answers learned: audit)
                return (f"{theirs} and {mine} are for different factors: output {getattr(other, 'output', None)!r} for "
                        f"{theirs}, {self.output!r} for {mine} (declared as {self.label!r})")
            return None
        return super().mismatch(other, theirs, mine)

    def sample(self, inputs, size, rng):
        raise ValueError(f"factor {self.label!r} is declared by its variables only: its samples are drawn by its "
                         f"clients' oracle")


register_factor(DeclaredFactor)
