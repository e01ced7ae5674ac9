"""Training jobs (``POST /v1/operators`` starts one)."""

from __future__ import annotations

from fastapi import APIRouter

from kjit.errors import quoted

from .. import schemas
from ..deps import JobsDep
from ..errors import ApiError
from .base import answers, json_response

router = APIRouter(tags=["training"])


@router.get("/v1/jobs", response_model=schemas.JobList,
            summary="training jobs (their records are kept in the store across restarts)")
def list_jobs(jobs: JobsDep):
    return {"jobs": [j.as_dict() for j in jobs.list()]}


@router.get("/v1/jobs/{job_id}", response_model=None, responses=answers(schemas.Job),
            summary="a training job: status and progress")
def job_status(job_id: str, jobs: JobsDep):
    job = jobs.get(job_id)
    if job is None:
        raise ApiError(404, ["path", "job_id"], f"unknown job {quoted(job_id, 40)}", "not_found")
    return json_response(job.as_dict())
