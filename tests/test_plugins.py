"""Factors from outside kjit (issue 13): a tiny third-party package, written to a temporary
directory, is found through the ``kjit.factors`` entry point (a ``*.dist-info`` with
``entry_points.txt`` on ``sys.path``, as an installed package would have) or named as a module
(``--factors`` / ``KJIT_FACTORS``); the server trains, persists, reloads and serves it with no
edit to kjit; a stored operator whose factor is not available is reported by ``/ready``.

The plugin factor is ``y = x + c`` with Gaussian messages on x and y: its exact rule is closed
form (the tilted distribution of x is N(m_x, v_x) · N(x + c; m_y, v_y), a Gaussian), so the
served answers are checked against an independent formula.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import httpx
import numpy as np
import pytest

from kjit import factors as F
from kjit.families import Gaussian
from kjit.oracles import QuadratureOracle

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")

PLUGIN = textwrap.dedent('''
    """A third-party factor package: y = x + c, Gaussian messages."""
    import numpy as np

    from kjit.factors import Factor, register_factor, rule
    from kjit.families import Gaussian

    __all__ = ["Shift"]


    class Shift(Factor):
        name = "{name}"
        inputs = ("x",)
        output = "y"
        families = {{"x": Gaussian, "y": Gaussian}}
        served = ("x",)
        default_threshold = -9.0

        def __init__(self, c: float = 1.5):
            self.c = float(c)

        def params(self):
            return {{"c": self.c}}

        def sample(self, inputs, size, rng):
            return inputs["x"] + self.c

        @staticmethod
        def default_incoming(n, rng):
            return {{"x": Gaussian(rng.uniform(-3, 3, n), 10 ** rng.uniform(-0.5, 0.5, n)),
                     "y": Gaussian(rng.uniform(-3, 3, n), 10 ** rng.uniform(-0.5, 0.5, n))}}

        @rule("x", "y")
        def _belief(self, incoming, to, power):
            x, y = incoming["x"], incoming["y"]
            # the other variable's message moved onto this one: y = x + c
            if to == "x":
                other_m, other_v, own = y.mean() - self.c, y.var(), x
            else:
                other_m, other_v, own = x.mean() + self.c, x.var(), y
            prec = 1.0 / own.var() + 1.0 / other_v
            return Gaussian((own.mean() / own.var() + other_m / other_v) / prec, 1.0 / prec)
    {register}
''')


def _shift_reference(mx, vx, my, vy, c):
    """Belief on x of N(x; mx, vx) N(x + c; my, vy), by the product of Gaussians (x-space)."""
    v = 1.0 / (1.0 / vx + 1.0 / vy)
    return v * (mx / vx + (my - c) / vy), v


def _write_plugin(root, module, name, entry_point: bool):
    pkg = root / module
    pkg.mkdir(parents=True)
    register = "" if entry_point else "\nregister_factor(Shift)\n"
    (pkg / "__init__.py").write_text(PLUGIN.format(name=name, register=register))
    if entry_point:
        dist = root / f"{module}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[kjit.factors]\n{name} = {module}:Shift\n")


@pytest.fixture
def clean_registry():
    saved = dict(F._REGISTRY)
    path = list(sys.path)
    mods = set(sys.modules)
    yield
    F._REGISTRY.clear()
    F._REGISTRY.update(saved)
    sys.path[:] = path
    for m in set(sys.modules) - mods:
        if m.startswith("kjit_test_plugin"):
            del sys.modules[m]
    importlib.invalidate_caches()
    F.load_entry_points(force=True)  # forget the temporary distribution's entry points


def test_entry_point_plugin_is_found_without_importing_it(tmp_path, clean_registry):
    F.load_entry_points()  # the process has read the entry points before the package appears
    _write_plugin(tmp_path, "kjit_test_plugin_ep", "test_plugin_shift", entry_point=True)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    assert "kjit_test_plugin_ep" not in sys.modules
    with pytest.raises(ValueError, match="unknown factor 'test_plugin_shift'"):
        F.get_factor("test_plugin_shift")  # read once per process, like an installed package's
    F.load_entry_points(force=True)  # a package installed while the process runs
    assert "test_plugin_shift" in F.registered_factors()
    f = F.get_factor("test_plugin_shift", c=0.5)
    assert type(f).__module__ == "kjit_test_plugin_ep" and f.params() == {"c": 0.5}
    inc = {"x": Gaussian(np.array([0.0, 2.0]), np.array([1.0, 0.5])),
           "y": Gaussian(np.array([1.0, -1.0]), np.array([2.0, 0.25]))}
    q = QuadratureOracle(f).belief(inc, "x")
    m, v = _shift_reference(inc["x"].mean(), inc["x"].var(), inc["y"].mean(), inc["y"].var(), 0.5)
    np.testing.assert_allclose(q.mean(), m, rtol=1e-14)
    np.testing.assert_allclose(q.var(), v, rtol=1e-14)
    # the service's generic defaults see it: trainable and served by default
    from service.training import default_specs, served_defaults

    assert default_specs()["test_plugin_shift-x"] == ("test_plugin_shift", "x")
    assert "test_plugin_shift-x" in served_defaults()


def test_broken_entry_point_is_reported_not_fatal(tmp_path, clean_registry):
    dist = tmp_path / "kjit_test_plugin_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kjit_test_plugin_broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kjit.factors]\nbroken = kjit_test_plugin_broken_missing:Nope\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    F.load_entry_points(force=True)
    assert "logistic" in F.registered_factors()
    with pytest.raises(ValueError, match="plugins that failed to load: entry point broken"):
        F.get_factor("broken")


def test_factor_module_that_cannot_be_imported_is_a_clear_error():
    with pytest.raises(ValueError, match="factor module 'kjit_no_such_module' could not be imported"):
        F.import_factor_modules("kjit_no_such_module")


def test_server_trains_persists_reloads_and_serves_a_factor_given_by_module(tmp_path, clean_registry):
    """KJIT_FACTORS names the plugin module; the server trains its served default, persists it,
    loads it again on the next start and answers requests; without the module, /ready names
    the missing factor instead of crashing."""
    from service.settings import Settings
    from service.testing import SubprocessServer, ThreadedServer

    plugins = tmp_path / "plugins"
    _write_plugin(plugins, "kjit_test_plugin_mod", "test_plugin_shift_mod", entry_point=False)
    store = tmp_path / "store"
    import os

    env = {"KJIT_FACTORS": "kjit_test_plugin_mod", "KJIT_DEFAULT_OPERATORS": "test_plugin_shift_mod-x",
           "KJIT_DEFAULT_N_TRAIN": "150", "KJIT_DEFAULT_N_INNER": "30", "KJIT_DEFAULT_N_OUTER": "50",
           "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")])}
    rng = np.random.default_rng(3)
    mx, vx = rng.uniform(-2, 2, 5), 10 ** rng.uniform(-0.3, 0.3, 5)
    my, vy = rng.uniform(-2, 2, 5), 10 ** rng.uniform(-0.3, 0.3, 5)
    body = {"to": "x", "incoming": {"x": {"family": "gaussian", "mean": mx.tolist(), "var": vx.tolist()},
                                    "y": {"family": "gaussian", "mean": my.tolist(), "var": vy.tolist()}}}
    ref_m, ref_v = _shift_reference(mx, vx, my, vy, 1.5)
    answers = []
    for start in ("first", "reload"):
        srv = SubprocessServer(store, env=env, train_defaults=True).start(timeout=300)
        try:
            out = "".join(srv.output)
            assert ("first start" in out) == (start == "first"), out
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                names = [o["name"] for o in c.get("/v1/operators").json()["operators"]]
                assert names == ["test_plugin_shift_mod-x"]
                r = c.post("/v1/operators/test_plugin_shift_mod-x/messages", params={"mode": "oracle"}, json=body)
                assert r.status_code == 200, r.text
                got = r.json()["beliefs"]
                np.testing.assert_allclose(got["mean"], ref_m, rtol=1e-12)
                np.testing.assert_allclose(got["var"], ref_v, rtol=1e-12)
                r = c.post("/v1/operators/test_plugin_shift_mod-x/messages", params={"mode": "predict"}, json=body)
                assert r.status_code == 200, r.text
                answers.append(r.json()["beliefs"])
                # a wrong family for the plugin's variable is a 422 naming it
                bad = {"to": "x", "incoming": {**body["incoming"], "y": {"family": "gamma", "shape": [1.0] * 5,
                                                                          "rate": [1.0] * 5}}}
                r = c.post("/v1/operators/test_plugin_shift_mod-x/messages", params={"mode": "predict"}, json=bad)
                assert r.status_code == 422 and r.json()["detail"][0]["loc"][-2:] == ["y", "family"]
        finally:
            srv.stop()
    # the reloaded operator is the persisted one: the same predictions
    assert answers[0] == answers[1]
    assert (store / "training-sets" / "test_plugin_shift_mod-x.npz").exists()

    # without the module (this process never imported it), the stored operator cannot be built
    assert "test_plugin_shift_mod" not in F.registered_factors()
    with ThreadedServer(Settings(store=store, default_operators=())).start(ready=False) as srv:
        import time

        t_end = time.monotonic() + 60
        while True:
            r = httpx.get(srv.url + "/ready", timeout=60)
            if r.json()["loading"] == [] and r.json()["failed"] or time.monotonic() > t_end:
                break
            time.sleep(0.05)
        assert r.status_code == 503
        ready = r.json()
        assert ready["missing_factors"] == {"test_plugin_shift_mod-x": "test_plugin_shift_mod"}
        why = ready["failed"]["test_plugin_shift_mod-x"]
        assert "factor 'test_plugin_shift_mod' is not available" in why and "KJIT_FACTORS" in why
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200  # the server itself runs
        r = httpx.post(srv.url + "/v1/operators/test_plugin_shift_mod-x/messages", json=body, timeout=60)
        assert r.status_code == 503 and "test_plugin_shift_mod" in r.text


def test_factors_option_and_environment_variable():
    from service.server import build_parser
    from service.settings import Settings

    args = build_parser().parse_args(["--factors", "pkg.a, pkg.b"])
    assert Settings.from_env({}, factors=args.factors).factors == ("pkg.a", "pkg.b")
    assert Settings.from_env({"KJIT_FACTORS": "pkg.c,"}).factors == ("pkg.c",)
    assert Settings.from_env({}).factors == ()
    with pytest.raises(ValueError, match="factor module 'kjit_no_such_module' could not be imported"):
        Settings(factors=("kjit_no_such_module",)).import_factors()


def test_a_factory_that_fails_or_returns_no_factor_is_named_not_raised_raw(monkeypatch, tmp_path):
    """A plugin's factory with its own bug (raises RuntimeError, or returns None): get_factor raises
    FactorBuildError (a ValueError naming the factor), POST /v1/operators answers 422 on body.factor,
    and the server's default operators skip it (found in review: a 500, and `kjit serve` would not
    start)."""
    from fastapi.testclient import TestClient

    from service import Settings, create_app
    from service.training import default_specs

    def raising():
        raise RuntimeError("license server unreachable")

    monkeypatch.setitem(F._REGISTRY, "broken_raising", raising)
    monkeypatch.setitem(F._REGISTRY, "broken_none", lambda: None)
    for name, why in (("broken_raising", "its factory failed (RuntimeError: license server unreachable)"),
                      ("broken_none", "its factory returned NoneType, not a Factor")):
        with pytest.raises(F.FactorBuildError, match=f"factor '{name}': {why.split('(')[0]}"):
            F.get_factor(name)
    assert not any(k.startswith("broken") for k in default_specs())
    with TestClient(create_app(Settings(store=tmp_path / "store", token="t", default_operators=()))) as c:
        for name in ("broken_raising", "broken_none"):
            r = c.post("/v1/operators", headers={"Authorization": "Bearer t"},
                       json={"name": "b", "factor": name, "to": "x", "source": {"kind": "oracle", "n": 50}})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "factor"], r.text


def test_a_factor_that_would_not_come_back_as_itself_is_refused(monkeypatch, tmp_path):
    """An operator saves its factor as (name, params()) and rebuilds it by get_factor (found by an
    audit): a class without params() trained with parameters was served with its defaults (its oracle
    answering for noise 0.3 while the regression had learned noise 3), and an instance registered
    under another name than its own was rebuilt as the factor of that name (the built-in product).
    Now get_factor refuses parameters a factor does not report, and a factory whose factor calls itself
    otherwise; register_factor refuses an instance under another name; POST /v1/operators answers 422."""
    from fastapi.testclient import TestClient

    from service import Settings, create_app

    class Silent(F.Factor):  # reports no parameters
        name = "silent_noise"
        inputs, output = ("x",), "y"
        families = {"x": Gaussian, "y": Gaussian}

        def __init__(self, noise=0.3):
            self.noise = float(noise)

        def sample(self, inputs, size, rng):
            return inputs["x"] + self.noise * rng.standard_normal(size)

    class Misnamed(Silent):
        name = "the_other_name"

    monkeypatch.setitem(F._REGISTRY, "silent_noise", Silent)
    monkeypatch.setitem(F._REGISTRY, "misnamed", Misnamed)
    assert F.get_factor("silent_noise").noise == 0.3  # no parameters: nothing to lose
    with pytest.raises(ValueError, match="does not report its parameter.*'noise'"):
        F.get_factor("silent_noise", noise=3.0)
    with pytest.raises(F.FactorBuildError, match="named 'the_other_name'.*must be named 'misnamed'"):
        F.get_factor("misnamed")
    shifted = F.SampledFactor("product", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
                              sampler=lambda v, rng: v["x"] * v["y"] + 10.0)
    with pytest.raises(ValueError, match="named 'product' cannot be registered as 'shifted_product'"):
        F.register_factor(shifted, name="shifted_product")
    assert "shifted_product" not in F._REGISTRY
    own = F.SampledFactor("own_product", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
                          sampler=lambda v, rng: v["x"] * v["y"])
    monkeypatch.setitem(F._REGISTRY, "own_product", lambda **kw: own)
    F._REGISTRY["own_product"]._kjit_instance = own
    with pytest.raises(ValueError, match="registered instance: it takes no parameters"):
        F.get_factor("own_product", noise=5.0)
    assert F.get_factor("own_product") is own
    with TestClient(create_app(Settings(store=tmp_path / "store", token="t", default_operators=()))) as c:
        r = c.post("/v1/operators", headers={"Authorization": "Bearer t"},
                   json={"name": "s", "factor": "silent_noise", "to": "x", "factor_params": {"noise": 3.0},
                         "source": {"kind": "oracle", "n": 50, "oracle": "importance_sampling"}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "factor_params"], r.text
        assert "'noise'" in r.json()["detail"][0]["msg"]


def test_a_user_sampler_or_approximation_that_raises_is_named(monkeypatch):
    """A user sampler or approximation raising something other than ValueError / ArithmeticError /
    OracleError (a RuntimeError, a KeyError) was a bare exception — a 500 in the service, even in
    mode=predict for the approximation (found by an audit); now a FactorCodeError (a ValueError)
    naming the factor and what raised, with the user's exception as its cause."""
    from kjit.oracles import ImportanceSamplingOracle, MessageImportanceSampler

    def boom(v, rng):
        raise KeyError("w")

    f = F.SampledFactor("raising_sampler", inputs={"x": Gaussian}, output=("y", Gaussian), sampler=boom,
                        approximate=lambda inc, to: {}["missing"])
    inc = {"x": Gaussian(0.0, 1.0), "y": Gaussian(0.0, 1.0)}
    for oracle in (ImportanceSamplingOracle(f, n_samples=1000, random_state=0),
                   MessageImportanceSampler(f, random_state=0)):
        with pytest.raises(F.FactorCodeError, match="factor 'raising_sampler': its sampler raised KeyError") as e:
            oracle.belief(inc, "x")
        assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(F.FactorCodeError, match="its approximation raised KeyError"):
        f.reference_belief(inc, "x")
    # a MemoryError, a ValueError of a user's approximation: named too (a later audit: the MemoryError was a 500)
    for exc in (MemoryError("too big"), ValueError("domain"), FloatingPointError("overflow")):
        def approx(inc, to, exc=exc):
            raise exc
        h = F.SampledFactor("raising_approx", inputs={"x": Gaussian}, output=("y", Gaussian),
                            sampler=lambda v, rng: v["x"], approximate=approx)
        with pytest.raises(F.FactorCodeError, match=f"factor 'raising_approx': its approximation raised "
                                                    f"{type(exc).__name__}") as e:
            h.reference_belief(inc, "x")
        assert e.value.__cause__ is exc
    # a complex output lost its imaginary part: refused
    g = F.SampledFactor("complex_sampler", inputs={"x": Gaussian}, output=("y", Gaussian),
                        sampler=lambda v, rng: v["x"] + 1j)
    with pytest.raises(ValueError, match="returned complex128 values"):
        ImportanceSamplingOracle(g, n_samples=1000, random_state=0).belief(inc, "x")


