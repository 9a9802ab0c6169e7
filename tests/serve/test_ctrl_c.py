"""Ctrl-C on `composer-serve` in a terminal (issue 52, item 2): one clean line and exit 0, as uvicorn's own
CLI gives, not a KeyboardInterrupt / CancelledError traceback.

In a pseudo-terminal because that is where the Ctrl-C comes from: a child signalled from a test run
started in the background may have SIGINT ignored from the start, and would not show this at all.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import time

import pexpect

from .conftest import ROOT


def test_ctrl_c_stops_the_server_with_one_line_and_exit_0(tiny_hermes):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "serve.cli", "--model", str(tiny_hermes), "--port", "0"],
                          env=env, encoding="utf-8", timeout=120)
    child.logfile_read = io.StringIO()
    child.expect(r"serving \S+ at http://127\.0\.0\.1:(\d+)/v1")
    port = int(child.match.group(1))
    time.sleep(0.5)  # uvicorn's signal handlers go in just after the line
    child.sendintr()
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    out = child.logfile_read.getvalue()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "composer-serve: stopped (Ctrl-C)" in out
    assert child.exitstatus == 0, out
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))
