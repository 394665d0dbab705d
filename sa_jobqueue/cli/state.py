"""What the commands share: the engine (:class:`CliState`), the job table (``--model``), imports by path."""

from __future__ import annotations

import importlib
from typing import Any

import click
from sqlalchemy import Engine

from ..errors import JobQueueError
from ..mixin import JobMixin
from ..repository import JobRepository
from .database import make_engine
from .errors import CliError, CliUsageError, first_line

__all__ = ["DEFAULT_MODEL", "CliState", "cli_state", "import_object", "load_repository", "model_option",
           "repository_for"]

DEFAULT_MODEL = "sa_jobqueue.default:Job"


class CliState:
    """What the commands share, as ``ctx.obj``: the engine, built from the URL on first use.

    A ready ``engine`` (an application's, e.g. ``flask jobs``) is used as it
    is and never disposed here; ``repository`` is then the job table used
    when ``--model`` is not given.
    """

    def __init__(
        self, database_url: str | None, *, engine: Engine | None = None,
        repository: JobRepository[Any] | None = None,
    ) -> None:
        self.database_url = database_url
        self._engine: Engine | None = engine
        self._owns_engine = engine is None
        self.repository = repository

    def engine(self) -> Engine:
        """The engine: the one given, or one built from :attr:`database_url` (once)."""
        if self._engine is None:
            self._engine = make_engine(self.database_url)
        return self._engine

    def close(self) -> None:
        """Dispose of the engine if this state built it."""
        if self._engine is not None and self._owns_engine:
            self._engine.dispose()


def import_object(path: str, what: str) -> Any:
    """Import ``module:attr`` (attr may be dotted); raise :class:`CliUsageError` naming ``what``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise CliUsageError(f"{what}: {path!r} is not an import path of the form module:attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliUsageError(f"{what}: cannot import module {module_name!r}: {first_line(exc)}") from None
    except Exception as exc:  # the module itself failed while importing
        raise CliError(f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {first_line(exc)}") from None
    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise CliUsageError(f"{what}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def load_repository(model_path: str) -> JobRepository[Any]:
    """A :class:`JobRepository` of the ``--model`` class named by ``model_path``."""
    model = import_object(model_path, "--model")
    if not isinstance(model, type) or not issubclass(model, JobMixin):
        raise CliUsageError(f"--model: {model_path} is not a JobMixin model class")
    try:
        return JobRepository(model)
    except JobQueueError as exc:
        raise CliUsageError(str(exc)) from None


model_option = click.option(
    "--model", "model_path", default=DEFAULT_MODEL, show_default=True, metavar="MODULE:CLASS",
    help="The job model (a JobMixin class).",
)


def cli_state(ctx: click.Context) -> CliState:
    """The :class:`CliState` the group put in ``ctx.obj``."""
    state = ctx.find_object(CliState)
    if state is None:  # pragma: no cover - the group always sets it
        raise CliError("internal error: no CLI state")
    return state


def repository_for(ctx: click.Context, model_path: str) -> JobRepository[Any]:
    """The job table of ``--model``, or the state's own when ``--model`` was not given."""
    state = cli_state(ctx)
    if state.repository is not None and ctx.get_parameter_source("model_path") is click.core.ParameterSource.DEFAULT:
        return state.repository
    return load_repository(model_path)
