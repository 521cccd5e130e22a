"""The Starlette application of ``zephon ui``: GET routes only, over one read-only catalog.

Routes (every view's state is in its URL, so any view can be shared as a link):

- ``/runs?page=N&status=S``: the runs page; ``/api/runs`` the same as JSON.
- ``/runs/<name>?since=ISO&until=ISO&state=S``: a run's timeline; ``/api/runs/<name>`` JSON.
- ``/static/...``: the page's script (its refresh) and style. Charts are SVG drawn here
  (``zephon.ui.charts``), inside the page: it loads nothing from outside this server.

Pages refresh themselves: ``ui.js`` fetches the page's own URL every ``refresh`` seconds and
swaps its content in (``?refresh=0`` in the URL turns it off for that view).
"""

from __future__ import annotations

import datetime as dt
import importlib.resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from zephon.catalog import Catalog, CatalogError, InvalidValueError, RunNotFoundError
from zephon.ui.access import ReadOnlyMethods, TokenGate
from zephon.ui.charts import run_charts
from zephon.ui.figures import GoodputCache
from zephon.ui.views import PHASES, RunFilter, run_view, runs_view

__all__ = ["create_app"]

_HERE = importlib.resources.files("zephon.ui")
_STATES = ("pending", "committed", "deleting", "deleted", "failed", "corrupt", "stale")
_STATUSES = ("active", "finished", "failed")
#: the browser may load scripts, styles and data from this server only
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)


def _bad(name: str, value: str, expected: str) -> HTTPException:
    return HTTPException(400, f"invalid {name} {value[:60]!r}: {expected}")


def _page(request: Request) -> int:
    text = request.query_params.get("page", "1")
    if not text.isdigit() or not 1 <= int(text) <= 1_000_000:
        raise _bad("page", text, "use an integer from 1")
    return int(text)


def _status(request: Request) -> str | None:
    status = request.query_params.get("status") or None
    if status is not None and status not in _STATUSES:
        raise _bad("status", status, f"use one of {', '.join(_STATUSES)}")
    return status


def _time(request: Request, name: str) -> dt.datetime | None:
    text = request.query_params.get(name)
    if not text:
        return None
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise _bad(name, text, "use an ISO 8601 time, e.g. 2026-12-01T10:00:00Z") from None
    return at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)


def _filter(request: Request) -> RunFilter:
    states = tuple(request.query_params.getlist("state"))
    for state in states:
        if state not in _STATES:
            raise _bad("state", state, f"use one of {', '.join(_STATES)}")
    return RunFilter(since=_time(request, "since"), until=_time(request, "until"), states=states)


def create_app(
    catalog: Catalog,
    *,
    refresh_s: int = 5,
    token: str | None = None,
    figures: GoodputCache | None = None,
) -> Any:
    """The ASGI application over ``catalog`` (opened read-only by the caller); ``token``:
    every request must present it (``zephon.ui.access``); ``figures``: the runs' goodput
    kept between requests (a new, empty one if None)."""
    figures = figures or GoodputCache(catalog)
    templates = Jinja2Templates(directory=str(_HERE / "templates"))
    templates.env.filters["bytes"] = _human_bytes
    templates.env.filters["seconds"] = _human_seconds
    templates.env.filters["percent"] = lambda v: "-" if v is None else f"{100 * v:.1f}%"

    def render(
        request: Request, name: str, data: dict[str, Any], title: str, **extra: Any
    ) -> Response:
        refresh = request.query_params.get("refresh")
        seconds = min(int(refresh), 3600) if refresh and refresh.isdigit() else refresh_s
        context = {
            **extra,
            "data": data,
            "title": title,
            "refresh_s": seconds,
            "phases": PHASES,
            "states": _STATES,
            "statuses": _STATUSES,
            "query": request.query_params,
        }
        return templates.TemplateResponse(request, name, context)

    def runs_data(request: Request) -> dict[str, Any]:
        return runs_view(catalog, page=_page(request), status=_status(request), figures=figures)

    def run_data(request: Request) -> dict[str, Any]:
        name = request.path_params["name"]
        try:
            return run_view(catalog, name, _filter(request))
        except RunNotFoundError:
            raise HTTPException(404, f"run {name!r} is not in the catalog") from None
        except InvalidValueError as exc:
            raise HTTPException(400, str(exc)) from None

    def runs_page(request: Request) -> Response:
        return render(request, "runs.html", runs_data(request), "Runs")

    def runs_api(request: Request) -> Response:
        return JSONResponse(runs_data(request))

    def run_page(request: Request) -> Response:
        data = run_data(request)
        title = f"Run {data['run']['name']}"
        return render(request, "run.html", data, title, charts=run_charts(data))

    def run_api(request: Request) -> Response:
        return JSONResponse(run_data(request))

    def home(request: Request) -> Response:
        return RedirectResponse("/runs", status_code=307)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return Response(f"zephon ui: {exc.detail}\n", exc.status_code, media_type="text/plain")

    async def catalog_error(request: Request, exc: Exception) -> Response:
        # the catalog's messages mask passwords; one line, as on the command line
        text = " ".join(str(exc).split())
        return Response(f"zephon ui: {text}\n", 503, media_type="text/plain")

    async def headers(request: Request, call_next):
        response = await call_next(request)
        response.headers["content-security-policy"] = _CSP
        response.headers["x-content-type-options"] = "nosniff"
        response.headers["referrer-policy"] = "no-referrer"
        return response

    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    app = Starlette(
        routes=[
            Route("/", home),
            Route("/runs", runs_page),
            Route("/runs/{name}", run_page),
            Route("/api/runs", runs_api),
            Route("/api/runs/{name}", run_api),
            Mount("/static", _CachedStatic(directory=str(_HERE / "static")), name="static"),
        ],
        middleware=[Middleware(BaseHTTPMiddleware, dispatch=headers)],
        exception_handlers={HTTPException: http_error, CatalogError: catalog_error},
    )
    return ReadOnlyMethods(TokenGate(app, token))


class _CachedStatic(StaticFiles):
    """The page's script and style, which browsers may keep for an hour without asking again
    (a new zephon version changes them; a reload asks anyway)."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["cache-control"] = "max-age=3600"
        return response


def _human_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


def _human_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.2f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"
