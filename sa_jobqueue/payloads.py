"""Payloads: what a job's JSON payload may hold, checked before anything is sent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import InvalidArgumentError, shown
from .jsontext import compact_json

MAX_PAYLOAD_BYTES = 1024 * 1024


def _payload_strings(payload: Any) -> str | None:
    """Walk a payload json.dumps accepted (so finite, acyclic and not too
    deep); describe the first key or string PostgreSQL cannot take, or None."""
    stack: list[Any] = [payload]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return f"has a string with a NUL character (\\x00), {shown(value)}; PostgreSQL jsonb cannot hold it"
        elif isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    return (
                        f"has a {type(key).__name__} key, {shown(key)}; JSON object keys are strings "
                        "(json.dumps would silently turn it into one)"
                    )
                if "\x00" in key:
                    return f"has a key with a NUL character (\\x00), {shown(key)}; PostgreSQL jsonb cannot hold it"
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return None


def check_payload(payload: Any, *, max_bytes: int = MAX_PAYLOAD_BYTES, parameter: str = "payload") -> Any:
    """Return the payload if it is strict JSON PostgreSQL can store; raise naming ``parameter``.
    What is refused: :func:`encode_payload`."""
    encode_payload(payload, max_bytes=max_bytes, parameter=parameter)
    return payload


def encode_payload(payload: Any, *, max_bytes: int = MAX_PAYLOAD_BYTES, parameter: str = "payload") -> str:
    """The payload's :func:`compact_json` if it is strict JSON PostgreSQL can store; raise naming ``parameter``.

    Refused: anything json.dumps cannot encode (objects, sets, bytes,
    Decimal, datetime…: a payload is data, never code, so nothing is
    pickled), NaN and infinity, circular or too deeply nested structures,
    non-string object keys, NUL characters and lone surrogates in any key or
    string, and an encoding longer than ``max_bytes`` (compact separators,
    UTF-8).
    """
    try:
        encoded = compact_json(payload)
    except RecursionError:
        raise InvalidArgumentError(parameter, "is nested too deeply to encode as JSON") from None
    except ValueError as exc:  # NaN or infinity, a circular reference, a too long int
        raise InvalidArgumentError(parameter, f"is not valid JSON: {exc}") from None
    except TypeError as exc:
        raise InvalidArgumentError(parameter, f"is not JSON serializable: {exc}") from None
    try:
        size = len(encoded) if encoded.isascii() else len(encoded.encode("utf-8"))  # ASCII: one byte each
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            parameter,
            f"contains a lone surrogate ({encoded[exc.start]!r}) in a key or string: not valid "
            "Unicode (undecodable bytes or broken UTF-16), so it cannot be encoded as UTF-8",
        ) from None
    if size > max_bytes:
        raise InvalidArgumentError(
            parameter,
            f"is {size} bytes as JSON, more than the limit of {max_bytes}; store large data "
            "elsewhere and enqueue a reference to it",
        )
    problem = _payload_strings(payload)
    if problem is not None:
        raise InvalidArgumentError(parameter, problem)
    return encoded


# A job's meta (the trace context of the enqueuing code, say) is small: it travels with every claim, as the payload.
MAX_META_BYTES = 64 * 1024


def check_meta(meta: Any) -> dict[str, Any]:
    """A job's ``meta``: a JSON object (a mapping with string keys) PostgreSQL can store,
    at most :data:`MAX_META_BYTES` encoded; raise naming ``meta``."""
    if not isinstance(meta, Mapping):
        raise InvalidArgumentError("meta", f"must be a JSON object (a dict with string keys) or None, "
                                   f"got {type(meta).__name__}")
    checked: dict[str, Any] = check_payload(dict(meta), max_bytes=MAX_META_BYTES, parameter="meta")
    return checked
