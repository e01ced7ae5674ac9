"""Tests for kjit.persistence: versioned .npz operator files that never unpickle (issue 4)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest

from kjit.factors import Logistic
from kjit.families import Beta, Gaussian
from kjit.operators import KernelOperator
from kjit.oracles import QuadratureOracle
from kjit import persistence
from kjit.persistence import FORMAT, FORMAT_VERSION, dumps_state, load_operator, loads_state, save_operator
from kjit.training import make_training_set

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

# explicit grids, so the numbers quoted here do not move with the library defaults
PRIOR_VARS = (0.1, 1.0, 10.0, 100.0, 1e3, 1e4)
NOISE_VARS = tuple(10.0 ** np.arange(-8.0, -0.5, 1.0))
KW = dict(n_inner=50, n_outer=100, inner_factors=(0.25, 1.0), width_factors=(0.5, 2.0),
          prior_vars=PRIOR_VARS, noise_vars=NOISE_VARS, random_state=0)


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    with (threadpool_limits(limits=1) if threadpool_limits else contextlib.nullcontext()):
        yield


def sampler(n, rng):
    mean = rng.uniform(-3.0, 3.0, n)
    var = np.exp(rng.uniform(np.log(0.1), np.log(3.0), n))
    label = rng.random(n) < 0.5
    return {"x": Gaussian(mean, var), "z": Beta(np.where(label, 2.0, 1.0), np.where(label, 1.0, 2.0))}


@pytest.fixture(scope="module")
def sets():
    f = Logistic()
    oracle = QuadratureOracle(f)
    return (make_training_set(f, "x", sampler, oracle, n=300, random_state=0),
            make_training_set(f, "x", sampler, oracle, n=200, random_state=1))


@pytest.fixture(scope="module")
def op(sets):
    return KernelOperator(Logistic(), "x", **KW).fit(sets[0])


@pytest.fixture(scope="module")
def probe():
    rng = np.random.default_rng(9)
    inc = sampler(100, rng)
    far = {"x": Gaussian(rng.uniform(8, 20, 20), 1.0), "z": Beta(np.full(20, 2.0), 1.0)}
    return {v: type(inc[v]).concatenate([inc[v], far[v]]) for v in inc}


def assert_bit_identical(a, b, inc):
    qa, ua = a.predict(inc)
    qb, ub = b.predict(inc)
    for pa, pb in zip(qa.params, qb.params):
        assert np.array_equal(pa, pb)
    assert np.array_equal(ua, ub)
    ma, mb = a.message(inc), b.message(inc)
    for pa, pb in zip(ma.params, mb.params):
        assert np.array_equal(pa, pb)


# ====================================================================== round trip


def test_kernel_operator_round_trip_is_bit_identical(op, probe, tmp_path):
    path = tmp_path / "op.npz"
    save_operator(op, path)
    loaded = load_operator(path)
    assert isinstance(loaded, KernelOperator) and loaded is not op
    assert_bit_identical(op, loaded, probe)
    assert loaded.hyperparameters() == op.hyperparameters()
    assert loaded.search_ == op.search_ and loaded.n_train_ == op.n_train_ == 300
    assert (loaded.to, loaded.n_inner, loaded.n_outer, loaded.treatment) == ("x", 50, 100, op.treatment)
    # a file of plain arrays plus one JSON header
    with np.load(path, allow_pickle=False) as z:
        assert "__header__" in z.files
        assert all(z[name].dtype != object for name in z.files)
        header = json.loads(str(z["__header__"]))
    assert header["format"] == FORMAT and header["format_version"] == FORMAT_VERSION
    assert header["kind"] == "KernelOperator" and "kjit_version" in header
    # metadata named by issue 4: factor, direction, hyperparameters, training-set size
    scalars = header["scalars"]
    assert scalars["params/factor"] == "logistic" and scalars["params/to"] == "x"
    assert scalars["fitted/prior_var"] == op.prior_var_ and scalars["blr/n"] == 300


def test_round_trip_after_online_updates_and_float32(sets, probe, tmp_path):
    train, extra = sets
    for dtype in (np.float64, np.float32):
        op = KernelOperator(Logistic(), "x", dtype=dtype, **KW).fit(train)
        op.partial_fit(extra.subset(np.arange(7)))  # Woodbury rows still buffered in the BLR
        save_operator(op, tmp_path / "op.npz")
        loaded = load_operator(tmp_path / "op.npz")
        assert loaded.dtype == np.dtype(dtype) and loaded.n_train_ == 307
        assert_bit_identical(op, loaded, probe)
        # and both keep learning identically
        op.partial_fit(extra.subset(np.arange(7, 30)))
        loaded.partial_fit(extra.subset(np.arange(7, 30)))
        assert_bit_identical(op, loaded, probe)


def test_bytes_round_trip(op, probe):
    kind, state = loads_state(dumps_state("KernelOperator", op.state_dict()))
    assert kind == "KernelOperator"
    assert_bit_identical(op, KernelOperator.from_state_dict(state), probe)


# ====================================================================== refusals


def _npz_bytes(header=None, **arrays):
    buf = io.BytesIO()
    if header is not None:
        arrays["__header__"] = np.array(header if isinstance(header, str) else json.dumps(header))
    np.savez(buf, **arrays)
    return buf.getvalue()


def _header(**over):
    h = {"format": FORMAT, "format_version": FORMAT_VERSION, "kjit_version": "0", "kind": "KernelOperator",
         "scalars": {}}
    h.update(over)
    return h


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case, data, match", [
    ("text", b"this is not an operator\n", "not a kjit operator file"),
    ("empty", b"", "not a kjit operator file"),
    ("no header", _npz_bytes(a=np.zeros(3)), "no header"),
    ("header not json", _npz_bytes("{not json"), "unreadable operator header"),
    ("wrong format", _npz_bytes(_header(format="kjit-training-set")), "format"),
    ("no format", _npz_bytes({"format_version": 1}), "not a kjit operator file"),
    ("other version", _npz_bytes(_header(format_version=2)), "version 2 is not supported"),
    ("version as string", _npz_bytes(_header(format_version="1")), "version"),
    ("unknown kind", _npz_bytes(_header(kind="RandomForestOperator")), "unknown operator kind"),
])
def test_refuses_files_it_does_not_understand(case, data, match, tmp_path):
    path = _write(tmp_path / "bad.npz", data)
    with pytest.raises(ValueError, match=match):
        load_operator(path)
    if case != "unknown kind":  # loads_state returns the kind; load_operator judges it
        with pytest.raises(ValueError, match=match):
            loads_state(data)


def test_refuses_a_plain_npy_file_with_value_error(tmp_path):
    buf = io.BytesIO()
    np.save(buf, np.arange(3.0))
    path = _write(tmp_path / "plain.npy", buf.getvalue())
    with pytest.raises(ValueError, match="not a kjit operator file"):
        load_operator(path)


def test_refuses_a_truncated_file(op, tmp_path):
    data = dumps_state("KernelOperator", op.state_dict())
    path = _write(tmp_path / "cut.npz", data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a kjit operator file"):
        load_operator(path)


def test_refuses_a_file_with_missing_state(tmp_path):
    path = _write(tmp_path / "empty_state.npz", _npz_bytes(_header()))
    with pytest.raises(ValueError, match="missing"):
        load_operator(path)


@pytest.mark.parametrize("header", [
    {"format": FORMAT, "format_version": FORMAT_VERSION, "scalars": {}},  # no kind
    {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "KernelOperator"},  # no scalars
    ["kjit-operator", 1],  # not an object
])
def test_refuses_malformed_headers_with_value_error(header, tmp_path):
    path = _write(tmp_path / "hdr.npz", _npz_bytes(header))
    with pytest.raises(ValueError):
        load_operator(path)


def test_refuses_a_corrupted_entry_with_value_error(op, tmp_path):
    data = bytearray(dumps_state("KernelOperator", op.state_dict()))
    i = data.find(b"blr/Sigma.npy")
    assert i > 0
    data[i + 400] ^= 0xFF  # inside the stored (uncompressed) array bytes
    path = _write(tmp_path / "corrupt.npz", bytes(data))
    with pytest.raises(ValueError):
        load_operator(path)


def _altered(op, change):
    """``op``'s saved state with ``change(state)`` applied, written and read back."""
    import copy

    state = copy.deepcopy(op.state_dict())
    change(state)
    return loads_state(dumps_state("KernelOperator", state))[1]


