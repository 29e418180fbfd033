"""The uvicorn configuration of every gateway server: the HTTP parser is named, not left to uvicorn's fallback."""

from __future__ import annotations

from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from omnigate.gateway.server_config import uvicorn_config
from omnigate.gateway.settings import Settings


def test_http_is_parsed_by_httptools() -> None:
    # "auto" would fall back to pure-Python h11 without a word when httptools is missing.
    config = uvicorn_config(Starlette(), Settings())
    assert config.http == "httptools"
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
