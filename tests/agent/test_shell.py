"""shell: real processes, real timeouts, real process trees, the bubblewrap sandbox."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from .helpers import Tools


@pytest.fixture
def tools(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    return Tools(ws)


def _alive(marker: str) -> bool:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0


def test_output_exit_code_and_cwd(tools):
    r = tools.call("shell", command="pwd; echo to-stderr >&2; exit 3")
    assert not r.ok and r.data["exit_code"] == 3
    assert str(tools.root) in r.content and "to-stderr" in r.content and "[exit code 3;" in r.content
    r = tools.call("shell", command="true")
    assert r.ok and r.content.startswith("(no output)")


def test_stdin_is_closed(tools):
    r = tools.call("shell", command="read line; echo \"read rc=$?\"", timeout_s=10)
    assert "read rc=1" in r.content and r.data["duration_s"] < 5


def test_timeout_kills_the_whole_process_tree(tools):
    marker = f"sleep {1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 1000}"
    cmd = f"({marker} &) ; bash -c '{marker}' & {marker}; echo never"
    start = time.monotonic()
    r = tools.call("shell", command=cmd, timeout_s=1)
    elapsed = time.monotonic() - start
    assert r.data["timed_out"] and r.data["exit_code"] == 124
    assert "timed out after 1 s" in r.content and "never" not in r.content
    assert elapsed < 6
    deadline = time.time() + 3
    while _alive(marker) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(marker), "a child of the timed-out command survived"


def test_interrupt_kills_a_running_command(tools):
    marker = f"sleep {2000 + uuid.uuid4().int % 1000}"
    threading.Timer(0.5, tools.ctx.cancel.set).start()
    start = time.monotonic()
    r = tools.call("shell", command=marker)
    assert r.data["interrupted"] and time.monotonic() - start < 5
    assert not _alive(marker)


def test_a_background_process_holding_the_pipe_does_not_block(tools):
    marker = f"sleep {3000 + uuid.uuid4().int % 1000}"
    start = time.monotonic()
    r = tools.call("shell", command=f"{marker} & echo started", timeout_s=30)
    assert r.ok and "started" in r.content and time.monotonic() - start < 5
    subprocess.run(["pkill", "-f", marker])


def test_long_output_is_cut_with_the_full_log_kept(tools):
    r = tools.call("shell", command="for i in $(seq 1 20000); do echo line-$i; done")
    assert r.ok
    assert r.content.startswith("line-1\nline-2\n") and "line-20000" in r.content
    assert "chars omitted; full output in .composer/shell/" in r.content
    assert len(r.content) < 11_000
    log = tools.root / r.data["log_path"]
    assert log.read_text().splitlines()[-1] == "line-20000"
    assert (tools.root / ".composer" / ".gitignore").exists()


def test_short_output_leaves_no_log(tools):
    tools.call("shell", command="echo hi")
    assert list((tools.root / ".composer" / "shell").iterdir()) == []


def test_ansi_and_progress_bars_are_cleaned(tools):
    r = tools.call("shell", command=r"printf '\033[31mred\033[0m\n'; printf '10%%\r50%%\r100%%\n'")
    assert r.content.splitlines()[:2] == ["red", "100%"]


def test_timeout_bounds_are_enforced(tools):
    assert "600" in tools.err("shell", command="true", timeout_s=601)
    assert "invalid arguments" in tools.err("shell", command="true", timeout_s=0)
    assert "empty" in tools.err("shell", command="   ")


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _bwrap_works() -> bool:
    if not shutil.which("bwrap"):
        return False
    probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--unshare-net", "true"], capture_output=True)
    return probe.returncode == 0


@needs_bwrap
def test_sandbox_confines_writes_and_network(tmp_path):
    if not _bwrap_works():
        pytest.skip("bubblewrap cannot create namespaces here")
    ws = tmp_path / "ws"
    ws.mkdir()
    outside = f"/var/tmp/composer-sandbox-{uuid.uuid4().hex}"
    beside = tmp_path / "beside.txt"  # under the host's /tmp, which the sandbox replaces
    t = Tools(ws, sandbox=True)
    r = t.call("shell", command=f"echo inside > in.txt && echo tmp > /tmp/x && cat /tmp/x; "
                                f"echo bad > {outside}; echo rc=$?; echo bad > {beside}")
    assert (ws / "in.txt").read_text() == "inside\n"
    assert "tmp" in r.content and "rc=1" in r.content
    assert not Path(outside).exists() and not beside.exists()
    r = t.call("shell", command="python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"")
    assert not r.ok and ("unreachable" in r.content.lower() or "error" in r.content.lower())
    assert r.data["sandboxed"]


def test_sandbox_without_bwrap_fails_closed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    t = Tools(tmp_path, sandbox=True)
    r = t.call("shell", command="echo should-not-run")
    assert not r.ok and "bubblewrap" in r.content and "should-not-run" not in r.content


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_timeout_kills_children_that_started_their_own_session(tools):
    """setsid (or a double fork into a new session) leaves the process group; the kill must still
    reach it, and the result says what was killed only once nothing is left."""
    n = 4000 + uuid.uuid4().int % 1000
    cmd = (f"setsid sleep {n} & echo $! > own-session.pid; "
           f"setsid sh -c 'sleep {n + 1} & echo $! > orphan.pid'; sleep {n + 2}")
    start = time.monotonic()
    r = tools.call("shell", command=cmd, timeout_s=1)
    assert r.data["timed_out"] and time.monotonic() - start < 8
    pids = [int((tools.root / f).read_text()) for f in ("own-session.pid", "orphan.pid")]
    survivors = [p for p in pids if _running(p)]
    for p in survivors:  # don't leave them behind if the test fails
        subprocess.run(["kill", "-9", str(p)])
    assert survivors == [], "a process in its own session survived the timeout"
    assert r.data["survivors"] == [] and r.data["killed"] >= 3
    assert "none left" in r.content


def test_output_past_the_log_cap_keeps_its_real_end(tools):
    """70 MB of output: the model still sees the true last lines, and the log says it was capped."""
    r = tools.call("shell", command="yes 2>/dev/null | head -c 70000000; echo THE-REAL-END", timeout_s=300)
    assert r.ok, r.content[-500:]
    body = r.content.rsplit("\n[", 1)[0]
    assert body.endswith("y\nTHE-REAL-END")
    assert r.data["output_bytes"] == 70_000_000 + len("THE-REAL-END\n") and r.data["log_capped"]
    assert "capped" in r.content
    log = tools.root / r.data["log_path"]
    assert log.stat().st_size < 70_000_000
    with open(log, "rb") as f:
        f.seek(-200, 2)
        end = f.read()
    assert end.endswith(b"y\nTHE-REAL-END\n") and b"omitted" in log.read_bytes()[-(4 << 20):]
