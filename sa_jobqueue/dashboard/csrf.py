"""CSRF tokens: the HMAC, under the app's secret, of a random per-browser cookie.

A form posted from another site carries the cookie (the browser sends it)
but cannot know the token, so :func:`csrf_valid` refuses it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

CSRF_COOKIE = "sajq_csrf"


def new_cookie() -> str:
    """A fresh random value for the CSRF cookie."""
    return secrets.token_urlsafe(32)


def csrf_token(secret: bytes, cookie: str) -> str:
    """The token a form must carry for a browser whose CSRF cookie is ``cookie``."""
    return hmac.new(secret, cookie.encode(), hashlib.sha256).hexdigest()


def csrf_valid(secret: bytes, cookie: str | None, token: str | None) -> bool:
    """Whether ``token`` is the one for ``cookie`` (both given), compared in constant time."""
    return bool(cookie) and bool(token) and hmac.compare_digest(csrf_token(secret, cookie or ""), token or "")


__all__ = ["CSRF_COOKIE", "csrf_token", "csrf_valid", "new_cookie"]
