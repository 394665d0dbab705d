"""The command line's errors: every mistake ends as one ``Error: …`` line on stderr.

:class:`CliError` (exit 1) is a database or job-table problem, or an
argument the library refused; :class:`CliUsageError` (exit 2) is a bad
argument found after parsing. click's own usage errors (a missing argument,
a bad option value, an unknown command) would print the usage line and a
hint as well; the commands of this package are :class:`OneLineCommand`\\ s
and :class:`OneLineGroup`\\ s, which turn them into :class:`OneLineUsageError`,
shown as one line too (exit 2). They do so in whatever program runs them,
``sa-jobqueue`` or ``flask jobs``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import click

__all__ = [
    "CliError", "CliUsageError", "OneLineCommand", "OneLineGroup", "OneLineUsageError", "first_line", "one_line",
    "one_line_usage_errors",
]


class CliError(click.ClickException):
    """A user mistake or an unusable database: one line on stderr, exit 1."""


class CliUsageError(click.ClickException):
    """A bad argument found after parsing: one line on stderr, exit 2 (as click's usage errors)."""

    exit_code = 2


class OneLineUsageError(click.UsageError):
    """A click usage error shown as one ``Error: …`` line, the help hint included; exit 2."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"Error: {self.format_message()}", file=file, err=file is None)


def first_line(value: object) -> str:
    """The first non-blank line of ``str(value)``, or the type's name when there is none."""
    lines = [line.strip() for line in str(value).splitlines() if line.strip()]
    return lines[0] if lines else type(value).__name__


# click 8.2+ raises this for a group called without a command: it shows the help, as it should.
_HELP_ERROR: Any = getattr(click.exceptions, "NoArgsIsHelpError", None)


def one_line(error: click.UsageError) -> click.UsageError:
    """``error`` as a :class:`OneLineUsageError` (the same message and context), or itself when it
    is one already or shows the help."""
    if isinstance(error, OneLineUsageError) or (_HELP_ERROR is not None and isinstance(error, _HELP_ERROR)):
        return error
    message = " ".join(line.strip() for line in error.format_message().splitlines() if line.strip())
    ctx = error.ctx
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        help_name = max(ctx.command.get_help_option_names(ctx), key=len)
        if not message.endswith((".", "?", "!")):
            message += "."
        message = f"{message} Try '{ctx.command_path} {help_name}' for help."
    return OneLineUsageError(message, ctx)


@contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """Re-raise click's usage errors inside the block as :class:`OneLineUsageError`."""
    try:
        yield
    except click.UsageError as exc:
        converted = one_line(exc)
        if converted is exc:
            raise
        raise converted from exc


class OneLineCommand(click.Command):
    """A command whose usage errors are one line (:class:`OneLineUsageError`)."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        with one_line_usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with one_line_usage_errors():
            return super().invoke(ctx)


class OneLineGroup(OneLineCommand, click.Group):
    """A group whose usage errors, and those of its commands (a missing or
    unknown command, a command's own usage error), are one line.

    Commands and groups made with its decorators are of these classes too.
    """

    command_class = OneLineCommand
    group_class = type
