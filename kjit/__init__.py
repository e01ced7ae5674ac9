"""kjit: kernel-based just-in-time learning of expectation-propagation message operators."""

__version__ = "0.1.0"
