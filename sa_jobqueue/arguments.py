"""A handler's parameters: what the worker passes it, and how enqueue binds its arguments.

A handler is in one of two forms, told apart by its first parameter:

* **The arguments form** (the typed form)::

      @tasks.task
      def send_welcome(user_id: int, template: str = "welcome") -> None: ...

      @tasks.task
      def charge(ctx: JobContext, session: Session, order_id: int) -> None: ...

  Its parameters are the task's own arguments, given to ``task.enqueue``
  and stored as the job's payload: a JSON object of the arguments by name.
  It asks for more by annotation, on its leading parameters only (so that
  a type checker can take them off ``enqueue``'s parameters): a parameter
  annotated :class:`~sa_jobqueue.JobContext` gets the job (its id, attempt,
  queue), one annotated ``Session`` (``AsyncSession`` for an ``async def``)
  gets the job's session, whose writes commit with the job's completion.
* **The job form** (the form of every handler before tasks had
  arguments): the first parameter is named ``job`` (and not annotated
  ``JobContext``), or is ``*args``. It gets the job row, and the session
  as a second positional argument when it has one; its payload is
  ``job.payload``, whatever JSON the enqueue gave.
"""

from __future__ import annotations

import builtins
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.orm import Session

from .errors import InvalidArgumentError
from .job_context import JobContext
from .payloads import check_payload

__all__ = ["Parameters", "describe", "is_async_session_type", "parameters_of", "returns_value"]

