"""The browser client the gateway serves at ``/``: plain HTML, JavaScript and CSS, no build step."""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = files(__name__) / "static"


async def index(request: Request) -> Response:
    return FileResponse(str(STATIC_DIR / "index.html"), media_type="text/html")


def web_routes(token_url: str | None = None, responder: dict[str, bool] | None = None) -> list[BaseRoute]:
    """``GET /`` (the talk page), ``/static/*`` (its script and style) and ``GET /web/config.json``.

    ``token_url`` is where the page fetches a client secret before each connection (an endpoint of the
    operator's app that calls ``POST /v1/realtime/client_secrets``); None when the gateway needs no credential.
    ``responder`` says that ``/v1/realtime`` answers the user (``{"transcription": bool}``: whether spoken turns
    are transcribed), so the page offers its talk mode; None when the route only speaks what it is sent.
    """

    async def config(request: Request) -> Response:
        return JSONResponse({"token_url": token_url, "responder": responder}, headers={"cache-control": "no-store"})

    return [
        Route("/", index, methods=["GET", "HEAD"]),
        Route("/web/config.json", config, methods=["GET"]),
        Mount("/static", StaticFiles(packages=[("omnigate.web", "static")]), name="static"),
    ]