@pytest.mark.parametrize("kwargs, match", [
    ({"inputs": {}}, "at least one input"),
    ({"inputs": {1: Gaussian}}, "variable name 1 .* identifier"),
    ({"inputs": {"a.b": Gaussian}}, "variable name 'a.b' .* identifier"),
    ({"output": ("z", type("MyGaussian", (Gaussian,), {}))}, "family of variable 'z' must be one of kjit's"),
    ({"sampler": None}, "`sampler` must be a callable"),
    ({"output": "z"}, r"`output` must be a \(name, Family\) pair"),  # (was: "not enough values to unpack")
    ({"output": "zz"}, r"`output` must be a \(name, Family\) pair"),  # (was: "family of variable 'z' … got 'z'")
])
def test_a_sampled_factor_that_could_not_be_served_is_refused_at_once(kwargs, match):
    """Found by an audit: each of these was accepted, then failed later — a 500 at POST /v1/operators
    (a variable named 1), a job failing after its whole oracle run (an unregistered Family subclass),
    every call failing (no inputs: the sampler never learns the sample size)."""
    spec = {"name": "odd", "inputs": {"x": Gaussian}, "output": ("z", Gaussian),
            "sampler": lambda v, rng: v["x"], **kwargs}
    with pytest.raises(ValueError, match=match):
        F.SampledFactor(**spec)


