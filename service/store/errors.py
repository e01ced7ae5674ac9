"""What the store's operations raise; the routes map each to one HTTP answer."""

from __future__ import annotations

__all__ = ["NotFound", "NotReady", "Conflict", "PersistError", "OracleFailure", "Unprocessable"]


class NotFound(LookupError):
    pass


class NotReady(RuntimeError):
    pass


class Conflict(RuntimeError):
    pass


class PersistError(RuntimeError):
    """An update was not made durable; ``unknown``: it may still have landed (shared store)."""

    def __init__(self, msg: str, unknown: bool = False):
        super().__init__(msg)
        self.unknown = unknown


class OracleFailure(RuntimeError):
    """The oracle could not answer; ``rows``: the request's rows it named, if it named them."""

    def __init__(self, message: str = "", rows=None):
        super().__init__(message)
        self.rows = rows


class Unprocessable(ValueError):
    """The input is valid but the numerics cannot carry it (nothing was changed); ``rows``: the
    request's rows the error named (e.g. kjit.operators.PredictionOverflowError), if it named them."""

    def __init__(self, message: str = "", rows=None):
        super().__init__(message)
        self.rows = rows

    @classmethod
    def of(cls, exc: BaseException) -> "Unprocessable":
        """The numeric error ``exc`` as the store's, with the rows it named."""
        return cls(str(exc), getattr(exc, "rows", None))


class SharedLogDamaged(ValueError):
    """A replica's shared log no longer holds what the replica applied (lost or rewritten records), or
    a record of it cannot be applied: the operator is reported failed (a request that finds it: 503)."""
