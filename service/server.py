"""``kjit serve``: train missing default operators (first start), then run the service.

First start: each default operator named in ``Settings.default_operators`` (by default each
registered factor's ``served`` recipients, :func:`service.training.served_defaults`) that is not in
the store is trained from the quadrature oracle on pairs drawn from its documented incoming
distribution (:mod:`service.training`; ``default_n_train`` pairs, D_in = ``default_n_inner``,
D_out = ``default_n_outer``), with a progress bar, and written to the store together with its
training set (``<store>/training-sets/<name>.npz``).  Later starts find them in the store and
load them in well under a second.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time
from dataclasses import fields

from .names import NAME_RE
from .settings import Settings
from .shared import SharedLogError, open_shared
from .store import Conflict, OperatorStore
from .training import TrainSpec, default_specs, served_defaults, train_operator

__all__ = ["ensure_defaults", "serve", "main", "uvicorn_config"]


#: how long a first start waits for an unreachable shared store before giving up (seconds)
SHARED_STORE_WAIT = 60.0


def _published(shared, out) -> set[str]:
    """The operators another replica published — waiting up to :data:`SHARED_STORE_WAIT` s for a shared
    store not reachable yet (a deployment whose Redis starts after its replicas); only asked when a
    default operator is missing here (a replica that has its operators starts without the shared
    store, and catches up when it is back)."""
    t_end = time.monotonic() + SHARED_STORE_WAIT
    while True:
        try:
            return set(shared.names())
        except SharedLogError as exc:
            if time.monotonic() > t_end:
                raise SharedLogError(f"{exc} (waited {SHARED_STORE_WAIT:g} s: a replica's first start needs it to "
                                     f"know which default operators another replica published)") from exc
            print(f"kjit: waiting for the shared store ({exc})", file=out, flush=True)
            time.sleep(2.0)


def ensure_defaults(settings: Settings, out=sys.stderr, progress: bool = True) -> list[str]:
    """Train the default operators missing from the store; returns the names trained."""
    settings.import_factors()
    specs = default_specs()
    names = list(served_defaults() if settings.default_operators is None else settings.default_operators)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"unknown default operator(s) {', '.join(unknown)}; known: {', '.join(specs)}")
    # (checked before anything is trained: a plugin factor named "MyShift" serving x trained MyShift-x, then the
    # store refused the name and the server exited — every start, the built-in defaults never trained; audit)
    bad = [n for n in names if not NAME_RE.match(n)]
    if bad:
        factor, to = specs[bad[0]]
        raise ValueError(f"default operator {bad[0]!r} (factor {factor!r}, its served recipient {to!r}) is not a valid "
                         f"operator name (lower-case letters, digits, '_', '.' and '-', at most 64 characters, "
                         f"{NAME_RE.pattern}): register the factor under a lower-case name")
    shared = open_shared(settings.shared_store) if settings.shared_store else None
    store = OperatorStore(settings.store, snapshot_every=settings.snapshot_every, shared=shared, merge_interval=0)
    store.open()
    trained = []
    try:
        # a replica adopts what another replica already published instead of training it again
        local = [n for n in names if not store.exists(n)]
        published = _published(shared, out) if shared is not None and local else set()
        missing = [n for n in local if n not in published]
        if not missing:
            return []
        print(f"kjit: first start — training {len(missing)} default operator(s) from the quadrature oracle "
              f"into {settings.store} ({settings.default_n_train} pairs each, D_in={settings.default_n_inner}, "
              f"D_out={settings.default_n_outer}); later starts load them from the store.", file=out, flush=True)
        for name in missing:
            factor, to = specs[name]
            spec = TrainSpec(factor=factor, to=to, n=settings.default_n_train, n_inner=settings.default_n_inner,
                             n_outer=settings.default_n_outer, random_state=settings.seed, n_jobs=-1)
            t0 = time.perf_counter()
            bar = _Bar(name, out) if progress else None
            jit, ts, info = train_operator(spec, progress=bar)
            if bar:
                bar.close()
            ts.save(settings.training_dir / f"{name}.npz")
            try:
                store.create(name, jit, {"training": info, "source": spec.describe(),
                                         "threshold": info["threshold"], "default": True})
            except Conflict:  # another replica published it first: this one adopts that one
                print(f"kjit: {name} was published by another replica meanwhile; using that one", file=out, flush=True)
                continue
            print(f"kjit: {name} trained in {time.perf_counter() - t0:.0f}s: {info['n_train']} pairs, threshold "
                  f"{info['threshold']:.3g} ({info['threshold_source']}), held-out mean KL "
                  f"{info.get('held_out_mean_kl', float('nan')):.2g}", file=out, flush=True)
            trained.append(name)
    finally:
        store.close()
    return trained


class _Bar:
    """tqdm bar over the oracle pairs of one operator, then a 'fitting' stage."""

    def __init__(self, name, out):
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self.name, self.out = name, out
        self.bar = None
        self.stage = None

    def __call__(self, stage, done, total):
        if stage != self.stage:
            if self.bar is not None:
                self.bar.close()
            desc = {"oracle": "oracle pairs", "held_out": "held-out pairs", "fit": "fitting"}.get(stage, stage)
            unit = "pair" if stage in ("oracle", "held_out") else "step"
            self.bar = self._tqdm(total=total, desc=f"{self.name}: {desc}", unit=unit, file=self.out, leave=True)
            self.stage = stage
        self.bar.n = done
        self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def uvicorn_config(app, settings: Settings, **kw):
    """The uvicorn configuration the service runs on (``kjit serve`` and :class:`service.testing.ThreadedServer`):
    a response's head and body in one write, the request-head limit and the head and body timeouts, on the
    service's protocol (service/protocol.py).

    No ``limit_concurrency``: uvicorn counts every open connection against it, idle ones included, so
    a flood of connections would turn every client's request into a 503 — what the flood does anyway.
    The timeouts close the connections that do not send a request in time; :func:`raise_open_files_limit`
    gives the process room for the rest."""
    import uvicorn

    from .protocol import OneWriteHttpToolsProtocol

    http = OneWriteHttpToolsProtocol.with_limits(
        max_head_bytes=int(settings.max_head_bytes), head_timeout=float(settings.head_timeout),
        body_timeout=float(settings.body_timeout), min_body_rate=float(settings.min_body_rate))
    return uvicorn.Config(app, http=http, **kw)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft limit on open files (``RLIMIT_NOFILE``) to the hard limit; returns (before, after).

    Every connection is a file descriptor: systemd's default soft limit of 1024 let 1 100 idle
    connections lock every client out (found by an audit), while its hard limit (524288) is there to be
    used — as the Go runtime does at start.  The event loop polls with epoll, so descriptors beyond 1024
    are fine.  Capped at 2**20; a limit that cannot be raised is left as it is."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # pragma: no cover - e.g. a sandbox that refuses
            return (soft, soft)
        return (soft, want)
    return (soft, soft)


def check_listen(host: str, port: int) -> None:
    """An OSError naming the address unless the server could listen on ``host``:``port`` now — an unknown
    host or a port in use is the command's one-line error before any work (found by an audit: uvicorn's own
    log line and exit status 3, after the first start's training).  (Another process may still take the
    port before uvicorn binds it; uvicorn then says so as before.)"""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
        try:
            sock.bind(address)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def serve(settings: Settings, train_defaults: bool = True, out=sys.stdout) -> int:
    """Train missing defaults (if asked), then run uvicorn until interrupted."""
    import uvicorn

    from .app import create_app

    check_listen(settings.host, settings.port)  # (before the defaults' training, not after it)
    if train_defaults and settings.default_operators != ():
        ensure_defaults(settings)
    else:  # the store opened (and closed) here, as ensure_defaults does: a file, an unwritable directory or a
        # store in use is the command's one-line error, not a traceback from the app's startup (found by an audit)
        store = OperatorStore(settings.store, merge_interval=0)
        store.open()
        store.close()
    raise_open_files_limit()  # (room for connections: see its docstring)
    app = create_app(settings)
    # a response's head and body in one write (service/protocol.py: one wake-up of the client, not two)
    config = uvicorn_config(app, settings, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)

    def announce():
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.02)
        host, port = settings.host, settings.port
        try:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
        except Exception:  # pragma: no cover
            pass
        shown = f"[{host}]" if ":" in str(host) else host
        url = f"http://{shown}:{port}"
        print(f"kjit service listening on {url} — API docs: {url}/docs — store: {settings.store}", file=out, flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        pass
    return 0


def build_parser(prog: str = "kjit serve") -> argparse.ArgumentParser:
    """The options of ``kjit serve`` / ``python -m service`` (they default to the ``KJIT_*`` variables;
    the defaults shown are read from :class:`Settings` and the factor registry, not repeated here)."""
    default = {f.name: f.default for f in fields(Settings)}
    served = ", ".join(served_defaults()) or "none"
    s = argparse.ArgumentParser(
        prog=prog,
        description=f"Run the message-operator service.  On first start the default operators (each registered "
                    f"factor's served recipients: {served}; KJIT_DEFAULT_OPERATORS names others) are trained "
                    f"from the quadrature oracle ({default['default_n_train']} pairs each, D_in "
                    f"{default['default_n_inner']}, D_out {default['default_n_outer']}) and cached in the store; "
                    f"later starts load them.  Options default to the KJIT_* environment variables (see "
                    f"service/settings.py); the bearer token is read from KJIT_TOKEN only.")
    s.add_argument("--host", default=None, help=f"address to bind (KJIT_HOST, default {default['host']})")
    s.add_argument("--port", type=int, default=None,
                   help=f"port, 0 for any free one (KJIT_PORT, default {default['port']})")
    s.add_argument("--store", default=None, help="store directory (KJIT_STORE, default ~/.local/share/kjit/store)")
    s.add_argument("--n-train", type=int, default=None,
                   help=f"training pairs per default operator on first start (KJIT_DEFAULT_N_TRAIN, default "
                        f"{default['default_n_train']})")
    s.add_argument("--no-defaults", action="store_true", help="serve the store as it is; train nothing")
    s.add_argument("--factors", default=None, metavar="MODULE[,MODULE]",
                   help="modules that define factors (imported at start: their factors can be trained, "
                        "persisted, reloaded and served; KJIT_FACTORS). Installed packages' kjit.factors "
                        "entry points are found without this")
    s.add_argument("--shared-store", default=None,
                   help="run as a replica: the update log shared with the other replicas — a directory or "
                        "redis://host:port/db (KJIT_SHARED_STORE; see service/shared.py)")
    s.add_argument("--log-level", default=None,
                   help=f"uvicorn log level (KJIT_LOG_LEVEL, default {default['log_level']})")
    return s


def main(argv=None, prog: str = "kjit serve") -> int:
    """``kjit serve [options]`` and ``python -m service [options]``: parse, then :func:`serve`.

    ``kjit serve`` reaches this through the ``kjit.commands`` entry point, so kjit never imports
    the service and the service's options live here, beside the code that reads them.
    """
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    overrides = {"host": args.host, "port": args.port, "store": args.store, "log_level": args.log_level,
                 "default_n_train": args.n_train, "shared_store": args.shared_store, "factors": args.factors}
    if args.no_defaults:
        overrides["default_operators"] = ()
    try:
        settings = Settings.from_env(**overrides)
        return serve(settings, train_defaults=settings.default_operators != ())
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError:  # (found by an audit: a traceback for sizes such as --n 1e11)
        print(f"{prog}: error: not enough memory for the sizes asked for (smaller "
              f"KJIT_DEFAULT_N_TRAIN / KJIT_DEFAULT_N_INNER / KJIT_DEFAULT_N_OUTER)", file=sys.stderr)
        return 2


logging.getLogger("kjit.service").setLevel(logging.INFO)
