"""`kjit serve`, the main job: first start trains the default operators from the quadrature
oracle with a progress bar and caches them in the store; later starts load them; it prints the
docs URL.  The test shrinks the defaults through the environment; the real defaults' first start
(four operators, 4000 pairs each, D 500/1000) and EP against it are ``benchmarks/ep_learned.py``
(too long for CI's machine and time limit as a test)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from service.testing import SubprocessServer

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")


def _serve(store, env, **kw):
    return SubprocessServer(store, env=env, train_defaults=True, **kw)


def test_first_start_trains_then_later_starts_load(tmp_path):
    store = tmp_path / "store"
    env = {"KJIT_DEFAULT_OPERATORS": "logistic-x,compound_gamma-tau", "KJIT_DEFAULT_N_TRAIN": "150",
           "KJIT_DEFAULT_N_INNER": "30", "KJIT_DEFAULT_N_OUTER": "50"}
    srv = _serve(store, env).start()
    try:
        out = "".join(srv.output)
        assert "first start" in out and "oracle pairs" in out and "fitting" in out, out
        assert f"API docs: {srv.url}/docs" in out
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/docs").status_code == 200
            names = [o["name"] for o in c.get("/v1/operators").json()["operators"]]
            assert names == ["compound_gamma-tau", "logistic-x"]
            d = c.get("/v1/operators/logistic-x").json()
            assert d["n_train"] == 150 and d["training"]["threshold_source"]
            assert d["source"]["source"]["distribution"] == "default"
            assert srv.url.startswith("http://127.0.0.1:")
    finally:
        srv.stop()
    pairs = store / "training-sets" / "logistic-x.npz"
    assert pairs.exists()
    written = pairs.stat().st_mtime_ns
    srv = _serve(store, env).start()
    try:
        assert "first start" not in "".join(srv.output)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/v1/operators/logistic-x").json()["n_train"] == 150
    finally:
        srv.stop()
    assert pairs.stat().st_mtime_ns == written  # nothing was sampled or trained again


def test_cli_help_lists_serve_and_oracles_still_works():
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "--help"], capture_output=True, text=True)
    assert "serve" in out.stdout and "demo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "serve", "--help"], capture_output=True, text=True)
    assert "--store" in out.stdout and "--no-defaults" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "oracles", "--particles", "2000"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "quadrature" in out.stdout


def test_serve_help_and_settings_docstring_state_the_real_defaults():
    """Found by an audit: `kjit serve --help` said `--n-train ... default 2000` (it is 4000) and, like
    service/settings.py's table, listed the default operators without exp-x."""
    import dataclasses
    import re

    from service import settings as S
    from service.server import build_parser
    from service.training import served_defaults

    default = {f.name: f.default for f in dataclasses.fields(S.Settings)}
    served = served_defaults()
    assert "exp-x" in served
    text = " ".join(build_parser().format_help().split())
    assert f"KJIT_DEFAULT_N_TRAIN, default {default['default_n_train']})" in text
    assert ", ".join(served) in text
    for opt, name in (("--host", "host"), ("--port", "port"), ("--log-level", "log_level")):
        assert re.search(rf"{opt} \S+ .*?default {re.escape(str(default[name]))}\)", text), opt
    # the module docstring's table: every setting has a row, and a row's literal default is the field's
    rows: dict[str, str] = {}
    for line in S.__doc__.splitlines():
        m = re.match(r"^``(KJIT_\w+)``(.*)$", line)
        if m:
            key, rows[m.group(1)] = m.group(1), m.group(2)
        elif rows and line.startswith(" "):
            rows[key] += "\n" + line
    for f in dataclasses.fields(S.Settings):
        row = rows.pop("KJIT_" + f.name.upper())  # a setting without a row: KeyError
        first = re.findall(r"``([^`]+)``", row.splitlines()[0])
        if f.default is dataclasses.MISSING or f.default is None or not first:
            continue
        lit = first[-1]
        if isinstance(f.default, (int, float)):
            assert float(lit) == float(f.default), (f.name, lit)
        else:
            assert lit == str(f.default), (f.name, lit)
    assert rows == {}, rows  # and no row for a setting that does not exist
    literals = "".join(re.findall(r"``([^`]+)``", S.__doc__.split("``KJIT_DEFAULT_OPERATORS``")[1].split("\n``")[0]))
    assert ",".join(served) in literals


def test_an_empty_default_operators_variable_means_the_default():
    """docker-compose.yml passes KJIT_DEFAULT_OPERATORS through as `${KJIT_DEFAULT_OPERATORS:-}`: empty
    when the shell sets nothing, which must mean the built-in default (what `docker run` serves), not none."""
    import re
    from pathlib import Path

    from service.settings import Settings

    assert Settings.from_env({}).default_operators is None
    assert Settings.from_env({"KJIT_DEFAULT_OPERATORS": ""}).default_operators is None
    assert Settings.from_env({"KJIT_DEFAULT_OPERATORS": " , "}).default_operators is None
    assert Settings.from_env({"KJIT_DEFAULT_OPERATORS": "none"}).default_operators == ()
    assert Settings.from_env({"KJIT_DEFAULT_OPERATORS": "exp-x, logistic-x"}).default_operators == ("exp-x",
                                                                                                   "logistic-x")
    compose = (Path(__file__).resolve().parents[1] / "docker-compose.yml").read_text()
    assert re.search(r"^ +KJIT_DEFAULT_OPERATORS: \$\{KJIT_DEFAULT_OPERATORS:-\}( +#.*)?$", compose, re.M)