def test_a_factory_that_normalises_a_parameter_still_comes_back_as_itself(monkeypatch):
    """get_factor compares the parameters it was given with params(); a factory that keeps a tuple
    as a list reports the same factor, and rebuilding it from params() gives it back: accepted (found
    in review: refused)."""

    class Weights(F.Factor):
        name = "weights_tuple"
        inputs, output = ("x",), "y"
        families = {"x": Gaussian, "y": Gaussian}

        def __init__(self, w=(1.0,)):
            self.w = [float(v) for v in w]

        def params(self):
            return {"w": list(self.w)}

        def sample(self, inputs, size, rng):
            return inputs["x"] * sum(self.w)

    class Lowercase(Weights):
        name = "weights_case"

        def __init__(self, w=(1.0,), kind="sum"):
            super().__init__(w)
            self.kind = kind.lower()

        def params(self):
            return {"w": list(self.w), "kind": self.kind}

    monkeypatch.setitem(F._REGISTRY, "weights_tuple", Weights)
    monkeypatch.setitem(F._REGISTRY, "weights_case", Lowercase)
    assert F.get_factor("weights_tuple", w=(1, 3)).w == [1.0, 3.0]
    assert F.get_factor("weights_case", kind="SUM").kind == "sum"  # (rebuilt from params(): the same)


def test_a_served_default_whose_name_no_operator_can_have_is_refused_before_training(tmp_path, clean_registry):
    """A plugin factor named "MyShift" that serves x by default: its operator name "MyShift-x" breaks the store's
    naming rule.  Before, the server trained it, then exited on the name — at every start, the built-in defaults
    never trained (audit, forty-third session).  Now the start is refused at once, naming the factor."""
    from service.server import ensure_defaults
    from service.settings import Settings

    plugins = tmp_path / "plugins"
    _write_plugin(plugins, "kjit_test_plugin_upper", "MyShift", entry_point=False)
    sys.path.insert(0, str(plugins))
    store = tmp_path / "store"
    settings = Settings(store=store, factors=("kjit_test_plugin_upper",), default_n_train=60, default_n_inner=20,
                        default_n_outer=40)
    with pytest.raises(ValueError, match=r"'MyShift-x' \(factor 'MyShift', its served recipient 'x'\) is not a valid "
                                         r"operator name.*lower-case name"):
        ensure_defaults(settings, progress=False)
    assert not (store / "operators").exists() or not any((store / "operators").iterdir())  # nothing trained
