"""Database URLs: the usual ``postgresql://`` form, driven by psycopg 3."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url


def psycopg_url(url: str | URL) -> URL:
    """Return ``url`` with the psycopg 3 driver.

    ``postgresql://…`` and ``postgres://…`` become ``postgresql+psycopg://…``;
    a URL that already names a driver is returned unchanged.
    """
    parsed = make_url(str(url).replace("postgres://", "postgresql://", 1)) if isinstance(url, str) else url
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed
