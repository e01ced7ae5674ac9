"""Versioned state files of plain arrays plus JSON metadata (the format under :mod:`kjit.persistence`).

File format (``.npz``, written atomically): one array per numeric state entry, named
``<component>/<key>``, and a ``__header__`` array holding one JSON string: the format name
and version, the kjit version, the operator class, and every scalar/string state entry.
Loading uses ``allow_pickle=False`` — an object array in the file is refused — and checks
the format name and version before anything else; a file it does not understand is
refused with a :class:`ValueError` that says why.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from typing import Any, Mapping

import numpy as np

from . import __version__

__all__ = ["dumps_state", "loads_state", "StateReader", "atomic_write", "FORMAT", "FORMAT_VERSION"]

FORMAT = "kjit-operator"
FORMAT_VERSION = 1


class StateReader:
    """Typed access to a state dict (or an ``np.load`` npz) with errors that name the key."""

    def __init__(self, d: Mapping[str, Any]):
        self.d = d

    def get(self, key):
        try:
            return self.d[key]
        except KeyError:
            raise ValueError(f"state dict is missing key {key!r}") from None

    def scalar(self, key, kind):
        value = np.asarray(self.get(key))
        if value.shape != ():
            raise ValueError(f"state dict key {key!r} must be a scalar, got shape {value.shape}")
        return kind(value.item())

    def opt(self, key, kind):
        return self.scalar(key, kind) if key in self.d else None


def _split(state: Mapping[str, Any], prefix: str, arrays: dict, scalars: dict) -> None:
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _split(value, name + "/", arrays, scalars)
        elif isinstance(value, np.ndarray) and value.ndim > 0:
            if value.dtype == object:
                raise ValueError(f"state entry {name!r} is an object array; only numeric arrays are stored")
            arrays[name] = value
        else:
            if isinstance(value, np.generic):
                value = value.item()
            elif isinstance(value, np.ndarray):
                value = value.item()
            scalars[name] = value


def _join(arrays: Mapping[str, np.ndarray], scalars: Mapping[str, Any]) -> dict:
    out: dict = {}
    for name, value in list(scalars.items()) + list(arrays.items()):
        parts = name.split("/")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def dumps_state(kind: str, state: Mapping[str, Any]) -> bytes:
    """Serialise a nested state dict (arrays and JSON scalars) to ``.npz`` bytes."""
    arrays: dict = {}
    scalars: dict = {}
    _split(state, "", arrays, scalars)
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "kjit_version": __version__,
              "kind": kind, "scalars": scalars}
    buf = io.BytesIO()
    np.savez(buf, __header__=np.array(json.dumps(header)), **arrays)
    return buf.getvalue()


def loads_state(data: bytes, source: str = "<bytes>") -> tuple[str, dict]:
    """Inverse of :func:`dumps_state`: ``(kind, state)``; refuses anything it does not understand."""
    try:
        z = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # not a numpy file at all
        raise ValueError(f"{source}: not a kjit operator file ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(f"{source}: not a kjit operator file (a bare .npy array, not an .npz archive)")
    try:
        with z:
            if "__header__" not in z.files:
                raise ValueError(f"{source}: not a kjit operator file (no header)")
            try:
                header = json.loads(str(z["__header__"]))
            except ValueError as exc:
                raise ValueError(f"{source}: unreadable operator header ({exc})") from None
            if not isinstance(header, dict):
                raise ValueError(f"{source}: operator header is not a JSON object")
            if header.get("format") != FORMAT:
                raise ValueError(f"{source}: not a kjit operator file (format {header.get('format')!r})")
            if header.get("format_version") != FORMAT_VERSION:
                raise ValueError(
                    f"{source}: operator file format version {header.get('format_version')!r} is not supported "
                    f"by kjit {__version__} (reads version {FORMAT_VERSION})"
                )
            if not isinstance(header.get("kind"), str) or not isinstance(header.get("scalars"), dict):
                raise ValueError(f"{source}: operator header lacks `kind` or `scalars`")
            arrays = {}
            for name in z.files:
                if name == "__header__":
                    continue
                try:
                    arrays[name] = z[name]
                except ValueError as exc:  # object arrays need pickle: refused
                    raise ValueError(
                        f"{source}: entry {name!r} cannot be loaded without pickle: refused ({exc})"
                    ) from None
    except ValueError:
        raise
    except Exception as exc:  # corrupted archive (bad CRC, truncated member, ...)
        raise ValueError(f"{source}: corrupted operator file ({exc.__class__.__name__}: {exc})") from None
    return header["kind"], _join(arrays, header["scalars"])


def atomic_write(path, data: bytes) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