Form = Literal["job", "arguments"]
Injected = Literal["context", "session"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
# Annotation names recognised even when they cannot be evaluated, so that a
# mistake (an import under TYPE_CHECKING) is an error, not a task argument.
_INJECTABLE_NAMES = {"JobContext": "context", "Session": "session", "AsyncSession": "session"}
_QUOTED = re.compile(r"'([^']+)'")


@dataclass(frozen=True)
class Parameters:
    """How the worker calls one handler, and what its enqueue takes.

    ``injected``: the leading parameters the worker fills, in order (the
    arguments form only). ``arguments``: the signature of the task's own
    arguments (the arguments form), None in the job form.
    """

    form: Form
    takes_session: bool
    injected: tuple[Injected, ...] = ()
    arguments: inspect.Signature | None = None
    by_keyword: bool = True  # every argument can be passed by name: the call needs no binding

    def bind(self, task: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The payload for a call ``task.enqueue(session, *args, **kwargs)``:
        the arguments by name, each checked to be JSON. Raises
        :class:`InvalidArgumentError` naming the parameter at fault."""
        if self.arguments is None:
            raise InvalidArgumentError(
                "task", f"{task!r} is in the job form (its handler takes the job): it has no arguments of its own. "
                "Enqueue it by name with a payload, repository.enqueue(session, name, payload), or give its handler "
                "parameters of its own")
        shown = f"{task}{describe(self.arguments)}"
        params = self.arguments.parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            for name in kwargs:  # a misspelt name first: it is why a required one looks missing
                if name not in params or params[name].kind in (
                        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
                    raise InvalidArgumentError(name, f"is not a parameter of {shown}")
        try:
            bound = self.arguments.bind(*args, **kwargs)
        except TypeError as exc:
            named = _QUOTED.search(str(exc))
            raise InvalidArgumentError(named.group(1) if named else "args", f"does not fit {shown}: {exc}") from None
        payload: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.arguments.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                for key, item in value.items():
                    payload[key] = check_payload(item, parameter=key)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                payload[name] = [check_payload(item, parameter=name) for item in value]
            else:
                payload[name] = check_payload(value, parameter=name)
        return payload

    def call(self, handler: Callable[..., Any], job: Any, session: Any) -> Any:
        """Call ``handler`` for ``job`` (with ``session``, the job's, or None) and return what it returns."""
        if self.form == "job":
            return handler(job, session) if self.takes_session else handler(job)
        leading = [JobContext(job) if kind == "context" else session for kind in self.injected]
        payload = job.payload
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise InvalidArgumentError(
                "payload", f"task {job.task!r} takes arguments, so its payload must be a JSON object of them by "
                f"name; job {job.id} has a {type(payload).__name__}")
        if self.by_keyword:
            return handler(*leading, **payload)
        assert self.arguments is not None
        bound = self._rebind(payload)
        return handler(*leading, *bound.args, **bound.kwargs)

    def _rebind(self, payload: dict[str, Any]) -> inspect.BoundArguments:
        """A payload back as the arguments of a signature with positional-only or ``*args`` parameters."""
        assert self.arguments is not None
        arguments: dict[str, Any] = {}
        rest = dict(payload)
        var_keyword = None
        for name, parameter in self.arguments.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                var_keyword = name
            elif name in rest:
                arguments[name] = rest.pop(name)
        if var_keyword is not None:
            arguments[var_keyword] = rest
        elif rest:
            raise InvalidArgumentError("payload", f"has {', '.join(map(repr, sorted(rest)))}, which the handler "
                                       f"{describe(self.arguments)} does not take")
        for name, parameter in self.arguments.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_POSITIONAL and name in arguments:
                arguments[name] = tuple(arguments[name])
        return inspect.BoundArguments(self.arguments, arguments)


def parameters_of(
    handler: Callable[..., Any], *, is_async: bool, takes_session: Callable[[Callable[..., Any]], bool]
) -> Parameters:
    """Read ``handler``'s form from its signature (``takes_session`` decides the job form's session;
    ``is_async``: whether it is an ``async def``).

    Raises :class:`InvalidArgumentError` naming ``handler`` when it has no
    signature Python can inspect, asks for the job or the session after
    its own arguments, asks twice, or asks for a session of the wrong kind.
    """
    try:
        signature = inspect.signature(handler)
    except (ValueError, TypeError):
        raise InvalidArgumentError(
            "handler", "has no signature Python can inspect; wrap it in a def"
        ) from None
    params = list(signature.parameters.values())
    if params and (params[0].kind is inspect.Parameter.VAR_POSITIONAL or (
            params[0].name == "job" and params[0].kind in _POSITIONAL
            and _injected(handler, params[0]) is None)):
        return Parameters("job", takes_session(handler))
    injected: list[Injected] = []
    for param in params:
        kind = _injected(handler, param)
        if kind is None or param.kind not in _POSITIONAL:
            break
        if kind in injected:
            raise InvalidArgumentError("handler", f"asks for the {_what(kind)} twice (parameter {param.name!r})")
        injected.append(kind)
    rest = params[len(injected):]
    for param in rest:
        kind = _injected(handler, param)
        if kind is not None:
            raise InvalidArgumentError(
                "handler", f"parameter {param.name!r} asks for the {_what(kind)} after the task's own arguments: "
                "put it first, so that a type checker can take it off enqueue's parameters")
    if "session" in injected:
        _check_session_kind(handler, params[injected.index("session")], is_async)
    by_keyword = all(p.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)
                     for p in rest)
    return Parameters("arguments", "session" in injected, tuple(injected), signature.replace(parameters=rest),
                      by_keyword)


def returns_value(handler: Callable[..., Any]) -> bool:
    """Whether ``handler`` is annotated to return something other than None."""
    try:
        annotation = inspect.signature(handler).return_annotation
    except (ValueError, TypeError):
        return False
    if annotation is inspect.Signature.empty or annotation is None or annotation is type(None):
        return False
    return not (isinstance(annotation, str) and annotation.strip() in ("None", "NoReturn", "Never"))


def describe(signature: inspect.Signature) -> str:
    """``signature`` as a message shows it: no return type, annotations unquoted."""
    text = str(signature.replace(return_annotation=inspect.Signature.empty))
    return re.sub(r": '([^']*)'", r": \1", text)


def _what(kind: Injected) -> str:
    return "job (JobContext)" if kind == "context" else "session"


def _annotation(handler: Callable[..., Any], param: inspect.Parameter) -> Any:
    """``param``'s annotation; a string one (``from __future__ import annotations``) is
    looked up by its dotted name in the handler's module, never evaluated."""
    annotation = param.annotation
    if not isinstance(annotation, str):
        return annotation
    found = _lookup(annotation.strip(), _globals_of(handler))
    if found is not None:
        return found
    last = annotation.rsplit(".", 1)[-1].strip("'\" ")
    if last in _INJECTABLE_NAMES:
        raise InvalidArgumentError(
            "handler", f"the annotation {annotation!r} of parameter {param.name!r} cannot be found in the handler's "
            "module; import it at run time (not under TYPE_CHECKING)")
    return inspect.Parameter.empty  # a task argument's type that only a type checker sees (or an expression)


def _lookup(dotted: str, namespace: dict[str, Any]) -> Any:
    """The object a dotted name (``Session``, ``orm.Session``) names in ``namespace``, or None."""
    head, *rest = dotted.split(".")
    if not all(part.isidentifier() for part in (head, *rest)):
        return None
    value = namespace.get(head, getattr(builtins, head, None))
    for part in rest:
        value = getattr(value, part, None)
    return value


def _globals_of(handler: Callable[..., Any]) -> dict[str, Any]:
    function = inspect.unwrap(handler)
    if not inspect.isroutine(function):
        function = type(function).__call__
    found = getattr(function, "__globals__", None)
    if isinstance(found, dict):
        return found
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    return dict(vars(module)) if module is not None else {}


def _injected(handler: Callable[..., Any], param: inspect.Parameter) -> Injected | None:
    """What the worker fills ``param`` with: the job's context, its session, or nothing (a task argument)."""
    annotation = _annotation(handler, param)
    if not isinstance(annotation, type):
        return None
    if issubclass(annotation, JobContext):
        return "context"
    if issubclass(annotation, Session) or is_async_session_type(annotation):
        return "session"
    return None


def is_async_session_type(annotation: Any) -> bool:
    """Whether ``annotation`` is SQLAlchemy's ``AsyncSession`` or a subclass, told by
    name: the core never imports SQLAlchemy's asyncio extension."""
    return isinstance(annotation, type) and any(
        c.__name__ == "AsyncSession" and c.__module__.startswith("sqlalchemy.ext.asyncio") for c in annotation.__mro__)


def _check_session_kind(handler: Callable[..., Any], param: inspect.Parameter, is_async: bool) -> None:
    if is_async_session_type(_annotation(handler, param)) != is_async:
        raise InvalidArgumentError(
            "handler", f"parameter {param.name!r}: an async def handler takes an AsyncSession, a def handler a "
            "Session")