def _set(path, value):
    def change(state):
        d = state
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return change


@pytest.mark.parametrize("path, value, field", [
    (("blr", "Sigma"), lambda a: np.full_like(a, np.nan), "Sigma"),
    (("blr", "coef"), lambda a: np.where(np.arange(a.size).reshape(a.shape) == 3, np.inf, a), "coef"),
    (("blr", "Sigma"), lambda a: -a, "Sigma"),
    (("fitted", "y_scale"), lambda a: 0 * a, "y_scale"),
    (("fitted", "y_scale"), lambda a: -a, "y_scale"),
    (("fitted", "y_scale"), lambda a: np.ones(7), "y_scale"),
    (("fitted", "y_mean"), lambda a: np.full_like(a, np.nan), "y_mean"),
    (("fitted", "noise_var"), float("nan"), "noise_var"),
    (("fitted", "prior_var"), -1.0, "prior_var"),
    (("fitted", "search"), "x{", "search"),
    (("params", "factor_params"), "{", "factor_params"),
    (("params", "factor_params"), "[1]", "factor_params"),
    (("fitted", "canonical"), True, "canonical"),
])
def test_a_damaged_state_is_refused_at_load_naming_the_entry(op, path, value, field):
    """Found by an audit: these loaded, and the operator answered NaN or −inf log variances (taken
    as confident by the just-in-time rule), a far row as confident, or failed only at its first
    prediction with a numpy error."""
    state = _altered(op, _set(path, value))
    with pytest.raises(ValueError, match=field if field != "canonical" else "canonical frame"):
        KernelOperator.from_state_dict(state)
    # (the unaltered state loads and predicts as the operator does)
    again = KernelOperator.from_state_dict(_altered(op, lambda s: None))
    inc = {"x": Gaussian([0.0, 1.0], [1.0, 2.0]), "z": Beta([2.0, 1.0], [1.0, 3.0])}
    np.testing.assert_array_equal(again.predict(inc)[1], op.predict(inc)[1])


