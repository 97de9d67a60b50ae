"""The API key check alone, on requests as the server builds them from raw header bytes."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import Request

from gracelm.server.guards import api_key_dependency
from gracelm.serving.api_errors import APIError


def _request(authorization: bytes | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization)]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


@pytest.mark.parametrize("key", ["secret", "clé-ünïcode-密钥"])
def test_the_key_matches_as_utf8_bytes(key):
    verify = api_key_dependency([key])
    asyncio.run(verify(_request(b"Bearer " + key.encode("utf-8"))))  # accepted: no exception
    for wrong in (None, b"Bearer " + key.encode("utf-8") + b"x", b"Basic " + key.encode("utf-8"),
                  b"Bearer " + key.upper().encode("utf-8"), b"Bearer "):
        with pytest.raises(APIError) as refused:
            asyncio.run(verify(_request(wrong)))
        assert refused.value.status == 401


def test_any_of_several_keys_matches():
    keys = ["first-key", "second-kéy"]
    verify = api_key_dependency(keys)
    for key in keys:
        asyncio.run(verify(_request(b"Bearer " + key.encode("utf-8"))))  # accepted: no exception
    for wrong in (b"Bearer first-keysecond-k\xc3\xa9y", b"Bearer first", b"Bearer second-key"):
        with pytest.raises(APIError) as refused:
            asyncio.run(verify(_request(wrong)))
        assert refused.value.status == 401
