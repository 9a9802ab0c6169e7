"""With no endpoint configured, composer-agent serves the built-in model as a child composer-serve and
the child never outlives it: normal exit, Ctrl-C (while loading and mid-turn), SIGKILL of the agent.

The checkpoint is a tiny random one at a temporary folder named by COMPOSER_BUILTIN_MODEL, the same
code path the shipped one takes (only the folder differs). Child processes are found in /proc by
their command line, which names that unique folder.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agent.builtin_model import NOTICE, builtin_model_dir
from agent.config import endpoint_source

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from serve.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("builtin") / "composer-tiny")


def serve_children(marker: Path | None) -> list[int]:
    """Live composer-serve processes whose command line names `marker` (None: any; zombies do not count)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"serve.cli" in cmd and (marker is None or str(marker).encode() in cmd) and state != "Z":
            pids.append(int(d.name))
    return pids


TAG = "COMPOSER_TEST_TAG"  # set in a test's composer-agent environment: its children inherit it


def tagged_children(tag: str) -> list[int]:
    """Live composer-serve processes whose environment holds TAG=tag: the children of one test's run,
    even after they are reparented, and never another process serving the same model."""
    pids, want = [], f"{TAG}={tag}".encode()
    for pid in serve_children(None):
        try:
            if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                pids.append(pid)
        except OSError:
            continue
    return pids


