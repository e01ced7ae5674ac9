"""The ``kjit`` command line.

    kjit serve    the HTTP message-operator service (trains the default operators on first start)
    kjit demo     EP logistic regression on a real data set: hand-crafted vs learned JIT operator
    kjit train    train an operator for a factor direction and save it to a file
    kjit oracles  messages computed by both oracles for a few logistic-factor inputs
    kjit bench    run the benchmarks (JSON lines)
    kjit audit    a served operator's accuracy audit (KL statistics, histogram of log KL)

Errors are reported as one line on stderr with exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np


def _check_options(args, **rules) -> None:
    """Each option ``--name`` (attribute ``name``) in ``rules`` — ``(low, integer)``, ``low`` exclusive for a real —
    checked before any work, named by its flag (found by an audit: sizes and targets were refused after the whole
    oracle run and fit, under internal names such as `n_first must lie in (0, 500)`)."""
    from .errors import check_number

    for attr, (low, integer) in rules.items():
        check_number("--" + attr.replace("_", "-"), getattr(args, attr), low, integer=integer, low_open=not integer)


def _oracles(args) -> int:
    _check_options(args, seed=(0, True), particles=(2, True))  # (the sampler's least: 2)
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


def format_audit(detail: dict, width: int = 40) -> str:
    """The audit summary of ``GET /v1/operators/{name}`` as text, with a histogram of log10 KL."""
    a = detail.get("audit") or {}
    name = detail.get("name", "?")

    def num(x, fmt=".3g"):
        return "-" if x is None else format(x, fmt)

    lines = [f"operator {name}: {detail.get('factor')} -> {detail.get('to')}, version {detail.get('version')}, "
             f"threshold {num(detail.get('threshold'), '.4g')}",
             f"audit: {'on' if a.get('enabled') else 'off (KJIT_AUDIT_RATE = 0 on this server)'}; "
             f"{a.get('count', 0)} answers audited ({a.get('confident', 0)} confident), "
             f"{a.get('audited_pairs', 0)} audited pairs learned",
             f"KL[oracle || served]: mean {num(a.get('mean_kl'))}, p95 {num(a.get('p95_kl'))} (last "
             f"{len((a.get('recent') or {}).get('kl', []))}), max {num(a.get('max_kl'))}; above the target "
             f"{num(a.get('kl_target'))}: {num(None if a.get('share_above_target') is None else 100 * a['share_above_target'], '.1f')} %"]
    if detail.get("threshold_note"):
        lines.append(f"threshold: {detail['threshold_note']}")
    for ch in a.get("threshold_changes", [])[:-1][-4:]:
        lines.append(f"  earlier change at version {ch.get('version')}: {num(ch.get('from'), '.4g')} -> "
                     f"{num(ch.get('to'), '.4g')}")
    hist = a.get("histogram_log10_kl") or {}
    counts, edges = hist.get("counts") or [], hist.get("edges") or []
    nz = [i for i, c in enumerate(counts) if c]
    if nz:
        lines.append("log10 KL of the recent audits:")
        top = max(counts)
        for i in range(nz[0], nz[-1] + 1):
            lo = "<=" if i == 0 else f"{edges[i]:5.1f}"
            hi = ">" if i == len(counts) - 1 else f"{edges[i + 1]:5.1f}"
            bar = "#" * max(1 if counts[i] else 0, round(width * counts[i] / top))
            lines.append(f"  [{lo:>5}, {hi:>5}) {bar:<{width}} {counts[i]}")
    elif a.get("enabled"):
        lines.append("no audits yet")
    return "\n".join(lines)


def _audit(args) -> int:
    import json
    import os

    from .client import RemoteOperator

    url = args.url or os.environ.get("KJIT_URL") or "http://127.0.0.1:8000"
    _check_options(args, timeout=(0.0, False))
    if not url.startswith(("http://", "https://")):  # (named by its flag: it was the client's `url`)
        raise ValueError(f"{'--url' if args.url else 'KJIT_URL'} {url!r}: give the server as http://HOST:PORT")
    with RemoteOperator(url, args.name, timeout=args.timeout, retries=1) as op:
        detail = op.info()
    if args.json:
        print(json.dumps({"name": detail.get("name"), "threshold": detail.get("threshold"),
                          "version": detail.get("version"), "audit": detail.get("audit")}))
    else:
        print(format_audit(detail))
    return 0


SERVE_ENTRY_POINT = ("kjit.commands", "serve")


def _serve(args) -> int:
    """Hand ``kjit serve ARGS`` to the service's entry point (``kjit.commands:serve``).

    The service imports kjit, never the reverse: kjit finds it by the entry point its package
    declares (pyproject.toml), not by an import, and the service parses its own options.
    """
    from importlib import import_module
    from importlib.metadata import entry_points

    group, name = SERVE_ENTRY_POINT
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if found:
        target = found[0].load()
    else:  # an install whose metadata predates the entry point (an old editable install)
        try:
            target = import_module("service.server").main
        except ImportError as exc:
            raise RuntimeError(f"the kjit service is not installed ({exc}); install kjit with its service") from None
    return target(list(args.args), prog="kjit serve")


def _demo(args) -> int:
    import time

    from .datasets import PAPER_TRAIN_SIZES, paper_split
    from .ep.models import BayesianLogisticRegression
    from .factors import Logistic
    from .operators import JITOperator, KernelOperator, calibrate_threshold, calibration_support
    from .oracles import QuadratureOracle
    from .factors import logistic_incoming
    from .training import make_training_set

    _check_options(args, n_train=(2, True), d_in=(1, True), d_out=(1, True), target_kl=(0.0, False),
                   max_iter=(1, True), show=(0, True), seed=(0, True))
    split = paper_split(args.dataset, random_state=args.seed, add_bias=True)
    factor = Logistic()
    quad = QuadratureOracle(factor)
    print(f"Bayesian logistic regression by EP on {args.dataset}: {len(split.y_train)} training points "
          f"(paper split), {len(split.y_test)} test points, {split.X_train.shape[1]} weights (incl. bias)\n")
    print(f"training a logistic->x operator on {args.n_train} quadrature pairs "
          f"(D_in={args.d_in}, D_out={args.d_out}) ...", flush=True)
    t = time.perf_counter()
    ts = make_training_set(factor, "x", logistic_incoming, quad, n=args.n_train + 500, random_state=args.seed,
                           progress=not args.quiet)
    train, held_out = ts.split(args.n_train, random_state=args.seed)
    op = KernelOperator(factor, "x", n_inner=args.d_in, n_outer=args.d_out, random_state=args.seed,
                        dtype="float32").fit(train)
    support = calibration_support(np.count_nonzero(~op.gated_rows(held_out.incoming)))
    threshold = calibrate_threshold(op, held_out, args.target_kl, min_support=support)
    if not np.isfinite(threshold):
        threshold = -8.95  # the paper's UCI threshold when the target is unreachable
    jit = JITOperator(op, QuadratureOracle(factor), threshold=threshold)
    print(f"  done in {time.perf_counter() - t:.1f} s; JIT threshold {threshold:.2f} "
          f"(calibrated to mean KL <= {args.target_kl:g} on 500 held-out pairs)\n")
    rows = []
    for name, operator in (("quadrature (hand-crafted)", quad), ("learned JIT operator", jit)):
        t = time.perf_counter()
        model = BayesianLogisticRegression(operator, max_iter=args.max_iter, tol=1e-4).fit(split.X_train, split.y_train)
        rows.append((name, model, time.perf_counter() - t, model.test_error(split.X_test, split.y_test)))
    names = [f"w{i}" for i in range(split.X_train.shape[1] - 1)] + ["bias"]
    print(f"{'operator':<28}{'test error':>11}{'EP iters':>10}{'seconds':>9}   converged")
    for name, model, sec, err in rows:
        print(f"{name:<28}{err:>11.4f}{model.n_iter_:>10d}{sec:>9.2f}   {model.converged_}")
    c = jit.counters()
    print(f"\nJIT operator: {c['requests']} messages, {c['consultations']} sent to the oracle "
          f"({100 * c['consultation_rate']:.1f} %)\n")
    (_, m_q, _, _), (_, m_j, _, _) = rows
    sd_q = np.sqrt(np.diag(m_q.posterior_.cov))
    print(f"{'weight':<8}{'mean (quadrature)':>20}{'sd':>10}{'mean (learned)':>18}{'sd':>10}")
    for i, n in enumerate(names[: args.show]):
        print(f"{n:<8}{m_q.posterior_.mean[i]:>20.4f}{sd_q[i]:>10.4f}"
              f"{m_j.posterior_.mean[i]:>18.4f}{np.sqrt(m_j.posterior_.cov[i, i]):>10.4f}")
    if len(names) > args.show:
        print(f"... ({len(names) - args.show} more)")
    return 0


def _dask_backend(address):
    """joblib's Dask backend on the cluster at ``address`` for the duration of a ``with``; a no-op without one."""
    import contextlib

    if not address:
        return contextlib.nullcontext()
    try:
        import joblib
        from distributed import Client
    except ImportError as exc:
        raise RuntimeError("--scheduler needs Dask: pip install 'kjit[dask]'") from exc

    @contextlib.contextmanager
    def ctx():
        try:
            client = Client(address, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise OSError(f"cannot reach the Dask scheduler at {address}: {exc}") from exc
        with client, joblib.parallel_config(backend="dask"):
            yield client

    return ctx()


def _train(args) -> int:
    import time

    from .factors import get_factor, import_factor_modules
    from .operators import (KernelOperator, calibrate_threshold, calibration_support, capped_reference_gate,
                            guarded_jit)
    from .oracles import make_oracle, resolve_oracle_kind
    from .persistence import save_operator
    from .training import HELD_OUT_STREAM, TrainingSet, make_training_set

    _check_options(args, d_in=(1, True), d_out=(1, True), target_kl=(0.0, False), seed=(0, True),
                   **({} if args.pairs else {"n": (2, True)}))
    if args.jobs == 0:  # (joblib's words were "n_jobs == 0 in Parallel has no meaning")
        raise ValueError("--jobs 0: give a number of jobs >= 1, or -1 for one per core")
    if not -MAX_JOBS <= args.jobs <= MAX_JOBS:  # (joblib's words: "Numeric literal 2000000 is too large")
        raise ValueError(f"--jobs {args.jobs}: at most {MAX_JOBS} (or -1 for one per core)")
    if args.factors:  # your own factors' modules (they register them), as `kjit serve --factors`
        import_factor_modules(args.factors)
    try:
        factor = get_factor(args.factor)
    except TypeError as exc:  # a factor that needs parameters (`declared`): a message, not a traceback
        raise ValueError(f"factor {args.factor!r} cannot be built without parameters: {exc}") from None
    factor.check_to(args.to)
    if not args.pairs and args.to in factor.default_untrainable:  # (as the service refuses it: named, at once)
        raise ValueError(f"--to {args.to}: no operator for {factor.name!r} -> {args.to!r} can be trained from its "
                         f"default messages: {factor.default_untrainable[args.to]}; give --pairs FILE")
    # the oracle's sizes by their flags (its own checks named n_samples / n_initial / target_se — an audit): the
    # shared-proposal sampler draws --particles a call (at least 2), the per-message one starts from
    # min(2 000, --particles) (at least 10)
    kind = resolve_oracle_kind(ORACLE_ALIASES.get(args.oracle, args.oracle), factor, args.to)
    _check_options(args, target_se=(0.0, False),
                   particles={"importance_sampling": (2, True), "message_sampler": (10, True)}.get(kind, (1, True)))
    # (before any work: a quadrature oracle for a recipient without an exact rule is refused here)
    oracle = make_oracle(kind, factor, args.to, n_samples=args.particles, target_se=args.target_se,
                         random_state=args.seed)
    paths = {flag: Path(path).expanduser().resolve() for flag, path in
             (("--out", args.out), ("--save-pairs", args.save_pairs), ("--pairs", args.pairs)) if path}
    named = list(paths.items())
    for i, (flag, path) in enumerate(named):
        for other, path2 in named[i + 1:]:
            if path == path2:  # (an audit: --out X --save-pairs X wrote the pairs, then the operator over them, exit 0)
                raise ValueError(f"{flag} and {other} name the same file {path}: give each its own")
    for flag, path in (("--out", args.out), ("--save-pairs", args.save_pairs)):
        # before the training run, not after it (found by an audit: an error naming a temporary file)
        if path is not None and (not path.strip() or path.endswith(("/", os.sep)) or Path(path).expanduser().is_dir()):
            raise ValueError(f"{flag} {path!r}: give a file name (not a directory)")
        parent = Path(path).expanduser().resolve().parent if path else None
        if parent is not None and not parent.is_dir():
            raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
        if parent is not None and not os.access(parent, os.W_OK):
            raise ValueError(f"{flag} {path}: the directory {parent} is not writable")
    n_held = max(200, args.n // 4) if args.jit else 0
    t = time.perf_counter()
    held = None
    if args.pairs:
        ts = TrainingSet.load(args.pairs)
        if (ts.factor, ts.to) != (factor.name, args.to):
            raise ValueError(f"--pairs holds {ts.factor}->{ts.to} pairs, not {factor.name}->{args.to}")
        if args.jit:  # held out from the file's pairs (not from --n, which sizes a run of the oracle)
            n_held = min(max(200, len(ts) // 4), len(ts) // 2)
            if n_held < 1 or len(ts) - n_held < 2:
                raise ValueError(f"--pairs holds {len(ts)} pairs: too few to fit and hold out pairs for --jit")
    else:
        if factor.default_incoming is None:
            raise ValueError(f"no default input distribution for factor {factor.name!r}: give --pairs FILE (a "
                             "TrainingSet saved with TrainingSet.save, e.g. make_training_set(factor, to, sampler, "
                             "oracle, n) with your own sampler of incoming messages), or give the factor a "
                             "default_incoming(n, rng) -> {variable: message batch} in its module (an attribute, "
                             "as the built-in factors have)")
        with _dask_backend(args.scheduler):
            ts = make_training_set(factor, args.to, factor.default_incoming, oracle, n=args.n,
                                   n_jobs=args.jobs, random_state=args.seed, progress=not args.quiet)
            # held out: messages and oracle draws of their own streams (HELD_OUT_STREAM), as the service's
            held = make_training_set(factor, args.to, factor.default_incoming, oracle, n=n_held, n_jobs=args.jobs,
                                     random_state=[args.seed, HELD_OUT_STREAM], progress=not args.quiet) \
                if n_held else None
    if n_held and args.pairs:
        ts, held = ts.split(len(ts) - n_held, random_state=args.seed)
    if not args.pairs and len(ts) < 2:  # the oracle dropped pairs it could not answer (low ESS; --n >= 2 is checked)
        raise ValueError(f"the oracle answered {len(ts)} of the {args.n} pairs asked for (the others' effective "
                         f"sample size was too low): too few to fit; use more --particles or a larger --n")
    if args.save_pairs:
        ts.save(args.save_pairs)
    print(f"{len(ts)} training pairs ({time.perf_counter() - t:.1f} s); fitting D_in={args.d_in}, D_out={args.d_out} ...",
          flush=True)
    op = KernelOperator(factor, args.to, n_inner=args.d_in, n_outer=args.d_out, treatment=args.treatment,
                        reference_gate=capped_reference_gate(factor, args.target_kl) if args.jit else "auto",
                        random_state=args.seed, dtype=args.dtype).fit(ts)
    hp = op.hyperparameters()
    print(f"fitted in {op.fit_seconds_:.1f} s: inner width factor {hp['inner_factor']:g}, outer {hp['width_factor']:g}, "
          f"prior var {hp['prior_var']:g}, noise var {hp['noise_var']:g}")
    out = op
    if args.jit:
        support = calibration_support(np.count_nonzero(~op.gated_rows(held.incoming)))
        threshold = calibrate_threshold(op, held, args.target_kl, min_support=support)
        kl = held.beliefs.kl(op.belief(held.incoming))
        # (the pairs the oracle could not answer: counted where this run drew them; a file's split carries the
        # whole file's count — found in review)
        failed = int(held.meta.get("n_failed", 0)) if held.meta and not args.pairs else 0
        unanswered = f" ({failed} more the oracle could not answer)" if failed else ""
        print(f"held-out mean KL {kl.mean():.3g} (median {np.median(kl):.3g}) on {len(held)} pairs{unanswered}; "
              f"JIT threshold {threshold:.3f}")
        if not np.isfinite(threshold):
            raise ValueError(f"no threshold meets --target-kl {args.target_kl:g} on at least {support} held-out "
                             "pairs; train on more pairs or relax it")
        # with a density guard and an input margin, as the service's: a message outside the training data is
        # consulted whatever its variance (the regression's variance does not see it; unless the factor's checked
        # reference answers it outright, REFERENCE_MARGIN), and not learned; and a row
        # whose own variances imply an expected KL above the target, whatever the threshold admits
        out = guarded_jit(op, oracle, threshold, ts, held, kl_cap=args.target_kl)  # (a row's own expected KL)
        share = float(np.mean(np.asarray(out.screen(held.incoming)[2], bool)))
        print(f"mode=jit consults {share:.1%} of the held-out messages (threshold, sign test, guards, KL cap)")
    save_operator(out, args.out)
    print(f"saved {type(out).__name__} to {args.out}")
    return 0


def _bench(args) -> int:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    if not root.is_dir():
        raise OSError("the benchmarks are scripts in the source checkout (benchmarks/); run from a clone")
    available = sorted(p.stem for p in root.glob("*.py") if not p.stem.startswith(("_", "jit_common")))
    names = args.names or available
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}")
    for name in names:
        cmd = [sys.executable, str(root / f"{name}.py")] + (["--quick"] if args.quick else [])
        print(f"# {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            raise RuntimeError(f"benchmark {name} exited with status {rc}")
    return 0


_REGISTERED_FACTORS_HELP = "registered factor, or your own (--factors)"

#: ``kjit train --oracle`` names beside :data:`kjit.oracles.ORACLE_KINDS` (which the choices are read
#: from, so a new kind is offered here as in the service), and the kind each stands for
ORACLE_ALIASES = {"sampling": "importance_sampling"}
#: the most parallel oracle jobs `kjit train --jobs` takes
MAX_JOBS = 1024


class _RegistryHelpFormatter(argparse.HelpFormatter):
    """``kjit train --help``: the factor argument's help names the registered factors, read from
    the registry (``kjit.factors.registered_factors()``, entry points included) only when the help is
    shown — not on every command."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if text == _REGISTERED_FACTORS_HELP:
            from .factors import get_factor, registered_factors

            names = []
            for name in registered_factors():
                try:
                    get_factor(name)
                except Exception:  # noqa: BLE001 - one that needs parameters (`declared`) cannot be trained here
                    continue
                names.append(name)
            text = f"registered factor: {', '.join(names)}; or your own (--factors)".replace("%", "%%")
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kjit",
        description="kjit: learned expectation-propagation message operators with just-in-time oracle fallback.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "demo", help="EP logistic regression on a real data set: hand-crafted vs learned JIT operator",
        description="Trains a small logistic-factor operator from quadrature pairs, then runs EP on a UCI data set "
                    "(the KJIT paper's split) with the quadrature operator and with the learned just-in-time "
                    "operator, and prints test errors, EP iterations, oracle consultations and the posterior.")
    d.add_argument("--dataset", default="banknote",
                   help="banknote, blood_transfusion, fertility, ionosphere, heart, pima, haberman, spam")
    d.add_argument("--n-train", type=int, default=1500, help="training pairs for the operator (default 1500)")
    d.add_argument("--d-in", type=int, default=125)
    d.add_argument("--d-out", type=int, default=250)
    d.add_argument("--target-kl", type=float, default=1e-4, help="mean KL the JIT threshold is calibrated to")
    d.add_argument("--max-iter", type=int, default=50)
    d.add_argument("--show", type=int, default=8, help="posterior weights to print")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=_demo)
    t = sub.add_parser(
        "train", help="train an operator for a factor direction and save it (.npz)",
        formatter_class=_RegistryHelpFormatter,
        description="Draws incoming messages from the factor's default distribution (or loads recorded pairs), "
                    "asks the oracle for the projected beliefs, fits a KernelOperator (hyperparameters by "
                    "evidence) and saves it; with --jit, wraps it in a JITOperator whose threshold is "
                    "calibrated on held-out pairs.  Example: kjit train logistic --to x --n 2000 --out op.npz")
    t.add_argument("factor", help=_REGISTERED_FACTORS_HELP)
    t.add_argument("--to", required=True, help="recipient variable (logistic: x or z; compound_gamma: tau)")
    t.add_argument("--out", required=True, help="operator file to write")
    t.add_argument("--factors", default=None, metavar="MODULE[,MODULE]",
                   help="modules that define (register) your own factors, imported first (as kjit serve "
                        "--factors / KJIT_FACTORS); installed packages' kjit.factors entry points are found "
                        "without this")
    t.add_argument("--n", type=int, default=2000, help="training pairs (default 2000)")
    t.add_argument("--pairs", help="train on a saved TrainingSet .npz instead of drawing inputs")
    t.add_argument("--save-pairs", help="also save the training pairs to this .npz")
    from .oracle_kinds import ORACLE_KINDS  # (not kjit.oracles: scipy for every command)

    t.add_argument("--oracle", choices=[*ORACLE_KINDS, *ORACLE_ALIASES], default="auto",
                   help="auto (default): the factor's exact rule for the recipient (quadrature) where it has one, "
                        "else message_sampler (importance sampling per message: inputs from their incoming "
                        "messages, outputs from the factor's sampler, weighted by the output's message, particles "
                        "added until --target-se); sampling (= importance_sampling): the paper's one shared "
                        "proposal, --particles per call")
    t.add_argument("--particles", type=int, default=500_000,
                   help="importance-sampling particles (message_sampler: the most spent on one message)")
    t.add_argument("--target-se", type=float, default=1e-2,
                   help="message_sampler: Monte Carlo standard error to reach per coordinate (default 0.01)")
    t.add_argument("--d-in", type=int, default=125)
    t.add_argument("--d-out", type=int, default=250)
    t.add_argument("--treatment", choices=["unconstrained", "gaussian", "exact"], default="unconstrained")
    t.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    t.add_argument("--jit", action="store_true", help="save a JITOperator with a calibrated threshold")
    t.add_argument("--target-kl", type=float, default=1e-3,
                   help="with --jit: mean KL of confident predictions, and the cap of each one's expected KL")
    t.add_argument("--jobs", type=int, default=1, help="parallel oracle jobs (joblib)")
    t.add_argument("--scheduler", metavar="tcp://HOST:PORT",
                   help="generate the oracle pairs on this Dask cluster (joblib's dask backend; needs kjit[dask] "
                        "on the client and the workers; --jobs is then ignored: every worker thread is used)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)
    o = sub.add_parser("oracles", help="print logistic-factor messages from the quadrature and sampling oracles")
    o.add_argument("--particles", type=int, default=500_000, help="importance-sampling particles (default 500000)")
    o.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    o.set_defaults(func=_oracles)
    b = sub.add_parser("bench", help="run the benchmarks in benchmarks/ (JSON lines on stdout)")
    b.add_argument("names", nargs="*", help="benchmarks to run (default: all), e.g. oracles operator_accuracy")
    b.add_argument("--quick", action="store_true", help="the quick version of each")
    b.set_defaults(func=_bench)
    a = sub.add_parser(
        "audit", help="a served operator's accuracy audit: KL statistics and a histogram of log KL",
        description="Reads GET /v1/operators/NAME of a running server and prints its audit (KJIT_AUDIT_RATE): "
                    "answers audited, KL[oracle || served] mean / p95 / max, the share above the KL target, "
                    "threshold changes, and a text histogram of log10 KL over the recent audits.")
    a.add_argument("name", help="operator name, e.g. logistic-x")
    a.add_argument("--url", help="the server (default $KJIT_URL or http://127.0.0.1:8000)")
    a.add_argument("--json", action="store_true", help="print the audit as one JSON object")
    a.add_argument("--timeout", type=float, default=10.0)
    a.set_defaults(func=_audit)
    s = sub.add_parser(
        "serve", help="run the HTTP message-operator service (docs at /docs; kjit serve --help for options)",
        add_help=False, prefix_chars="\0")
    s.add_argument("args", nargs=argparse.REMAINDER, help="the service's options (kjit serve --help)")
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
    except MemoryError:  # (found by an audit: a traceback for sizes such as --n 1e11)
        print(f"kjit {args.command}: error: not enough memory for the sizes asked for (a smaller --n, --d-in, --d-out "
              f"or --particles)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
