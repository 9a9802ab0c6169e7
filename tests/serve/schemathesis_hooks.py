"""Schemathesis hooks for tests/serve/test_openapi.py (loaded through SCHEMATHESIS_HOOKS)."""

from __future__ import annotations

import os

import schemathesis

MODEL = os.environ.get("COMPOSER_ST_MODEL", "tiny")


@schemathesis.hook
def map_body(context, body):
    """Name the served model: random names would stop nearly every case at the 404, before the engine."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        body["model"] = MODEL
    return body


@schemathesis.hook
def map_path_parameters(context, path_parameters):
    """GET /v1/models/{name}: the served model, so the 200 is exercised too (other names are 404s)."""
    if isinstance(path_parameters, dict) and "name" in path_parameters:
        path_parameters["name"] = MODEL
    return path_parameters


# 400s for what a schema cannot say: limits of this deployment (context length, vocabulary) and rules
# across fields (top_logprobs needs logprobs, tool_choice names one of the tools, the template's rules
# about the conversation, a JSON Schema valid as such that no grammar can be built from). Each has its own
# `code`, so only these are let through.
SEMANTIC = {"context_length_exceeded", "empty_prompt", "invalid_token_id", "invalid_tool_choice",
            "logprobs_required", "chat_template_error", "invalid_json_schema",
            "unsupported_parameter"}  # /v1/responses: previous_response_id, as no response is stored


SEED_RANGE = (-(2**63), 2**64 - 1)  # serve/schemas.py


@schemathesis.hook
def filter_failure(context, failure, case, response):
    """Keep every failure but a "schema-valid request refused" that was one of the SEMANTIC refusals, or
    that was not schema-valid at all: the generator passes integer bounds through floats and sends
    18446744073709551999 for the seed's maximum 2**64 - 1."""
    if getattr(failure, "code", None) != "ST202" or response.status_code != 400:
        return True
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return True
    seed = case.body.get("seed") if isinstance(case.body, dict) else None
    if error["param"] == "seed" and isinstance(seed, int) and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        return False
    return error["code"] not in SEMANTIC