def test_a_nan_log_variance_is_consulted_by_the_jit(op):
    """Whatever makes a prediction's variance NaN, the just-in-time rule consults that row."""
    from kjit.operators import JITOperator

    jit = JITOperator(op, QuadratureOracle(Logistic()), threshold=1e9)  # (nothing is above this threshold)
    inc = {"x": Gaussian([0.0, 1.0], [1.0, 2.0]), "z": Beta([2.0, 1.0], [1.0, 3.0])}
    assert not jit.screen(inc)[2].any()
    jit.operator = KernelOperator.from_state_dict(op.state_dict())
    blr = jit.operator.blr_
    blr.Sigma_ = np.full_like(blr.Sigma_, np.nan)  # (altered in memory: loading refuses it)
    assert jit.screen(inc)[2].all()


# -------------------------------------------------------------- never unpickles

MARKER_ENV = "KJIT_TEST_PICKLE_MARKER"


def _side_effect(path):
    """What a malicious pickle would run at load time: here, create a marker file."""
    with open(path, "w") as fh:
        fh.write("unpickled!")
    return 0


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (_side_effect, (self.path,))


def _pickled_npz(header, marker, entry="blr/coef"):
    buf = io.BytesIO()
    arrays = {entry: np.array([_Payload(marker)], dtype=object)}
    if header is not None:
        arrays["__header__"] = np.array(json.dumps(header))
    np.savez(buf, **arrays)  # numpy pickles object arrays into the .npy
    return buf.getvalue()


