"""Oracle training pairs on a Dask cluster (issue 9, part 1).

A ``distributed.LocalCluster`` of worker processes on loopback stands in for a cluster: the pairs
made through joblib's Dask backend must be bit-identical to the local run for the same seed (each
chunk's importance sampler is seeded by its own SeedSequence child), the tasks must really run on
the workers, and ``kjit train --scheduler tcp://...`` must write the same pairs as the local run.
"""

from __future__ import annotations

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
joblib = pytest.importorskip("joblib")

from kjit.cli import main  # noqa: E402
from kjit.factors import Logistic  # noqa: E402
from kjit.oracles import ImportanceSamplingOracle, QuadratureOracle  # noqa: E402
from kjit.training import TrainingSet, logistic_incoming, make_training_set  # noqa: E402


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                       dashboard_address=None, host="127.0.0.1")
    c = distributed.Client(cluster)
    yield c
    c.close()
    cluster.close()


def assert_same_pairs(a: TrainingSet, b: TrainingSet):
    assert (a.factor, a.to, a.factor_params) == (b.factor, b.to, b.factor_params)
    assert a.meta == b.meta
    assert set(a.incoming) == set(b.incoming)
    for v in a.incoming:
        for p, q in zip(a.incoming[v].params, b.incoming[v].params):
            assert np.array_equal(p, q)
    assert type(a.beliefs) is type(b.beliefs)
    for p, q in zip(a.beliefs.params, b.beliefs.params):
        assert np.array_equal(p, q)  # bit-identical, not just close


def _make(oracle, n=96, chunk_size=12, **kw):
    return make_training_set(Logistic(), "x", logistic_incoming, oracle, n=n, chunk_size=chunk_size,
                             random_state=2024, **kw)


def test_dask_backend_gives_the_local_pairs_and_runs_on_the_workers(client):
    oracle = ImportanceSamplingOracle(Logistic(), n_samples=4000, random_state=0)
    local = _make(oracle)
    with distributed.get_task_stream(client) as stream, joblib.parallel_config(backend="dask"):
        remote = _make(oracle)
    assert_same_pairs(local, remote)
    # the work really went to the worker processes, and to both of them
    workers = {t["worker"] for t in stream.data}
    assert len(stream.data) >= 2 and workers == set(client.scheduler_info()["workers"])
    # the oracle passed in is not advanced (each chunk gets a re-seeded copy), so a second run agrees too
    with joblib.parallel_config(backend="dask"):
        again = _make(oracle, n_jobs=-1)
    assert_same_pairs(local, again)


def test_dask_backend_with_failures_and_with_the_quadrature_oracle(client):
    # few particles: some rows fail (low ESS) and are dropped; the same ones on the cluster
    weak = ImportanceSamplingOracle(Logistic(), n_samples=200, min_ess=30, random_state=0)
    local = _make(weak, n=120, chunk_size=10)
    assert local.meta["n_failed"] > 0
    with joblib.parallel_config(backend="dask"):
        remote = _make(weak, n=120, chunk_size=10)
    assert_same_pairs(local, remote)

    quad = QuadratureOracle(Logistic())
    with joblib.parallel_config(backend="dask"):
        remote = _make(quad, n=200, chunk_size=50)
    assert_same_pairs(_make(quad, n=200, chunk_size=50), remote)


def test_cli_train_with_scheduler_writes_the_local_pairs(client, tmp_path, capsys):
    address = client.scheduler.address
    assert address.startswith("tcp://127.0.0.1:")
    common = ["train", "logistic", "--to", "x", "--n", "80", "--oracle", "sampling", "--particles", "3000",
              "--d-in", "10", "--d-out", "10", "--quiet", "--seed", "5"]
    assert main(common + ["--out", str(tmp_path / "local.npz"), "--save-pairs", str(tmp_path / "local_pairs.npz")]) == 0
    with distributed.get_task_stream(client) as stream:
        assert main(common + ["--out", str(tmp_path / "dask.npz"), "--save-pairs", str(tmp_path / "dask_pairs.npz"),
                              "--scheduler", address]) == 0
    assert len(stream.data) >= 1
    assert_same_pairs(TrainingSet.load(tmp_path / "local_pairs.npz"), TrainingSet.load(tmp_path / "dask_pairs.npz"))
    out = capsys.readouterr().out
    assert out.count("saved KernelOperator") == 2


def test_cli_scheduler_option_is_documented(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--scheduler" in capsys.readouterr().out
