"""Training jobs: run in background threads, observable through ``GET /v1/jobs/{id}``.

A job draws incoming messages, runs the oracle on them (progress counts pairs), fits the
kernel operator, calibrates its threshold and writes it to the store, which serves it from
then on.  Job records live in memory: after a restart the finished operators are in the
store, the job records are gone, and a job that was running is abandoned (its half-written
directory is removed when the store opens).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from datetime import datetime, timezone

from .store import Conflict, OperatorStore
from .training import TrainSpec, train_operator

log = logging.getLogger("kjit.service.jobs")


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
    def __init__(self, store: OperatorStore, workers: int = 1, metrics=None):
        self.store = store
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._worker, name=f"kjit-job-{i}", daemon=True)
                         for i in range(max(1, int(workers)))]
        for t in self._threads:
            t.start()

    def pending_names(self) -> set[str]:
        with self._lock:
            return {j.name for j in self.jobs.values() if j.status in ("queued", "running")}

    def submit(self, name: str, spec: TrainSpec, request: dict) -> Job:
        with self._lock:
            if any(j.name == name and j.status in ("queued", "running") for j in self.jobs.values()):
                raise Conflict(f"a training job for operator {name!r} is already queued or running")
            job = Job(name, spec, request)
            self.jobs[job.id] = job
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
            log.warning("training job %s (%s) failed: %s", job.id, job.name, exc)
            with job._lock:
                job.status, job.error = "failed", f"{type(exc).__name__}: {exc}"
            status = "failed"
        with job._lock:
            job.finished = _now()
        if self.metrics is not None:
            self.metrics.jobs.labels(status).inc()
