"""Learning message operators: the kernel operator (:mod:`.kernel_operator`), its thresholds
(:mod:`.calibration`), the ensemble spread (:mod:`.ensemble`), the rows to consult
(:mod:`.consultation`) and the just-in-time operator (:mod:`.jit`); their public names are
re-exported by :mod:`kjit.operators`."""
