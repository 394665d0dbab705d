"""The dashboard as a Flask blueprint, over the same pages as the ASGI app.

::

    from sa_jobqueue.dashboard.blueprint import dashboard_blueprint

    with app.app_context():                  # Flask-SQLAlchemy's db.engine needs one
        app.register_blueprint(dashboard_blueprint(db.engine, [emails, reports]), url_prefix="/queue")

The pages, the actions with their confirmation and CSRF token, ``authorize``
(a callable on Flask's ``request``), ``read_only`` and live updates are those
of :func:`sa_jobqueue.dashboard.create_app`. The event stream (``/events``)
holds a thread of the server for as long as a page is open: behind a server
with few threads (the development server is fine; gunicorn's sync workers
are not), pass ``listen=False`` and a ``poll_interval``, or serve the ASGI app.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import Any

from flask import Blueprint, Response, g, make_response, request, stream_with_context, url_for
from sqlalchemy import Engine

from ..repository import JobRepository
from .csrf import CSRF_COOKIE, new_cookie
from .gate import Gate
from .live import Broadcast
from .page import Rendered
from .render import environment
from .views import Views

DEFAULT_POLL_INTERVAL = 5.0


def dashboard_blueprint(
    engine: Engine,
    repositories: Sequence[JobRepository[Any]],
    *,
    name: str = "sajq_dashboard",
    title: str = "sa_jobqueue",
    authorize: Callable[[Any], bool] | None = None,
    listen: bool = True,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    read_only: bool = False,
    secret: bytes | None = None,
) -> Blueprint:
    """A blueprint named ``name`` of the dashboard over ``repositories`` (see the module docstring)."""
    views = Views(engine, list(repositories), title=title, read_only=read_only)
    gate = Gate(views.error, authorize, read_only, secret if secret is not None else secrets.token_bytes(32))
    broadcast = Broadcast(engine, [repo.channel for repo in views.tables.values()], listen=listen)
    templates = environment()
    script = resources.files("sa_jobqueue.dashboard").joinpath("static/dashboard.js").read_text()
    blueprint = Blueprint(name, __name__)

    def cookie() -> str:
        g.sajq_csrf = request.cookies.get(CSRF_COOKIE) or new_cookie()
        return str(g.sajq_csrf)

    def respond(rendered: Rendered) -> Response:
        base = url_for(f"{name}.overview").rstrip("/")
        context = {**rendered.context, "base": base}
        if context.get("live_url"):
            context["live_url"] = base + context["live_url"]
        response = make_response(templates.get_template(rendered.template).render(context), rendered.status)
        if not request.cookies.get(CSRF_COOKIE):
            response.set_cookie(CSRF_COOKIE, g.sajq_csrf, httponly=True, samesite="Strict", path=base or "/")
        return response

    def page(make: Callable[[], Rendered]) -> Response:
        cookie()
        return respond(gate.page(request) or views.answer(make))

    @blueprint.get("/")
    def overview() -> Response:
        return page(views.overview)

    @blueprint.get("/jobs")
    def jobs() -> Response:
        return page(lambda: views.jobs(request.args.to_dict()))

    @blueprint.get("/jobs/<table>/<job_id>")
    def job(table: str, job_id: str) -> Response:
        return page(lambda: views.job(table, job_id))

    @blueprint.get("/periodic")
    def periodic() -> Response:
        return page(views.periodic)

    @blueprint.get("/workers")
    def workers() -> Response:
        return page(views.workers)

    def confirming(view: Callable[[dict[str, str], str], Rendered]) -> Response:
        browser = cookie()
        params = request.args.to_dict()
        return respond(gate.action(request) or views.answer(lambda: view(params, gate.token(browser))))

    def acting(view: Callable[[dict[str, str]], Rendered]) -> Response:
        given = request.cookies.get(CSRF_COOKIE)
        cookie()
        form = request.form.to_dict()
        refused = gate.action(request, given, form.pop("csrf", None), posted=True)
        return respond(refused or views.answer(lambda: view(form)))

    @blueprint.get("/confirm")
    def confirm() -> Response:
        return confirming(views.confirm)

    @blueprint.post("/act")
    def act() -> Response:
        return acting(views.act)

    @blueprint.get("/queues/confirm")
    def confirm_queue() -> Response:
        return confirming(views.confirm_queue)

    @blueprint.post("/queues/act")
    def queue_act() -> Response:
        return acting(views.queue_act)

    @blueprint.get("/events")
    def events() -> Response:
        if gate.page(request) is not None:
            return Response("not allowed", status=403)

        def stream() -> Iterator[str]:
            event = broadcast.subscribe_thread()
            try:
                yield "retry: 2000\n\n"
                while True:
                    broadcast.wait_thread(event, poll_interval)
                    yield "event: refresh\ndata: {}\n\n"
            finally:
                broadcast.unsubscribe(event)

        return Response(stream_with_context(stream()), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-store"})

    @blueprint.get("/static/dashboard.js")
    def static_script() -> Response:
        return Response(script, mimetype="text/javascript")

    return blueprint


__all__ = ["DEFAULT_POLL_INTERVAL", "dashboard_blueprint"]
