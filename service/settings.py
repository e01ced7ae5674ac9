"""Service settings: one frozen dataclass, read from ``KJIT_*`` environment variables.

=========================  ==========================================  ===========================
variable                   meaning                                     default
=========================  ==========================================  ===========================
``KJIT_HOST``              address to bind                             ``127.0.0.1``
``KJIT_PORT``              port (0: any free port)                     ``8000``
``KJIT_STORE``             operator store directory                    ``$XDG_DATA_HOME/kjit/store``
                                                                       (``~/.local/share/kjit/store``)
``KJIT_TOKEN``             bearer token for mutating requests and      unset (no authentication)
                           ``mode=oracle``; unset or empty: none
``KJIT_MAX_BODY_BYTES``    largest request body accepted (413 above)   ``16777216`` (16 MiB)
``KJIT_MAX_HEAD_BYTES``    largest request line and headers accepted   ``65536`` (64 KiB)
                           (431 and close above; service/protocol.py)
``KJIT_HEAD_TIMEOUT``      seconds from a connection's start, or a     ``10``
                           request's first byte, to the end of its
                           headers (408 and close after)
``KJIT_BODY_TIMEOUT``      seconds a request body may take beyond one  ``30``
                           second per KJIT_MIN_BODY_RATE bytes
                           received (408 and close after)
``KJIT_MIN_BODY_RATE``     bytes per second a body must keep up on     ``16384`` (16 KiB/s: a 16 MiB
                           average beyond KJIT_BODY_TIMEOUT            body may take 17 minutes)
``KJIT_MAX_BATCH``         most messages in one request (422 above)    ``10000``
``KJIT_SNAPSHOT_EVERY``    update records per log before a snapshot    ``500``
``KJIT_DEFAULT_OPERATORS`` operators ``kjit serve`` trains when         unset or empty: every
                           missing (comma-separated; ``none``: no      registered factor's served
                           operator)                                   recipients (built-ins:
                                                                       ``compound_gamma-tau,exp-x,``
                                                                       ``logistic-x,logistic-z``)
``KJIT_FACTORS``            modules that define (register) factors,     unset (built-ins and the
                           imported at start (comma-separated)          ``kjit.factors`` entry points)
``KJIT_DEFAULT_N_TRAIN``   training pairs of a default operator        ``4000``
``KJIT_DEFAULT_N_INNER``   D_in of a default operator                  ``500``
``KJIT_DEFAULT_N_OUTER``   D_out of a default operator                 ``1000``
``KJIT_SEED``              seed of default training                    ``0``
``KJIT_N_JOBS``            joblib workers of oracle runs in jobs       ``1``
``KJIT_JOB_WORKERS``       training jobs run at once                   ``1``
``KJIT_BLAS_THREADS``      BLAS threads of the server process (0: the  ``1``
                           library's own default, one per core)
``KJIT_LOG_LEVEL``         uvicorn log level                           ``info``
``KJIT_SHARED_STORE``      run as a replica: the update log shared     unset (a standalone server)
                           with other replicas — a directory or
                           ``redis://host:port/db`` (service/shared.py)
``KJIT_MERGE_INTERVAL``    seconds between a replica's merges of the   ``1.0``
                           others' updates (0: only on request)
``KJIT_MAX_QUEUED_JOBS``   training jobs queued or running at once     ``4``
                           (429 with Retry-After beyond)
``KJIT_MAX_TRAIN_N``       largest ``n`` of a training job             ``20000``
``KJIT_MAX_N_INNER``       largest ``n_inner`` (D_in) of a job         ``1000``
``KJIT_MAX_N_OUTER``       largest ``n_outer`` (D_out) of a job        ``2000``
``KJIT_MAX_N_SAMPLES``     largest importance-sampling ``n_samples``   ``500000``
                           of a job (memory ~ 16 x n_samples x 8 B x
                           a few arrays: +166 MB measured at 500 000)
``KJIT_MAX_ORACLE_BATCH``  most rows of one ``mode=oracle`` or         ``2000``
                           ``mode=jit`` request (their oracle work)
``KJIT_ORACLE_CONCURRENCY`` oracle-mode requests and observation        ``1``
                           spot checks running at once
``KJIT_ORACLE_WAIT``       seconds a request waits for an oracle slot  ``10``
                           (429 with Retry-After after that)
``KJIT_OBSERVATION_MAX_Z`` observations: largest standardised           ``6``
                           regression coordinate accepted unchecked
``KJIT_OBSERVATION_MAX_KL`` observations beyond it: largest KL (nats)   ``0.5``
                           from the oracle's belief accepted
``KJIT_AUDIT_RATE``        share of learned answers re-checked against ``0`` (off)
                           the oracle in the background (service/audit.py)
``KJIT_AUDIT_CPU_SHARE``   most CPU the audit thread uses (of one core) ``0.1``
``KJIT_AUDIT_KL_TARGET``   KL (nats) the audited p95 of confident       ``0.01``
                           answers must stay under (else the threshold
                           is lowered)
``KJIT_AUDIT_MIN_AUDITS``  confident audits before a drift is decided  ``20``
``KJIT_AUDIT_QUEUE``       rows waiting for audit (more are dropped)    ``1000``
``KJIT_AUDIT_BATCH``       rows audited (and learned) per record        ``64``
=========================  ==========================================  ===========================

A training job's ``{"kind": "file"}`` source names a file relative to ``<store>/training-sets``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import math

__all__ = ["Settings", "DEFAULT_OPERATORS"]

DEFAULT_OPERATORS = None  # None: each registered factor's served recipients (service.training.served_defaults)


#: uvicorn's log levels
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _default_store() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kjit" / "store"


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    store: Path = field(default_factory=_default_store)
    token: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_head_bytes: int = 64 * 1024
    # a request must arrive in time (service/protocol.py; found by an audit: connections that sent nothing or
    # stalled were never closed, and 1 100 of them exhausted `ulimit -n 1024`).  A client's head comes in one
    # segment, in well under a second: 10 s leaves room for retransmissions on a lossy link.  A body may
    # stall 30 s and otherwise must keep up 16 KiB/s on average — loopback and LAN clients send the largest
    # body (16 MiB) in well under a second; at 16 KiB/s (128 kbit/s) it may take 17 minutes
    head_timeout: float = 10.0
    body_timeout: float = 30.0
    min_body_rate: int = 16 * 1024
    max_batch: int = 10_000
    snapshot_every: int = 500
    default_operators: tuple[str, ...] | None = DEFAULT_OPERATORS
    factors: tuple[str, ...] = ()
    # 4000 pairs at D 500/1000 (was 2000 at 300/500): EP through the served JIT operator then stays
    # within 0.02 posterior sd of quadrature-EP on banknote (0.14 before: the smaller operator's
    # noise floor, a relative 2e-3 per message, adds up over EP's messages) — benchmarks/ep_learned.py
    default_n_train: int = 4000
    default_n_inner: int = 500
    default_n_outer: int = 1000
    seed: int = 0
    n_jobs: int = 1
    job_workers: int = 1
    # one BLAS thread: a one-message prediction (D 500/1000) took 8.0 ms with OpenBLAS's default two threads
    # on a 2-core host with one core busy, 0.30 ms with one (a batch of 100: 6.9 vs 9.2 ms, of 10 000: ~0.54
    # vs 0.79 s) — EP sends one message per call; requests run side by side on the cores instead
    blas_threads: int = 1
    log_level: str = "info"
    shared_store: str | None = None
    merge_interval: float = 1.0
    max_queued_jobs: int = 4
    max_train_n: int = 20_000
    max_n_inner: int = 1000
    max_n_outer: int = 2000
    max_n_samples: int = 500_000
    max_oracle_batch: int = 2000
    oracle_concurrency: int = 1
    oracle_wait: float = 10.0
    observation_max_z: float = 6.0
    observation_max_kl: float = 0.5
    audit_rate: float = 0.0
    audit_cpu_share: float = 0.1
    audit_kl_target: float = 0.01
    audit_min_audits: int = 20
    audit_queue: int = 1000
    audit_batch: int = 64

    def __post_init__(self):
        if str(self.store).strip() == "":
            raise ValueError("setting `store` is empty: name the store directory (KJIT_STORE), or leave it unset for "
                             "the default")
        object.__setattr__(self, "store", Path(self.store).expanduser())
        if isinstance(self.factors, str):
            object.__setattr__(self, "factors", tuple(m.strip() for m in self.factors.split(",") if m.strip()))
        else:
            object.__setattr__(self, "factors", tuple(self.factors))
        if self.token is not None and self.token == "":
            object.__setattr__(self, "token", None)
        for name in ("max_body_bytes", "max_head_bytes", "min_body_rate", "max_batch", "snapshot_every", "default_n_train",
                     "default_n_inner", "default_n_outer", "job_workers", "max_queued_jobs", "max_train_n",
                     "max_n_inner", "max_n_outer", "max_n_samples", "max_oracle_batch", "oracle_concurrency"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"setting `{name}` must be >= 1, got {getattr(self, name)!r}")
        if int(self.default_n_train) < 4:  # (the training run's least; it was refused after the first-start banner)
            raise ValueError(f"setting `default_n_train` (--n-train, KJIT_DEFAULT_N_TRAIN) must be >= 4 training "
                             f"pairs, got {self.default_n_train!r}")
        if self.shared_store is not None and self.shared_store == "":
            object.__setattr__(self, "shared_store", None)
        for name in ("head_timeout", "body_timeout"):
            if not (float(getattr(self, name)) > 0 and math.isfinite(float(getattr(self, name)))):
                raise ValueError(f"setting `{name}` must be a finite number of seconds > 0, got {getattr(self, name)!r}")
        for name in ("oracle_wait", "observation_max_z", "observation_max_kl"):
            if not (float(getattr(self, name)) >= 0 and math.isfinite(float(getattr(self, name)))):
                raise ValueError(f"setting `{name}` must be a finite number >= 0, got {getattr(self, name)!r}")
        if not 0 <= float(self.audit_rate) <= 1:
            raise ValueError(f"setting `audit_rate` must lie in [0, 1], got {self.audit_rate!r}")
        if not 0 < float(self.audit_cpu_share) <= 1:
            raise ValueError(f"setting `audit_cpu_share` must lie in (0, 1], got {self.audit_cpu_share!r}")
        if not (float(self.audit_kl_target) > 0 and math.isfinite(float(self.audit_kl_target))):
            raise ValueError(f"setting `audit_kl_target` must be a finite number > 0, got {self.audit_kl_target!r}")
        for name in ("audit_min_audits", "audit_queue", "audit_batch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"setting `{name}` must be >= 1, got {getattr(self, name)!r}")
        if not (float(self.merge_interval) >= 0):
            raise ValueError(f"setting `merge_interval` must be >= 0 seconds, got {self.merge_interval!r}")
        if int(self.blas_threads) < 0:
            raise ValueError(f"setting `blas_threads` must be >= 0 (0: the BLAS library's default), got "
                             f"{self.blas_threads!r}")
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"setting `port` must lie in [0, 65535], got {self.port!r}")
        # (found by an audit: each of these was accepted, then failed late — after the default
        # operators were trained, or in every training job)
        if str(self.log_level).lower() not in _LOG_LEVELS:
            raise ValueError(f"setting `log_level` must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", str(self.log_level).lower())
        if int(self.n_jobs) == 0:
            raise ValueError("setting `n_jobs` must not be 0 (joblib's: >= 1 workers, or -1 for every core)")

    def import_factors(self) -> None:
        """Import the modules named by ``factors`` (they register their factors); ``ValueError``
        naming a module that cannot be imported.  Entry-point plugins need nothing: the registry
        loads them on first use."""
        from kjit.factors import import_factor_modules

        import_factor_modules(self.factors)

    @property
    def training_dir(self) -> Path:
        return self.store / "training-sets"

    def with_(self, **changes) -> "Settings":
        return replace(self, **changes)

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "Settings":
        """Settings from ``KJIT_*`` variables (see the module docstring); ``overrides`` win."""
        env = os.environ if environ is None else environ
        kw: dict = {}
        for f in fields(cls):
            key = "KJIT_" + f.name.upper()
            if key not in env:
                continue
            raw = env[key]
            try:
                if f.name == "default_operators":
                    # empty: the default (as if unset — what docker-compose.yml passes when the shell
                    # sets nothing); `none`: no operator
                    names = [s.strip() for s in raw.split(",") if s.strip()]
                    if names:
                        kw[f.name] = () if names == ["none"] else tuple(names)
                elif f.name == "factors":
                    kw[f.name] = tuple(s.strip() for s in raw.split(",") if s.strip())
                elif f.name in ("host", "log_level"):
                    kw[f.name] = raw
                elif f.name in ("token", "shared_store"):
                    kw[f.name] = raw or None
                elif f.name in ("head_timeout", "body_timeout", "merge_interval", "oracle_wait", "observation_max_z", "observation_max_kl",
                                "audit_rate", "audit_cpu_share", "audit_kl_target"):
                    kw[f.name] = float(raw)
                elif f.name == "store":
                    kw[f.name] = raw  # (an empty value is refused, not read as the current directory)
                else:
                    kw[f.name] = int(raw)
            except ValueError:
                raise ValueError(f"environment variable {key}={raw!r} is not valid for `{f.name}`") from None
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)
