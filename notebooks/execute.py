#!/usr/bin/env python
"""Execute a notebook top to bottom with nbclient and write the executed copy.

    python notebooks/execute.py [NOTEBOOK] [--out DIR] [--timeout SECONDS]

The kernel is this Python interpreter (a kernelspec written to a temporary directory and put
first on JUPYTER_PATH), so the notebook sees the same environment as the caller — ``.venv``
under ``make notebook`` — whatever kernels the machine has registered.  The notebook runs with
its own directory as the working directory; the executed copy is written to ``DIR``
(default ``notebooks/out``) and the committed notebook is left untouched (outputs cleared).
Exit status 1, with the failing cell's error on stderr, if a cell raises.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_NOTEBOOK = HERE / "train_operator.ipynb"


def execute(notebook=DEFAULT_NOTEBOOK, out_dir=None, timeout: int = 900, env=None):
    """Run ``notebook``; returns ``(executed notebook node, path written, seconds)``.

    ``env``: extra environment variables for the kernel (e.g. ``KJIT_STORE``).
    """
    import nbformat
    from nbclient import NotebookClient

    notebook = Path(notebook).resolve()
    out_dir = Path(out_dir) if out_dir is not None else notebook.parent / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(notebook, as_version=4)
    saved = {k: os.environ.get(k) for k in ["JUPYTER_PATH", *(env or {})]}
    with tempfile.TemporaryDirectory(prefix="kjit-kernel-") as kdir:
        spec_dir = Path(kdir) / "kernels" / "python3"
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (kjit)", "language": "python",
        }))
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [kdir, saved["JUPYTER_PATH"]]))
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        try:
            client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                    resources={"metadata": {"path": str(notebook.parent)}})
            t0 = time.perf_counter()
            client.execute()
            seconds = time.perf_counter() - t0
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    path = out_dir / notebook.name
    nbformat.write(nb, path)
    return nb, path, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", nargs="?", default=str(DEFAULT_NOTEBOOK))
    ap.add_argument("--out", default=None, help="directory for the executed copy (default: notebooks/out)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell (default 900)")
    args = ap.parse_args(argv)
    try:
        from nbclient.exceptions import CellExecutionError
    except ImportError:
        print("execute.py: nbclient is not installed: pip install -e '.[notebook]' (or run `make notebook`)",
              file=sys.stderr)
        return 2
    try:
        _, path, seconds = execute(args.notebook, args.out, args.timeout)
    except CellExecutionError as exc:
        print(f"execute.py: a cell failed:\n{exc}", file=sys.stderr)
        return 1
    print(f"executed {args.notebook} in {seconds:.0f}s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
