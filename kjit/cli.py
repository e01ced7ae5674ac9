"""The ``kjit`` command line.

    kjit demo     messages computed by both oracles for a few logistic-factor inputs
    kjit serve    the HTTP message-operator service (trains the default operators on first start)

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


def _serve(args) -> int:
    # the service imports kjit, never the reverse: only this command reaches up into it, lazily
    from service.server import serve
    from service.settings import Settings

    overrides = {"host": args.host, "port": args.port, "store": args.store, "log_level": args.log_level,
                 "default_n_train": args.n_train}
    if args.no_defaults:
        overrides["default_operators"] = ()
    settings = Settings.from_env(**overrides)
    return serve(settings, train_defaults=bool(settings.default_operators))


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
    s = sub.add_parser(
        "serve", help="run the HTTP message-operator service (docs at /docs)",
        description="Run the message-operator service.  On first start the default operators (logistic to x and "
                    "to z, compound gamma to tau) are trained from the quadrature oracle and cached in the store; "
                    "later starts load them.  Options default to the KJIT_* environment variables "
                    "(see service/settings.py); the bearer token is read from KJIT_TOKEN only.")
    s.add_argument("--host", default=None, help="address to bind (KJIT_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="port, 0 for any free one (KJIT_PORT, default 8000)")
    s.add_argument("--store", default=None, help="store directory (KJIT_STORE, default ~/.local/share/kjit/store)")
    s.add_argument("--n-train", type=int, default=None,
                   help="training pairs per default operator on first start (KJIT_DEFAULT_N_TRAIN, default 2000)")
    s.add_argument("--no-defaults", action="store_true", help="serve the store as it is; train nothing")
    s.add_argument("--log-level", default=None, help="uvicorn log level (KJIT_LOG_LEVEL, default info)")
    s.set_defaults(func=_serve)
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
