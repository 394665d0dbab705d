"""The dashboard as an ASGI app (Starlette): mount it in FastAPI, Litestar or Starlette, or serve it.

::

    from sa_jobqueue.dashboard import create_app

    dashboard = create_app(engine, [emails, reports])
    app.mount("/queue", dashboard)          # FastAPI / Starlette

Pages are server-rendered; a page updates itself over Server-Sent Events
(``/events``) when a job table is notified, and at least every
``poll_interval`` seconds. ``authorize`` (a callable on the request) decides
whether a request may see the dashboard and act: False answers 403. Every
action goes through a confirmation page whose form carries a CSRF token
(:mod:`sa_jobqueue.dashboard.actions`); ``read_only`` offers none. Pages
run their database reads in a worker thread (Starlette's threadpool), each in
a read-only transaction of its own.
"""

from __future__ import annotations

import contextlib
import secrets
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from typing import Any

from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from ..repository import JobRepository
from .csrf import CSRF_COOKIE, new_cookie
from .gate import Gate
from .live import Broadcast
from .page import Rendered
from .render import environment
from .views import Views

Authorize = Callable[[Request], bool]
DEFAULT_POLL_INTERVAL = 5.0


def create_app(
    engine: Engine,
    repositories: Sequence[JobRepository[Any]],
    *,
    title: str = "sa_jobqueue",
    authorize: Authorize | None = None,
    listen: bool = True,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    read_only: bool = False,
    secret: bytes | None = None,
) -> Starlette:
    """The dashboard over the job tables of ``repositories``, read through ``engine``.

    ``listen=False`` (behind a pooler in transaction mode, where LISTEN does
    not work) leaves live updates to polling every ``poll_interval`` seconds.
    ``read_only``: no action is offered, and one posted anyway is a 403.
    ``secret``: the key of the CSRF tokens (default: random, made now; give
    one when several processes serve the same dashboard).
    """
    views = Views(engine, list(repositories), title=title, read_only=read_only)
    gate = Gate(views.error, authorize, read_only, secret if secret is not None else secrets.token_bytes(32))
    broadcast = Broadcast(engine, [repo.channel for repo in views.tables.values()], listen=listen)
    templates = environment()
    script = resources.files("sa_jobqueue.dashboard").joinpath("static/dashboard.js").read_text()

    def respond(request: Request, rendered: Rendered) -> Response:
        base = request.scope.get("root_path", "").rstrip("/")
        context = {**rendered.context, "base": base}
        if context.get("live_url"):
            context["live_url"] = base + context["live_url"]
        html = templates.get_template(rendered.template).render(context)
        response = HTMLResponse(html, status_code=rendered.status)
        if not request.cookies.get(CSRF_COOKIE):
            response.set_cookie(CSRF_COOKIE, request.state.csrf_cookie, httponly=True, samesite="strict",
                                path=base or "/")
        return response

    def cookie_of(request: Request) -> str:
        """The browser's CSRF cookie, or the one this response is about to give it."""
        request.state.csrf_cookie = request.cookies.get(CSRF_COOKIE) or new_cookie()
        return str(request.state.csrf_cookie)


    def page(make: Callable[[Request], Rendered]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            cookie_of(request)
            refused = gate.page(request)
            if refused is not None:
                return respond(request, refused)
            return respond(request, await run_in_threadpool(views.answer, lambda: make(request)))
        return endpoint

    def confirming(view: Callable[[dict[str, str], str], Rendered]) -> Callable[[Request], Any]:
        """The GET of a confirmation page: its form carries the browser's CSRF token."""
        async def confirm(request: Request) -> Response:
            cookie = cookie_of(request)
            refused = gate.action(request)
            if refused is not None:
                return respond(request, refused)
            params, token = dict(request.query_params), gate.token(cookie)
            return respond(request, await run_in_threadpool(views.answer, lambda: view(params, token)))
        return confirm

    def acting(view: Callable[[dict[str, str]], Rendered]) -> Callable[[Request], Any]:
        """The POST a confirmation page sends: runs only with the right CSRF token."""
        async def act(request: Request) -> Response:
            given = request.cookies.get(CSRF_COOKIE)
            cookie_of(request)
            # The forms are urlencoded; read them without a multipart parser.
            form = dict(urllib.parse.parse_qsl((await request.body()).decode("utf-8", "replace"), max_num_fields=100))
            refused = gate.action(request, given, form.pop("csrf", None), posted=True)
            if refused is not None:
                return respond(request, refused)
            return respond(request, await run_in_threadpool(views.answer, lambda: view(form)))
        return act

    async def events(request: Request) -> Response:
        if gate.page(request) is not None:
            return Response("not allowed", status_code=403)

        async def stream() -> AsyncIterator[str]:
            event = broadcast.subscribe()
            try:
                yield "retry: 2000\n\n"
                while True:
                    await broadcast.wait(event, poll_interval)
                    yield "event: refresh\ndata: {}\n\n"
            finally:
                broadcast.unsubscribe(event)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    async def static_script(request: Request) -> Response:
        return Response(script, media_type="text/javascript")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        broadcast.stop()

    routes = [
        Route("/", page(lambda request: views.overview())),
        Route("/jobs", page(lambda request: views.jobs(dict(request.query_params)))),
        Route("/jobs/{table}/{job_id}", page(lambda request: views.job(
            request.path_params["table"], request.path_params["job_id"]))),
        Route("/periodic", page(lambda request: views.periodic())),
        Route("/workers", page(lambda request: views.workers())),
        Route("/confirm", confirming(views.confirm)),
        Route("/act", acting(views.act), methods=["POST"]),
        Route("/queues/confirm", confirming(views.confirm_queue)),
        Route("/queues/act", acting(views.queue_act), methods=["POST"]),
        Route("/events", events),
        Route("/static/dashboard.js", static_script),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.views = views
    return app


__all__ = ["DEFAULT_POLL_INTERVAL", "Authorize", "create_app"]
