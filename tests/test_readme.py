"""Every code block of the README is exercised.

Python blocks run in order, each in a namespace of its own (each must run on its own); the
remote-operator blocks talk to a real uvicorn server on a free loopback port serving small
logistic-x and exp-x operators (KJIT_URL points at it).  The
curl block is sent with httpx to the same server (same method, path, headers and body).  The
bash set-up block is what CI itself runs (.ci/run → make test), and the docker block is what
scripts/docker-smoke runs; both are checked for being the commands those files use.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
import numpy as np
import pytest

from test_service_fixtures import copy_store, pristine_store, settings_for  # noqa: F401 - fixtures
from service.testing import ThreadedServer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_the_two_setup_commands():
    first = blocks("bash")[0].splitlines()
    assert first[0].startswith("make run") and first[1].startswith("make test")
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)
    assert "kjit.cli serve" in makefile


def test_python_blocks_run(pristine_store, tmp_path, monkeypatch, capsys):  # noqa: F811 - fixture
    from service.store import OperatorStore
    from service.training import TrainSpec, train_operator

    store = tmp_path / "store"
    copy_store(pristine_store, store)
    # the served-model example asks for exp-x (served by default by `kjit serve`): a small one here
    s = OperatorStore(store)
    s.open()
    try:
        jit, _, info = train_operator(TrainSpec("exp", "x", n=300, n_inner=50, n_outer=100, threshold=-6.0, random_state=0))
        s.create("exp-x", jit, {"training": info, "threshold": jit.threshold})
    finally:
        s.close()
    with ThreadedServer(settings_for(store, token=None)) as srv:
        monkeypatch.setenv("KJIT_URL", srv.url)
        ns: dict = {}
        for i, code in enumerate(blocks("python")):
            # each block on its own, as pasted into a fresh interpreter (found by an audit: blocks that
            # needed an earlier block's imports or names); the names kept for the checks below
            own: dict = {}
            exec(compile(code, f"README.md (python block {i + 1})", "exec"), own)
            ns.update(own)
    assert ns["belief"].shape == (2,) and ns["log_var"].shape == (2, 2)
    assert ns["model"].test_error(ns["data"].X_test, ns["data"].y_test) < 0.1
    assert ns["q"].shape == ()
    assert ns["poisson"].converged_ and np.all(np.isfinite(ns["poisson"].coef_))
    assert "test error" in capsys.readouterr().out
    # "Your own factor, served": the user's sampled factor, trained by POST /v1/operators, answers
    info = ns["noisy_z"].info()
    assert info["factor"] == "my_noisy_product" and info["oracle"] == {"kind": "message_sampler"}
    assert info["families"] == {"x": "gaussian", "y": "gaussian", "z": "gaussian"}
    assert ns["q_z"].shape == () and np.isfinite(ns["q_z"].mean()) and ns["q_z"].var() > 0
    # … and with the factor kept in the client: the far row went to the client's sampler and was sent back —
    # beyond the operator's input margin, acknowledged and not learned (as the README's comment says)
    mine = ns["mine"]
    assert mine.info()["oracle"] == {"kind": "client"}  # (as read during the run: the server has stopped)
    assert mine.consultations_ == 1 and mine.last_version_ == mine.info()["version"] + 1  # one observation
    assert mine.unlearned_ == 1
    assert ns["q_mine"].shape == () and abs(ns["q_mine"].mean() - 12.0) < 3 * np.sqrt(ns["q_mine"].var())


def test_curl_block_is_a_valid_request(pristine_store, tmp_path):  # noqa: F811 - fixture
    (curl,) = [b for b in blocks("bash") if b.lstrip().startswith("curl")]
    args = shlex.split(curl.replace("\\\n", " "))
    url = next(a for a in args if a.startswith("http://"))
    body = json.loads(args[args.index("-d") + 1])
    store = tmp_path / "store"
    copy_store(pristine_store, store)
    with ThreadedServer(settings_for(store, token=None)) as srv:
        r = httpx.post(url.replace("http://127.0.0.1:8000", srv.url), json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["consulted"]) == 2 and not any(out["consulted"])


def test_docker_block_matches_the_smoke_script():
    (docker,) = [b for b in blocks("bash") if b.lstrip().startswith("docker")]
    assert "docker build" in docker and "docker run" in docker
    smoke = (ROOT / "scripts" / "docker-smoke").read_text()
    assert "docker build" in smoke and "docker run" in smoke and "/health" in smoke
    assert "VOLUME" in (ROOT / "Dockerfile").read_text()
