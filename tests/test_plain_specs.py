"""The checks of a plain spec (sa_jobqueue.spec.plain_fields: task, queue and payload, every
other field at its default) give what checked_row gives, and JobSpec's written-out __init__
behaves as the one dataclasses would generate. No database."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from sa_jobqueue import Dedupe, InvalidArgumentError, JobSpec
from sa_jobqueue.spec import checked_row, plain_fields

LONG = "x" * 300


def _outcome(check: Any, spec: Any) -> Any:
    try:
        return check(spec)
    except InvalidArgumentError as exc:
        return ("refused", exc.parameter, str(exc))


def _from_row(spec: Any) -> Any:
    row, text = checked_row(spec, frozenset())
    return row["task"], row["queue"], text


PLAIN = [
    JobSpec("noop"), JobSpec("noop", None), JobSpec("noop", {"n": 1}, queue="q"), JobSpec("t", [1, "two", None]),
    JobSpec("émoji ✓", {"ключ": "値", "nested": {"list": [1.5, True]}}), JobSpec("t", "a string payload"),
    JobSpec("t", {"a": 1}, "q", 0, None, None, None, None, {}, None),
    # refused, each for its first problem, as checked_row refuses it
    JobSpec(""), JobSpec("   "), JobSpec(LONG), JobSpec("a\x00b"), JobSpec("caf\udce9"), JobSpec(5),  # type: ignore[arg-type]
    JobSpec("t", queue=""), JobSpec("t", queue=LONG), JobSpec("t", queue=None),  # type: ignore[arg-type]
    JobSpec("t", {"x": float("nan")}), JobSpec("t", {"x": object()}), JobSpec("t", {"x": "a\x00b"}),
    JobSpec("t", {"a\x00": 1}), JobSpec("t", {1: "int key"}), JobSpec("t", {"x": "caf\udce9"}),
    JobSpec("t", {"x": "y" * (1024 * 1024)}), JobSpec("", {"x": float("inf")}), JobSpec(5, queue=""),  # type: ignore[arg-type]
]

NOT_PLAIN = [
    JobSpec("t", priority=1), JobSpec("t", priority=False), JobSpec("t", priority=0.0),  # type: ignore[arg-type]
    JobSpec("t", run_at=datetime(2030, 1, 1, tzinfo=timezone.utc)), JobSpec("t", delay=0), JobSpec("t", delay=5),
    JobSpec("t", max_attempts=3), JobSpec("t", dedupe_key="k"), JobSpec("t", dedupe_key=Dedupe("k")),
    JobSpec("t", extra={"tenant": 1}), JobSpec("t", extra=None), JobSpec("t", meta={}),  # type: ignore[arg-type]
    JobSpec("", priority=1), {"task": "t"}, None,
]


@pytest.mark.parametrize("spec", PLAIN, ids=range(len(PLAIN)))
def test_a_plain_spec_is_checked_as_checked_row_checks_it(spec: JobSpec) -> None:
    assert _outcome(plain_fields, spec) == _outcome(_from_row, spec)


@pytest.mark.parametrize("spec", NOT_PLAIN, ids=range(len(NOT_PLAIN)))
def test_any_other_spec_is_left_to_checked_row(spec: Any) -> None:
    assert plain_fields(spec) is None


def test_a_payload_limit_is_the_callers() -> None:
    spec = JobSpec("t", {"x": "y" * 100})
    refused = _outcome(lambda s: plain_fields(s, max_payload_bytes=50), spec)
    assert refused == _outcome(lambda s: checked_row(s, frozenset(), max_payload_bytes=50), spec)
    assert refused[:2] == ("refused", "payload")


@dataclasses.dataclass(frozen=True)
class Generated:
    """JobSpec's fields, with the __init__ dataclasses writes."""

    task: str
    payload: Any = None
    queue: str = "default"
    priority: int = 0
    run_at: datetime | None = None
    delay: timedelta | float | None = None
    max_attempts: int | None = None
    dedupe_key: str | Dedupe | None = None
    extra: Any = dataclasses.field(default_factory=dict)
    meta: Any = None


def test_jobspec_is_built_as_a_generated_dataclass_would_build_it() -> None:
    assert [f.name for f in dataclasses.fields(JobSpec)] == [f.name for f in dataclasses.fields(Generated)]
    ours, theirs = inspect.signature(JobSpec).parameters, inspect.signature(Generated).parameters
    assert list(ours) == list(theirs)
    assert [(p.kind, repr(p.default)) for p in ours.values()] == [(p.kind, repr(p.default)) for p in theirs.values()]
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("t",), {}), (("t", {"a": 1}, "q", 3), {"max_attempts": 2}), (("t",), {"extra": {"c": 1}, "meta": {"m": 1}}),
        (("t", None, "q", 0, None, 5, None, "key", {}, None), {}), (("t",), {"extra": None}),
    ]
    for args, kwargs in calls:
        assert dataclasses.astuple(JobSpec(*args, **kwargs)) == dataclasses.astuple(Generated(*args, **kwargs))
    with pytest.raises(TypeError):
        JobSpec()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        JobSpec("t", nope=1)  # type: ignore[call-arg]


def test_jobspec_stays_a_frozen_value() -> None:
    spec = JobSpec("t", {"a": 1}, priority=2)
    assert spec == JobSpec("t", {"a": 1}, priority=2) and spec != JobSpec("t", {"a": 1})
    assert JobSpec("t").extra == {} and JobSpec("t").extra is not JobSpec("t").extra  # a dict of its own each
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.task = "u"  # type: ignore[misc]
    assert dataclasses.replace(spec, queue="q") == JobSpec("t", {"a": 1}, queue="q", priority=2)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert repr(JobSpec("t")).startswith("JobSpec(task='t', payload=None, queue='default', priority=0,")
    assert hash(JobSpec("t", 1, extra=None)) == hash(JobSpec("t", 1, extra=None))  # type: ignore[arg-type]
