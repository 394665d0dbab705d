"""A web dashboard for sa_jobqueue's job tables (the ``dashboard`` extra).

::

    pip install 'sa_jobqueue[dashboard]'

:func:`create_app` is an ASGI app (Starlette) to mount in the app you run or
to serve on its own (``sa-jobqueue dashboard``); see docs/dashboard.md. The
core library never imports this package.
"""

from .asgi import create_app

__all__ = ["create_app"]
