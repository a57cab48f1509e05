"""What every error answer must be: an OpenAI error body (message, type, code, param) with the
expected status, naming the field when one is at fault, never a traceback."""

from __future__ import annotations

from typing import Any

import httpx


def assert_error(
    response: httpx.Response, status: int, *, param: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
