"""/openapi.json as the server behaves: OpenAI's error body for every error status, no 422.

FastAPI documents a 422 with its own validation body on every route with parameters; this server
answers 400 with OpenAI's body instead (serve/api.py), so the 422s are dropped and each route lists
the errors it can give. The guard's answers (401 where a key is needed, 413 for a body over the
limit) are added here from the server's settings, with the bearer scheme where a key is set. Checked
by schemathesis in tests/serve/test_openapi.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serve.schemas import ErrorBody

WHY = {400: "Invalid request (`param` names the field)", 401: "Missing or wrong API key",
       403: "Not allowed on this server", 404: "Unknown model or route", 413: "Request body too large",
       500: "Generation failed", 503: "Aborted by a weight load, or the engine is not running"}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries for these error statuses, all with OpenAI's error body."""
    return {code: {"model": ErrorBody, "description": WHY[code]} for code in codes}


def install_openapi(app: FastAPI, api_key: str | None, key_paths, max_body_bytes: int) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        parts = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            parts.get("schemas", {}).pop(name, None)
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        if api_key:
            parts["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            for method, op in operations.items():
                responses = op["responses"]
                responses.pop("422", None)
                if api_key and key_paths(path):
                    op["security"] = [{"bearer": []}]
                    responses["401"] = {"description": WHY[401], "content": error}
                if method in ("post", "put", "patch"):
                    responses["413"] = {"description": f"{WHY[413]} (over {max_body_bytes} bytes)",
                                        "content": error}
                    responses.setdefault("400", {"description": WHY[400], "content": error})  # unparsable JSON
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
