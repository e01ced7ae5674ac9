"""The ``kjit`` command line.

    kjit demo     messages computed by both oracles for a few logistic-factor inputs

Errors are reported as one line on stderr with exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def _demo(args) -> int:
    from .factors import Logistic
    from .families import Beta, Gaussian
    from .oracles import ImportanceSamplingOracle, QuadratureOracle

    factor = Logistic()
    inc = {
        "x": Gaussian([0.0, 2.0, -3.0, 0.5, 8.0], [1.0, 0.25, 4.0, 10.0, 1.0]),
        "z": Beta([2.0, 1.0, 2.0, 1.0, 5.0], [1.0, 2.0, 1.0, 2.0, 3.0]),
    }
    quad = QuadratureOracle(factor)
    is_oracle = ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=args.seed)
    print("Logistic factor z = sigmoid(x): outgoing messages by quadrature and by importance sampling")
    print(f"(importance sampling: {args.particles} particles, proposal N(0, 200))\n")
    for to in ("x", "z"):
        mq = quad.message(inc, to)
        bq = quad.belief(inc, to)
        bi = is_oracle.belief(inc, to)
        mi = bi / inc[to]
        names = mq.param_names
        print(f"message to {to} ({type(mq).__name__}: {', '.join(names)})")
        print(f"  {'incoming x':>22}  {'incoming z':>20}  {'quadrature':>24}  {'importance sampling':>24}  {'KL[q_quad|q_IS]':>15}  {'ESS':>8}")
        kl = bq.kl(bi)
        for i in range(len(mq)):
            ix = f"N({inc['x'].mean()[i]:.2f}, {inc['x'].var()[i]:.2f})"
            iz = f"Beta({inc['z'].alpha[i]:.1f}, {inc['z'].beta[i]:.1f})"
            q = ", ".join(f"{p[i]:.5g}" for p in mq.params)
            s = ", ".join(f"{p[i]:.5g}" for p in mi.params)
            print(f"  {ix:>22}  {iz:>20}  {q:>24}  {s:>24}  {kl[i]:15.2e}  {is_oracle.last_ess_[i]:8.0f}")
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kjit",
        description="kjit: learned expectation-propagation message operators with just-in-time oracle fallback.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("demo", help="print logistic-factor messages from the quadrature and sampling oracles")
    d.add_argument("--particles", type=int, default=500_000, help="importance-sampling particles (default 500000)")
    d.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    d.set_defaults(func=_demo)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kjit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
