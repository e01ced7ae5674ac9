"""An example of a user's own factor, served with no edit to kjit (README: "Your own factor, served").

    KJIT_FACTORS=user_factors PYTHONPATH=plugins python -m kjit.cli serve   # or: docker compose up
                                                                            # (this directory is mounted at /plugins)

``noisy_product``: z = x·y + ε, ε ~ N(0, NOISE²), Gaussian messages on x, y and z.  It has no exact
rule, only a sampler: ``POST /v1/operators`` trains its operators with the per-message importance
sampler (``source.oracle`` "auto" → "message_sampler"), from the ranges given in the request or
from ``default_incoming`` below.
"""

import numpy as np

from kjit.factors import SampledFactor, register_factor
from kjit.families import Gaussian

NOISE = 0.3

noisy_product = SampledFactor(
    "noisy_product", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
    sampler=lambda v, rng: v["x"] * v["y"] + NOISE * rng.standard_normal(v["x"].shape))


def _default_incoming(n: int, rng: np.random.Generator) -> dict:
    """The messages training draws from when a request gives no ranges (``"distribution": "default"``)."""
    return {"x": Gaussian(rng.uniform(-2, 2, n), np.exp(rng.uniform(np.log(0.1), np.log(2), n))),
            "y": Gaussian(rng.uniform(-2, 2, n), np.exp(rng.uniform(np.log(0.1), np.log(2), n))),
            "z": Gaussian(rng.uniform(-3, 3, n), np.exp(rng.uniform(np.log(0.5), np.log(5), n)))}


noisy_product.default_incoming = _default_incoming
register_factor(noisy_product)
