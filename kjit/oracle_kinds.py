"""The names of the oracles a training run can take (``kjit train --oracle``, the service's
``oracle``), in a module of their own that imports nothing: the CLI builds its parser from them
without importing :mod:`kjit.oracles` (and scipy with it: 0.31 s instead of 0.08 s for every
``kjit`` command).  :func:`kjit.oracles.make_oracle` builds them."""

#: ``auto`` is the factor's exact rule for the recipient where it has one, else the per-message sampler
ORACLE_KINDS = ("auto", "quadrature", "importance_sampling", "message_sampler")
