"""JSON text as the queue sends it: compact, non-ASCII characters as themselves."""

from __future__ import annotations

import json
from typing import Any

# Built once: json.dumps with any option of its own builds a new encoder at every call.
_COMPACT = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def compact_json(value: Any) -> str:
    """``value`` as compact JSON text, non-ASCII characters as themselves: what COPY sends for a
    ``jsonb`` column, and how a payload is checked (:func:`~sa_jobqueue.payloads.encode_payload`).
    NaN and infinity raise ``ValueError``, as anything else JSON cannot hold raises ``TypeError``."""
    return _COMPACT.encode(value)


__all__ = ["compact_json"]