def tagged_gone(tag: str, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while tagged_children(tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def gone(marker: Path, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while serve_children(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def agent_env(tmp_path: Path, checkpoint: Path) -> dict[str, str]:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "COMPOSER_BUILTIN_MODEL": str(checkpoint)}
    for var in ("COMPOSER_BASE_URL", "COMPOSER_MODEL", "COMPOSER_API_KEY", "COMPOSER_CONTEXT_WINDOW"):
        env.pop(var, None)
    return env


def repo_with(tmp_path: Path, max_output_tokens: int) -> Path:
    """A workspace whose config caps the random model's answers (it never stops by itself)."""
    repo = tmp_path / "repo"
    (repo / ".composer").mkdir(parents=True)
    (repo / ".composer" / "config.toml").write_text(
        f"max_output_tokens = {max_output_tokens}\nmax_turns = 1\n"
    )
    (repo / "a.py").write_text("x = 1\n")
    return repo


# -- which path is taken ------------------------------------------------------------------------------


def test_an_endpoint_anywhere_is_found_and_none_means_the_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    repo = tmp_path / "repo"
    repo.mkdir()
    assert endpoint_source(repo, {"base_url": None, "model": "m"}, env={}) is None
    assert endpoint_source(repo, {"base_url": "http://h/v1"}, env={}) == "--base-url"
    assert endpoint_source(repo, {}, env={"COMPOSER_BASE_URL": "http://h/v1"}) == "COMPOSER_BASE_URL"
    user = tmp_path / "xdg" / "composer" / "config.toml"
    user.parent.mkdir(parents=True)
    user.write_text("max_turns = 3\n")
    assert endpoint_source(repo, {}, env={}) is None  # a config file without base_url is not an endpoint
    user.write_text('base_url = "http://h/v1"\n')
    assert endpoint_source(repo, {}, env={}) == str(user)
    user.unlink()
    (repo / ".composer").mkdir()
    (repo / ".composer" / "config.toml").write_text('base_url = "http://h/v1"\n')
    assert endpoint_source(repo, {}, env={}) == str(repo / ".composer" / "config.toml")


def test_the_shipped_checkpoint_is_located_without_importing_serve(monkeypatch):
    monkeypatch.delenv("COMPOSER_BUILTIN_MODEL", raising=False)
    code = (
        "import sys; from agent.builtin_model import builtin_model_dir; print(builtin_model_dir()); "
        "print('serve' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert Path(out[0]) == Path(__file__).parents[2] / "serve" / "builtin" / "composer-tiny"
    assert out[1] == "False False"
    assert builtin_model_dir() == Path(out[0])


def test_without_the_serve_extra_the_agent_says_which_extra(tmp_path):
    from tests.agent.test_extras import SERVE, without

    repo = tmp_path / "repo"
    repo.mkdir()
    p = without(tmp_path, SERVE, [str(BIN / "composer-agent"), "--task", "hi"], repo)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "`serve` extra" in p.stderr and "--base-url" in p.stderr


def test_a_broken_builtin_checkpoint_is_one_error_line_with_the_servers_reason(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # no tokenizer, no weights
    repo = repo_with(tmp_path, 8)
    p = subprocess.run(
        [str(BIN / "composer-agent"), "--cwd", str(repo), "--task", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env=agent_env(tmp_path, bad),
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr.split("exited with code")[0], p.stderr
    assert "the built-in model server exited with code" in p.stderr
    assert "has no tokenizer.json" in p.stderr  # the server's own reason (its missing tokenizer) is shown
    assert "Fatal Python error" not in p.stderr  # the stdin watchdog does not trip the server's shutdown
    assert gone(bad, 1)


# -- the child's life ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_task_with_no_endpoint_serves_the_builtin_says_so_and_stops_it(tmp_path, checkpoint):
    repo = repo_with(tmp_path, 8)
    p = subprocess.run(
        [str(BIN / "composer-agent"), "--cwd", str(repo), "--task", "hi", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env=agent_env(tmp_path, checkpoint),
    )
    events = [json.loads(line) for line in p.stdout.splitlines()]
    started = next(e for e in events if e["type"] == "session_started")
    assert started["model"] == "composer-tiny" and started["base_url"].startswith("http://127.0.0.1:")
    assert events[-1]["type"] == "finished", p.stderr
    assert p.stderr.splitlines().count(NOTICE) == 1 and "--base-url" in NOTICE, p.stderr
    assert p.stderr.startswith("composer-agent: read-only: "), p.stderr  # what it may change comes first
    assert gone(checkpoint, 1), "the child server outlived composer-agent"
    with pytest.raises(OSError):  # nothing answers on its port any more
        urllib.request.urlopen(started["base_url"].removesuffix("/v1") + "/health", timeout=2)


@pytest.mark.slow
def test_plain_mode_with_no_endpoint_uses_the_builtin_and_stops_it_on_eof(tmp_path, checkpoint):
    repo = repo_with(tmp_path, 8)
    p = subprocess.run(
        [str(BIN / "composer-agent"), "--cwd", str(repo), "--plain"],
        input="hello\n",
        capture_output=True,
        text=True,
        timeout=180,
        env={**agent_env(tmp_path, checkpoint), "TERM": "dumb"},
    )
    assert p.returncode == 0, p.stderr
    said = [line for line in (p.stderr + p.stdout).splitlines() if "no model server" in line]
    assert len(said) == 1 and "composer-tiny" in said[0], p.stderr + p.stdout  # said once, not twice in a row
    assert gone(checkpoint, 1)


def start_agent(tmp_path: Path, checkpoint: Path) -> tuple[subprocess.Popen, dict]:
    """composer-agent --task --json on the built-in model, answering at length; returns once the
    session has started (so the child is up and a turn is running)."""
    repo = repo_with(tmp_path, 4000)
    proc = subprocess.Popen(
        [str(BIN / "composer-agent"), "--cwd", str(repo), "--task", "hi", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=agent_env(tmp_path, checkpoint),
    )
    for line in proc.stdout:
        event = json.loads(line)
        if event["type"] == "session_started":
            return proc, event
    raise AssertionError(f"no session started: {proc.stderr.read()}")


@pytest.mark.slow
def test_the_child_dies_with_the_agent_on_sigkill(tmp_path, checkpoint):
    proc, _ = start_agent(tmp_path, checkpoint)
    assert proc.poll() is None and serve_children(checkpoint)
    proc.kill()  # no finally, no atexit: only the kernel (PR_SET_PDEATHSIG) or the stdin pipe can tell it
    proc.wait()
    assert gone(checkpoint), "the child server survived a SIGKILL of composer-agent"


@pytest.mark.slow
def test_ctrl_c_mid_turn_interrupts_and_stops_the_child(tmp_path, checkpoint):
    proc, _ = start_agent(tmp_path, checkpoint)
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert json.loads(out.splitlines()[-1])["status"] == "interrupted"
    assert gone(checkpoint, 1), "the child server outlived composer-agent after Ctrl-C"


@pytest.mark.slow
def test_composer_serve_with_no_model_serves_the_builtin(tmp_path, checkpoint):
    env = {**os.environ, "COMPOSER_BUILTIN_MODEL": str(checkpoint)}
    proc = subprocess.Popen(
        [str(BIN / "composer-serve"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("composer-serve: serving composer-tiny at http://127.0.0.1:"), line
        base = line.split(" at ")[1].split()[0]
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/models", timeout=2) as r:
                    models = json.load(r)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["composer-tiny"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_composer_serve_with_no_model_and_no_builtin_says_so(tmp_path):
    env = {**os.environ, "COMPOSER_BUILTIN_MODEL": str(tmp_path / "missing")}
    p = subprocess.run(
        [str(BIN / "composer-serve"), "--port", "0"], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 2 and "built-in model is not installed" in p.stderr and "--model" in p.stderr


@pytest.mark.slow
def test_a_terminal_sees_a_live_line_while_loading_and_ctrl_c_there_stops_the_child(tmp_path, checkpoint):
    pexpect = pytest.importorskip("pexpect")
    repo = repo_with(tmp_path, 8)
    child = pexpect.spawn(
        str(BIN / "composer-agent"),
        ["--cwd", str(repo), "--task", "hi"],
        env=agent_env(tmp_path, checkpoint),
        encoding="utf-8",
        timeout=120,
    )
    child.expect_exact("small built-in model")
    child.expect(r"loading the built-in model\.\.\. \d+ s")
    assert serve_children(checkpoint)  # loading
    child.sendintr()  # the terminal's Ctrl-C: SIGINT to its foreground process group
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130 and "Traceback" not in child.before, child.before
    assert gone(checkpoint, 1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_full_screen_interface_with_no_endpoint_connects_to_the_builtin_and_stops_it(
    tmp_path, checkpoint
):
    from tests.agent.tui.test_tmux import Tmux

    repo = repo_with(tmp_path, 8)
    env = agent_env(tmp_path, checkpoint)
    command = shlex.join(
        [
            "env",
            "-u",
            "COMPOSER_BASE_URL",
            f"XDG_CONFIG_HOME={env['XDG_CONFIG_HOME']}",
            f"COMPOSER_BUILTIN_MODEL={checkpoint}",
            str(BIN / "composer-agent"),
            "--cwd",
            str(repo),
        ]
    )
    tmux = Tmux()
    try:
        assert (
            tmux("new-session", "-d", "-s", "ui", "-x", "110", "-y", "32", command + "; sleep 30").returncode
            == 0
        )
        tmux.wait_for("Ask Composer", timeout=120)
        tmux.wait_for("composer-tiny", timeout=60)  # connected to the built-in model
        assert serve_children(checkpoint)
        tmux("send-keys", "-t", "ui", "C-d")
        assert gone(checkpoint), "the child server outlived the full-screen interface"
    finally:
        tmux("kill-server")


# -- how it is served ---------------------------------------------------------------------------------


def test_the_builtin_model_is_served_in_the_dtype_it_asks_for(checkpoint, tmp_path, monkeypatch):
    """The shipped model asks for float64 (composer_policy.json serve_dtype), so that greedy answers do
    not hinge on a CPU's float32 rounding; both ways of serving it (composer-agent's child, composer-serve
    with no --model) honour it, and a checkpoint that asks for nothing is served as before (float32)."""
    import io
    import json
    import shutil

    from agent.builtin_model import start_builtin
    from serve.cli import BUILTIN_DIR

    assert json.loads((BUILTIN_DIR / "composer_policy.json").read_text())["serve_dtype"] == "float64"
    asks = tmp_path / "composer-tiny"
    shutil.copytree(checkpoint, asks)
    (asks / "composer_policy.json").write_text(json.dumps({"policy_version": 0, "serve_dtype": "float64"}))
    for model, dtype in ((asks, "float64"), (checkpoint, "float32")):
        monkeypatch.setenv("COMPOSER_BUILTIN_MODEL", str(model))
        with start_builtin(out=io.StringIO()) as server:
            ready = "".join(server._stdout)
        assert f"torch.{dtype}" in ready, ready
        # float64 never takes the float32 C++ kernels (its own float64 ones where built)
        assert dtype != "float64" or "decode attention: paged CPU kernel" not in ready
        assert gone(model)
    monkeypatch.setenv("COMPOSER_BUILTIN_MODEL", str(asks))
    p = subprocess.Popen([str(BIN / "composer-serve"), "--port", "0"], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "COMPOSER_KERNEL_BUILD": "0"})
    try:
        line = p.stdout.readline()
    finally:
        p.terminate()
        p.wait(30)
    assert "serving composer-tiny at" in line and "torch.float64" in line, line
