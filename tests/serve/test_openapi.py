"""The OpenAPI schema describes the server (issue 14, item 7), schemathesis finds nothing against it, and a
stream that fails ends with its error, not with [DONE] as if the answer were complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import KEY, ROOT, gauge, start_server

AUTH = {"Authorization": f"Bearer {KEY}"}


def test_the_schema_documents_openai_errors_and_no_422(native_server):
    schema = httpx.get(native_server.base_url.removesuffix("/v1") + "/openapi.json").json()
    assert "422" not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    error = {"$ref": "#/components/schemas/ErrorBody"}
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    for code in ("400", "401", "404", "413"):
        assert chat[code]["content"]["application/json"]["schema"] == error, code
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert schema["paths"]["/v1/models/{name}"]["get"]["responses"]["404"]["content"]["application/json"][
        "schema"] == error
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "security" not in schema["paths"]["/health"]["get"]
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]


def test_a_405_says_what_is_allowed(native_server):
    r = httpx.delete(native_server.base_url + "/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json()


def test_an_in_stream_error_is_not_followed_by_done(native_server, tiny_hermes):
    """A weight load that aborts requests in flight ends a chat stream with an error event, and that is the end."""
    events: list = []
    started = threading.Event()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "stream": True,
            "ignore_eos": True, "temperature": 0}

    def stream():
        with httpx.stream("POST", native_server.base_url + "/chat/completions", json=body, headers=AUTH,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) > 2:
                        started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    deadline = time.monotonic() + 10
    while gauge(native_server, "composer_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = httpx.post(native_server.base_url + "/load_weights", json={"path": str(tiny_hermes), "abort_in_flight": True},
                   headers=AUTH, timeout=60)
    t.join(60)
    assert r.status_code == 200 and r.json()["aborted"] == 1, r.text
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "weights_reloaded"


SCHEMATHESIS_CONFIG = """
# A failed load of a path that is not a checkpoint is a 400 (tests/serve/test_weight_sync.py): no schema can
# say which strings name checkpoint folders.
[[operations]]
include-path = "/v1/load_weights"
checks.positive_data_acceptance.enabled = false
"""


@pytest.mark.slow
def test_schemathesis_finds_nothing(tiny_hermes, tmp_path):
    """Every check schemathesis has (its default), in a bounded run: no 5xx, statuses, content types and bodies as
    documented, auth enforced. A 256-token context keeps each generation short."""
    srv = start_server(tiny_hermes, "--served-model-name", "tiny", "--api-key", KEY, "--dtype", "float32",
                       "--max-model-len", "256")
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.serve.schemathesis_hooks",
           "COMPOSER_ST_MODEL": "tiny", "NO_COLOR": "1"}
    try:
        p = subprocess.run([sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
                            srv.base_url.removesuffix("/v1") + "/openapi.json", "-H", f"Authorization: Bearer {KEY}",
                            "--phases", "examples,coverage,fuzzing", "--max-examples", "25", "--max-time", "30", "--request-timeout", "20", "--seed", "14", "--no-color"],
                           capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    finally:
        srv.stop()
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "Selected: 10/10" in p.stdout, p.stdout[-3000:]
