"""Training jobs: run in background threads, observable through ``GET /v1/jobs/{id}``.

A job draws incoming messages, runs the oracle on them (progress counts pairs), fits the
kernel operator, calibrates its threshold and writes it to the store, which serves it from
then on.  Each job's record is written to ``<store>/jobs/<id>.json`` (atomically) when it is
queued, starts and ends, so ``GET /v1/jobs/{id}`` answers across restarts; a job that was
queued or running when the server stopped is recorded as failed ("interrupted") on the next
start (its half-written operator directory is removed when the store opens) — or as succeeded if
the store had installed its operator (the install is atomic; the job's record came after it).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import uuid
from datetime import datetime, timezone

from pathlib import Path

from .files import write_atomic
from .store import Conflict, OperatorStore
from .training import TrainSpec, train_operator

log = logging.getLogger("kjit.service.jobs")


class QueueFull(RuntimeError):
    """Too many training jobs queued or running (``KJIT_MAX_QUEUED_JOBS``)."""


def _plain(o):
    """JSON for numpy scalars and arrays in a job's result (anything else as text)."""
    return o.tolist() if hasattr(o, "tolist") else str(o)


def scrub(text: str, root) -> str:
    """``text`` with the store's absolute path replaced by ``<store>`` (no server paths in responses)."""
    for p in {str(Path(root)), str(Path(root).resolve())}:
        text = text.replace(p, "<store>")
    return text


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class Job:
    def __init__(self, name: str, spec: TrainSpec, request: dict):
        self.id = uuid.uuid4().hex[:16]
        self.name = name
        self.spec = spec
        self.request = request
        self.status = "queued"
        self.stage, self.done, self.total = "queued", 0, 0
        self.created, self.started, self.finished = _now(), None, None
        self.error = None
        self.result = None
        self._lock = threading.Lock()

    def progress(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            self.stage, self.done, self.total = stage, int(done), int(total)

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        """A job of an earlier run of the server, from its record (read-only: no spec)."""
        if not isinstance(d, dict):
            raise ValueError(f"a job record is a JSON object, got {type(d).__name__}")
        job = cls.__new__(cls)
        job.id, job.name, job.spec, job.request = str(d["id"]), str(d["operator"]), None, d.get("request") or {}
        job.status, job.error, job.result = d["status"], d.get("error"), d.get("result")
        if job.status not in ("queued", "running", "succeeded", "failed"):
            raise ValueError(f"unknown job status {job.status!r}")
        p = d.get("progress") or {}
        if not isinstance(p, dict):  # (found by an audit: "progress": 5 stopped the server's start)
            raise ValueError(f"a job record's progress is a JSON object, got {type(p).__name__}")
        job.stage, job.done, job.total = p.get("stage", "queued"), int(p.get("done", 0)), int(p.get("total", 0))
        job.created, job.started, job.finished = d.get("created"), d.get("started"), d.get("finished")
        job._lock = threading.Lock()
        return job

    def as_dict(self) -> dict:
        with self._lock:
            frac = self.done / self.total if self.total else (1.0 if self.status == "succeeded" else 0.0)
            return {
                "id": self.id, "status": self.status, "operator": self.name,
                "progress": {"stage": self.stage, "done": self.done, "total": self.total, "fraction": frac},
                "created": self.created, "started": self.started, "finished": self.finished,
                "error": self.error, "request": self.request, "result": self.result,
            }


class JobManager:
    def __init__(self, store: OperatorStore, workers: int = 1, metrics=None, directory: Path | None = None):
        self.store = store
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.directory = Path(directory) if directory is not None else Path(store.root) / "jobs"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._restore()
        self._queue: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._worker, name=f"kjit-job-{i}", daemon=True)
                         for i in range(max(1, int(workers)))]
        for t in self._threads:
            t.start()

    def _restore(self) -> None:
        """Load the records of earlier runs; jobs they left queued or running were interrupted."""
        for path in sorted(self.directory.glob("*.json")):
            try:
                job = Job.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError, RecursionError) as exc:
                log.warning("job record %s unreadable (%s): skipped", path.name, exc)
                continue
            if job.status in ("queued", "running"):
                installed = self._installed_meta(job)
                if installed is not None:  # stopped after the store installed its operator (atomic)
                    job.status, job.result = "succeeded", installed.get("training")
                    job.stage, job.done, job.total = "done", 1, 1
                else:
                    job.status = "failed"
                    job.error = "interrupted: the server stopped before the job finished"
                job.finished = job.finished or _now()
                self._save(job)
            self.jobs[job.id] = job

    def _installed_meta(self, job: Job) -> dict | None:
        """The meta of the operator ``job`` installed, if the store holds it (its meta names the job):
        a server stopped between the store's atomic install and the job's record (found in review:
        the job said "failed (interrupted)" while its operator was served, and a retry got 409)."""
        path = Path(self.store.root) / "operators" / job.name / "meta.json"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) and meta.get("job") == job.id else None

    def _save(self, job: Job) -> None:
        try:
            write_atomic(self.directory / f"{job.id}.json", json.dumps(job.as_dict(), default=_plain).encode())
        except OSError as exc:  # the job itself is unaffected; only its record may be lost
            log.warning("could not write the record of job %s: %s", job.id, exc)

    def pending_names(self) -> set[str]:
        with self._lock:
            return {j.name for j in self.jobs.values() if j.status in ("queued", "running")}

    def submit(self, name: str, spec: TrainSpec, request: dict, max_pending: int | None = None) -> Job:
        with self._lock:
            if any(j.name == name and j.status in ("queued", "running") for j in self.jobs.values()):
                raise Conflict(f"a training job for operator {name!r} is already queued or running")
            pending = sum(j.status in ("queued", "running") for j in self.jobs.values())
            if max_pending is not None and pending >= max_pending:
                raise QueueFull(f"{pending} training jobs are queued or running, the limit of this server "
                                f"(KJIT_MAX_QUEUED_JOBS); retry when one has finished")
            job = Job(name, spec, request)
            self.jobs[job.id] = job
        self._save(job)
        if self.metrics is not None:
            self.metrics.jobs.labels("submitted").inc()
        self._queue.put(job)
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self.jobs.get(job_id)

    def list(self) -> list[Job]:
        with self._lock:
            return list(self.jobs.values())

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: Job) -> None:
        with job._lock:
            job.status, job.started = "running", _now()
        self._save(job)
        try:
            jit, ts, info = train_operator(job.spec, progress=job.progress)
            job.progress("store", 0, 1)
            self.store.create(job.name, jit, {"training": info, "source": job.spec.describe(),
                                              "threshold": info["threshold"], "job": job.id})
            with job._lock:
                job.status, job.result = "succeeded", info
                job.stage, job.done, job.total = "done", 1, 1
            status = "succeeded"
        except Exception as exc:
            log.warning("training job %s (%s) failed: %s", job.id, job.name, exc, exc_info=True)
            with job._lock:
                job.status, job.error = "failed", scrub(f"{type(exc).__name__}: {exc}", self.store.root)
            status = "failed"
        with job._lock:
            job.finished = _now()
        self._save(job)
        if self.metrics is not None:
            self.metrics.jobs.labels(status).inc()
