"""A bug in a route is a 500 with a generic message and an id; the details go to the log only."""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import FastAPI

from gracelm.serving.api_errors import install_error_handlers

SECRET = "/srv/private/weights.gguf of another request"


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError(SECRET)

    return app


def test_a_500_hides_the_exception_and_logs_it_under_an_id(caplog):
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/boom")

    with caplog.at_level(logging.ERROR, logger="gracelm.serving.api_errors"):
        response = asyncio.run(call())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert SECRET not in response.text and "RuntimeError" not in response.text
    error_id = error["message"].split("(id ")[1].split(")")[0]
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.exc_info is not None and SECRET in str(record.exc_info[1])
    assert "/boom" in record.getMessage()
