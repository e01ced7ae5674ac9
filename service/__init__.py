"""kjit message-operator service (FastAPI).  Imports :mod:`kjit`; :mod:`kjit` never imports it
(except the ``kjit serve`` command, lazily).

``create_app(settings)`` builds the app; :class:`Settings` reads ``KJIT_*`` environment
variables; :func:`service.server.serve` is what ``kjit serve`` runs.
"""

from .app import create_app
from .settings import Settings

__all__ = ["create_app", "Settings"]
