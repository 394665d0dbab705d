"""A page to render, as the views answer it and the web layers render it. Plain values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rendered:
    """A page to render: ``template`` with ``context``, answered with ``status``."""

    template: str
    context: dict[str, Any]
    status: int = 200


__all__ = ["Rendered"]
