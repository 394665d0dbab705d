"""Who may see the dashboard and act through it, checked the same way by every web layer.

:class:`Gate` holds the app's ``authorize`` hook, its ``read_only`` flag and
its CSRF key; the ASGI app and the Flask blueprint ask it, per request,
whether a page may be shown and whether an action may run, and give the
browser its CSRF cookie (:mod:`sa_jobqueue.dashboard.actions`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .csrf import csrf_token, csrf_valid
from .page import Rendered

NOT_OPEN = "This dashboard is not open to you."
READ_ONLY = "This dashboard is read-only: it takes no action."
BAD_TOKEN = "The form's CSRF token is missing or wrong: open the page again and retry."


@dataclass
class Gate:
    """The checks of one dashboard: ``authorize(request)`` (None: everyone), ``read_only``, the CSRF
    ``key``; its refusals are pages made by ``refuse``."""

    refuse: Callable[[int, str, str], Rendered]  # an error page: status, heading, message (Views.error)
    authorize: Callable[[Any], bool] | None = None
    read_only: bool = False
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def page(self, request: Any) -> Rendered | None:
        """None when ``request`` may see a page; else the 403 page to answer with."""
        if self.authorize is not None and not self.authorize(request):
            return self.refuse(403, "Not allowed", NOT_OPEN)
        return None

    def action(self, request: Any, cookie: str | None = None, token: str | None = None, *,
               posted: bool = False) -> Rendered | None:
        """None when ``request`` may ask for an action (``posted``: run it, with the CSRF
        ``token`` of the browser's ``cookie``); else the 403 page to answer with."""
        refused = self.page(request)
        if refused is not None:
            return refused
        if self.read_only:
            return self.refuse(403, "Not allowed", READ_ONLY)
        if posted and not csrf_valid(self.key, cookie, token):
            return self.refuse(403, "Not allowed", BAD_TOKEN)
        return None

    def token(self, cookie: str) -> str:
        """The CSRF token of a browser whose cookie is ``cookie``."""
        return csrf_token(self.key, cookie)


__all__ = ["BAD_TOKEN", "NOT_OPEN", "READ_ONLY", "Gate"]
