#!/usr/bin/env python
"""The per-message importance sampler's cost against its chunk size (``chunk_elements``).

Protocol
--------
``MessageImportanceSampler`` works on (particles × messages) arrays of at most ``chunk_elements``
particles per chunk (a message needing more is a chunk of its own).  A noisy product z = x·y + ε
(ε ~ N(0, 0.3²); the example plugin's factor), ``--n`` messages with means U(−2, 2) and variances
log-uniform [0.1, 2] on x, y and z (seed 1), beliefs to z at the default target standard error
(1e-2).  For each chunk size in ``--chunks``, interleaved over ``--repeat`` rounds (these machines
are shared and noisy), one JSON line per call with the seconds, µs per message and particles
used; a last line with the best time per chunk size and its ratio to the largest size's.  The
particles differ by chunk size (the chunks draw from one generator in a different order), the
work does not: the particle counts are printed.

    python benchmarks/sampler_chunks.py [--quick] [--n 200] [--chunks 2000000 262144 65536 16384]

``--quick``: 40 messages, 2 rounds.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kjit.factors import SampledFactor
from kjit.families import Gaussian
from kjit.oracles import MessageImportanceSampler


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2_000_000, 262_144, 65_536, 16_384])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="40 messages, 2 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.repeat = 40, 2
    f = SampledFactor("noisy_product_bench", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
                      sampler=lambda v, rng: v["x"] * v["y"] + 0.3 * rng.standard_normal(v["x"].shape))
    rng = np.random.default_rng(1)
    inc = {v: Gaussian(rng.uniform(-2, 2, args.n), np.exp(rng.uniform(np.log(0.1), np.log(2), args.n)))
           for v in "xyz"}
    best = {}
    for rep in range(args.repeat):
        for ce in args.chunks:
            o = MessageImportanceSampler(f, random_state=0, chunk_elements=ce)
            t = time.perf_counter()
            o.belief(inc, "z")
            dt = time.perf_counter() - t
            best[ce] = min(best.get(ce, np.inf), dt)
            print(json.dumps({"chunk_elements": ce, "round": rep, "seconds": round(dt, 3),
                              "us_per_msg": round(1e6 * dt / args.n), "particles": int(o.last_n_samples_.sum())}),
                  flush=True)
    base = best[max(args.chunks)]
    print(json.dumps({"summary": True, "n": args.n, "best_seconds": {str(k): round(v, 3) for k, v in best.items()},
                      "ratio_to_largest": {str(k): round(v / base, 3) for k, v in best.items()}}))


if __name__ == "__main__":
    main()
