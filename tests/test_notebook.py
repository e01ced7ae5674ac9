"""The training notebook: committed clean, runs top to bottom with nbclient, draws its figures, and
leaves an operator in the store that the service loads and serves."""

from __future__ import annotations

import ast
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "train_operator.ipynb"
FIGURES = ("log_kl_histogram.png", "best_median_worst.png", "u_shape.png", "jit_consultation_rate.png",
           "audited_kl.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cells():
    return json.loads(NOTEBOOK.read_text())["cells"]


def test_committed_notebook_is_clean_and_parses():
    cells = _cells()
    code = [c for c in cells if c["cell_type"] == "code"]
    assert len(code) >= 6
    for c in code:
        assert c.get("outputs") == [], "commit the notebook with its outputs cleared"
        assert c.get("execution_count") is None
        ast.parse("".join(c["source"]))  # no IPython magics: plain Python


def _execute_module():
    spec = importlib.util.spec_from_file_location("kjit_notebook_execute", ROOT / "notebooks" / "execute.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_notebook_executes_and_the_service_serves_its_operator(tmp_path):
    pytest.importorskip("nbclient", reason="needs the notebook extras: pip install -e '.[notebook]' (make notebook)")
    pytest.importorskip("ipykernel", reason="needs the notebook extras")
    pytest.importorskip("matplotlib", reason="needs the notebook extras")
    store, figures, name = tmp_path / "store", tmp_path / "figures", "nb-test-logistic-x"

    nb, executed, seconds = _execute_module().execute(
        NOTEBOOK, out_dir=tmp_path / "executed",
        env={"KJIT_STORE": store, "KJIT_NOTEBOOK_OUT": figures, "KJIT_NOTEBOOK_OPERATOR": name},
    )
    print(f"notebook executed in {seconds:.0f}s")
    assert executed.exists()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    shown = [o for o in outputs if o.output_type in ("display_data", "execute_result") and "image/png" in o.data]
    assert len(shown) >= len(FIGURES), "every figure is displayed in the notebook"
    for f in FIGURES:
        data = (figures / f).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, f

    # the operator, in the store's layout, readable by kjit.persistence
    from kjit.families import Beta, Gaussian
    from kjit.persistence import load_operator

    op_dir = store / "operators" / name
    meta = json.loads((op_dir / "meta.json").read_text())
    assert (meta["factor"], meta["to"], meta["name"]) == ("logistic", "x", name)
    local = load_operator(op_dir / "snapshot-00000000.npz")
    assert type(local).__name__ == "JITOperator" and local.operator.n_train_ >= 2000
    assert (store / "training-sets" / f"{name}.npz").exists()

    # ... and served by the service built on that store
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    incoming = {"x": Gaussian([0.0, 2.0, -1.0], [1.0, 0.5, 3.0]), "z": Beta([2.0, 1.0, 2.0], [1.0, 2.0, 1.0])}
    expected = local.operator.belief(incoming)
    body = {"to": "x", "incoming": {
        "x": {"family": "gaussian", "mean": [0.0, 2.0, -1.0], "var": [1.0, 0.5, 3.0]},
        "z": {"family": "beta", "alpha": [2.0, 1.0, 2.0], "beta": [1.0, 2.0, 1.0]}}}
    settings = Settings(store=store, default_operators=())
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while (r := client.get("/ready")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        assert name in r.json()["operators"]
        r = client.post(f"/v1/operators/{name}/messages", params={"mode": "predict"}, json=body)
        assert r.status_code == 200, r.text
        got = r.json()["beliefs"]
        np.testing.assert_allclose(got["mean"], expected.mean(), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got["var"], expected.var(), rtol=1e-6)