@pytest.mark.parametrize("where", ["entry", "header", "whole file"])
def test_never_unpickles(op, where, tmp_path):
    marker = tmp_path / f"pwned-{where.replace(' ', '-')}"
    if where == "whole file":  # a bare pickle, as np.save(allow_pickle=True) of an object would write
        data = pickle.dumps(_Payload(marker))
        path = _write(tmp_path / "evil.pkl", data)
        with pytest.raises(ValueError, match="not a kjit operator file"):
            load_operator(path)
        with pytest.raises(ValueError, match="not a kjit operator file"):
            loads_state(data)
        assert not marker.exists(), "the pickled payload ran"
        with open(path, "rb") as fh:  # control
            np.load(fh, allow_pickle=True)
        assert marker.read_text() == "unpickled!"
        return
    if where == "entry":
        # a fully valid operator file with one extra pickled entry
        good = dumps_state("KernelOperator", op.state_dict())
        with zipfile.ZipFile(io.BytesIO(_pickled_npz(None, marker, "blr/evil"))) as zf:
            evil = zf.read("blr/evil.npy")
        buf = io.BytesIO(good)
        with zipfile.ZipFile(buf, "a") as zf:
            zf.writestr("blr/evil.npy", evil)
        data = buf.getvalue()
        match = "cannot be loaded without pickle"
    else:
        buf = io.BytesIO()
        np.savez(buf, __header__=np.array([_Payload(marker)], dtype=object))
        data = buf.getvalue()
        match = "header"
    path = _write(tmp_path / f"evil-{where}.npz", data)
    with pytest.raises(ValueError, match=match):
        load_operator(path)
    with pytest.raises(ValueError, match=match):
        loads_state(data)
    assert not marker.exists(), "the pickled payload ran"
    # control: the file really is dangerous — unpickling it runs the payload
    with np.load(path, allow_pickle=True) as z:
        name = "blr/evil" if where == "entry" else "__header__"
        z[name]
    assert marker.read_text() == "unpickled!"


def test_refuses_to_write_object_arrays(op, tmp_path):
    state = op.state_dict()
    state["fitted"]["evil"] = np.array([object()], dtype=object)
    with pytest.raises(ValueError, match="object array"):
        dumps_state("KernelOperator", state)


# ====================================================================== atomic writes


def test_writes_atomically_and_overwrite_replaces(op, sets, probe, tmp_path):
    d = tmp_path / "ops"
    d.mkdir()
    path = d / "op.npz"
    save_operator(op, path)
    assert sorted(os.listdir(d)) == ["op.npz"]  # no temp file left behind
    other = KernelOperator(Logistic(), "x", **{**KW, "random_state": 1}).fit(sets[1])
    save_operator(other, path)  # overwrite
    assert sorted(os.listdir(d)) == ["op.npz"]
    assert_bit_identical(load_operator(path), other, probe)
    # str paths work too
    save_operator(op, str(path))
    assert_bit_identical(load_operator(str(path)), op, probe)


def test_failed_write_leaves_the_old_file_and_no_temp(op, sets, probe, tmp_path, monkeypatch):
    path = tmp_path / "op.npz"
    save_operator(op, path)
    before = path.read_bytes()
    other = KernelOperator(Logistic(), "x", **{**KW, "random_state": 1}).fit(sets[1])

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(persistence.os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        save_operator(other, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["op.npz"]
    assert_bit_identical(load_operator(path), op, probe)
    # a state that cannot be serialised writes nothing at all
    with pytest.raises(ValueError, match="not fitted"):
        save_operator(KernelOperator(Logistic(), "x"), tmp_path / "new.npz")
    assert sorted(os.listdir(tmp_path)) == ["op.npz"]
