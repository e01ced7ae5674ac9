"""Prometheus metrics of one app (its own registry, so several apps can live in one process).

======================================  =========  ==============================================
metric                                  type       labels / meaning
======================================  =========  ==============================================
``kjit_http_requests_total``            counter    method, route (template), status
``kjit_http_request_duration_seconds``  histogram  method, route: wall time in the server
``kjit_messages_total``                 counter    operator, mode (predict | oracle | jit | draw): rows answered
``kjit_consultations_total``            counter    operator: rows the oracle answered
``kjit_updates_total``                  counter    operator, source (jit | observations): pairs learned
``kjit_update_records_total``           counter    operator: durable update records written
``kjit_store_seconds``                  histogram  op (fsync | snapshot_serialise | snapshot_write)
``kjit_training_jobs_total``            counter    status (submitted | succeeded | failed)
``kjit_operator_version``               gauge      operator: update records applied since creation
``kjit_operator_n_train``               gauge      operator: pairs the regression has seen
``kjit_operators``                      gauge      state (loaded | loading | failed)
======================================  =========  ==============================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _StoreCollector:
    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self):
        store = self.metrics.store
        version = GaugeMetricFamily("kjit_operator_version", "update records applied since creation", labels=["operator"])
        n_train = GaugeMetricFamily("kjit_operator_n_train", "pairs the operator's regression has seen", labels=["operator"])
        states = GaugeMetricFamily("kjit_operators", "operators of the store by state", labels=["state"])
        if store is not None:
            entries = dict(store.entries)
            for name, e in entries.items():
                version.add_metric([name], e.version)
                try:
                    n_train.add_metric([name], e.jit.operator.n_train_)
                except Exception:  # pragma: no cover - mid-recovery
                    pass
            states.add_metric(["loaded"], len(entries))
            states.add_metric(["loading"], len(store.loading))
            states.add_metric(["failed"], len(store.failed))
        yield version
        yield n_train
        yield states

    def describe(self):  # no describe: collected at scrape time only
        return []


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.store = None
        self.requests = Counter("kjit_http_requests", "HTTP requests", ["method", "route", "status"], registry=r)
        self.latency = Histogram("kjit_http_request_duration_seconds", "HTTP request latency in the server",
                                 ["method", "route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.messages = Counter("kjit_messages", "messages (rows) answered", ["operator", "mode"], registry=r)
        self.consultations = Counter("kjit_consultations", "rows answered by the oracle", ["operator"], registry=r)
        self.updates = Counter("kjit_updates", "(incoming, belief) pairs learned online", ["operator", "source"],
                               registry=r)
        self.records = Counter("kjit_update_records", "durable update records written", ["operator"], registry=r)
        self.store_seconds = Histogram("kjit_store_seconds", "store operations", ["op"], buckets=_LATENCY_BUCKETS,
                                       registry=r)
        self.jobs = Counter("kjit_training_jobs", "training jobs", ["status"], registry=r)
        r.register(_StoreCollector(self))
        self._children = {}

    def child(self, metric, *values):
        """``metric.labels(*values)``, kept: the same child every time (prometheus_client's own
        lookup takes a lock and re-validates the values, ~2 µs of every request, three times)."""
        key = (metric, values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*values)
        return c

    def observe_store(self, op: str, seconds: float) -> None:
        self.store_seconds.labels(op).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
