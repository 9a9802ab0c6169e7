"""read_file, write_file and path confinement, on real files."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.config import Config
from agent.runtime import build
from agent.scripted import DeterministicModel
from agent.tools import Workspace
from tests.conftest import git

from .helpers import Tools


@pytest.fixture
def tools(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    return Tools(ws)


# ---- confinement ------------------------------------------------------------------------------

def test_relative_escape_is_refused(tools, tmp_path):
    (tmp_path / "secret.txt").write_text("s3cret")
    out = tools.err("read_file", path="../secret.txt")
    assert "outside the workspace" in out and "s3cret" not in out


def test_absolute_paths_inside_are_fine_outside_refused(tools, tmp_path):
    (tools.root / "a.txt").write_text("inside\n")
    assert "inside" in tools.ok("read_file", path=str(tools.root / "a.txt"))
    (tmp_path / "b.txt").write_text("outside\n")
    assert "outside the workspace" in tools.err("read_file", path=str(tmp_path / "b.txt"))
    assert "outside the workspace" in tools.err("write_file", path="/etc/composer-test", content="x")


def test_symlink_pointing_out_is_refused_for_read_and_write(tools, tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("original\n")
    os.symlink(target, tools.root / "link.txt")
    os.symlink(tmp_path, tools.root / "linkdir")
    assert "outside the workspace" in tools.err("read_file", path="link.txt")
    assert "outside the workspace" in tools.err("write_file", path="link.txt", content="pwned")
    assert "outside the workspace" in tools.err("write_file", path="linkdir/new.txt", content="pwned")
    assert "outside the workspace" in tools.err("edit_file", path="link.txt", old_string="original",
                                                new_string="pwned")
    assert target.read_text() == "original\n"
    assert not (tmp_path / "new.txt").exists()


def test_symlink_inside_the_workspace_is_followed(tools):
    (tools.root / "real.txt").write_text("one\n")
    os.symlink("real.txt", tools.root / "alias.txt")
    tools.ok("edit_file", path="alias.txt", old_string="one", new_string="two")
    assert (tools.root / "real.txt").read_text() == "two\n"
    assert os.path.islink(tools.root / "alias.txt")


def test_git_internals_are_never_written(git_repo):
    t = Tools(git_repo)
    head = (git_repo / ".git" / "HEAD").read_text()
    assert "HEAD" in t.ok("read_file", path=".git/HEAD") or head.strip() in t.ok("read_file", path=".git/HEAD")
    assert ".git" in t.err("write_file", path=".git/HEAD", content="ref: refs/heads/evil\n")
    assert ".git" in t.err("edit_file", path=".git/config", old_string="[core]", new_string="[x]")
    assert (git_repo / ".git" / "HEAD").read_text() == head


def test_an_added_root_is_allowed(tmp_path):
    ws, extra = tmp_path / "ws", tmp_path / "extra"
    ws.mkdir()
    extra.mkdir()
    (extra / "lib.txt").write_text("shared\n")
    t = Tools(ws)
    assert "outside" in t.err("read_file", path=str(extra / "lib.txt"))
    t.ctx.workspace = Workspace(ws, extra_roots=(extra,))
    assert "shared" in t.ok("read_file", path=str(extra / "lib.txt"))


# ---- read_file --------------------------------------------------------------------------------

def test_read_numbers_lines_and_pages(tools):
    (tools.root / "f.txt").write_text("".join(f"line {i}\n" for i in range(1, 3001)))
    out = tools.ok("read_file", path="f.txt")
    lines = out.splitlines()
    assert lines[0] == "     1\tline 1"
    assert lines[1999] == "  2000\tline 2000"
    assert "continue with offset=2001" in lines[-1]
    out = tools.ok("read_file", path="f.txt", offset=2999, limit=5)
    assert out.splitlines() == ["  2999\tline 2999", "  3000\tline 3000"]
    assert "past the end" in tools.err("read_file", path="f.txt", offset=3001)


def test_read_cuts_very_long_lines(tools):
    (tools.root / "min.js").write_text("x" * 50_000 + "\nshort\n")
    out = tools.ok("read_file", path="min.js")
    first = out.splitlines()[0]
    assert len(first) < 2100 and "line cut: 50000 chars" in first
    assert out.splitlines()[1] == "     2\tshort"


def test_read_refuses_binary_and_directories_and_explains_missing(tools):
    (tools.root / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(100))
    assert "binary file" in tools.err("read_file", path="img.png")
    (tools.root / "sub").mkdir()
    assert "directory" in tools.err("read_file", path="sub")
    (tools.root / "config.yaml").write_text("a: 1\n")
    out = tools.err("read_file", path="config.yml")
    assert "does not exist" in out and "config.yaml" in out


def test_read_empty_and_non_utf8(tools):
    (tools.root / "empty.txt").write_text("")
    assert "empty" in tools.ok("read_file", path="empty.txt")
    (tools.root / "latin.txt").write_bytes("café\n".encode("latin-1"))
    assert "café" in tools.ok("read_file", path="latin.txt")


# ---- write_file -------------------------------------------------------------------------------

def test_write_creates_parents_and_overwrites(tools):
    out = tools.ok("write_file", path="a/b/c.txt", content="hello\n")
    assert out.startswith("Created a/b/c.txt")
    assert (tools.root / "a/b/c.txt").read_text() == "hello\n"
    out = tools.ok("write_file", path="a/b/c.txt", content="bye\n")
    assert out.startswith("Overwrote")
    assert (tools.root / "a/b/c.txt").read_text() == "bye\n"
    assert not [p for p in (tools.root / "a/b").iterdir() if "composer-tmp" in p.name]


def test_write_keeps_crlf_bom_and_mode(tools):
    p = tools.root / "run.sh"
    p.write_bytes(b"\xef\xbb\xbfecho one\r\necho two\r\n")
    os.chmod(p, 0o755)
    tools.ok("write_file", path="run.sh", content="echo three\necho four\n")
    assert p.read_bytes() == b"\xef\xbb\xbfecho three\r\necho four\r\n"
    assert stat.S_IMODE(p.stat().st_mode) == 0o755


def test_write_new_file_gets_default_permissions(tools):
    tools.ok("write_file", path="n.txt", content="x")
    mode = stat.S_IMODE((tools.root / "n.txt").stat().st_mode)
    assert mode & 0o644 == 0o644 and not mode & 0o111


def test_write_to_a_directory_is_an_error(tools):
    (tools.root / "d").mkdir()
    assert "directory" in tools.err("write_file", path="d", content="x")


def test_write_reports_introduced_python_errors_only(tools):
    (tools.root / "m.py").write_text("print(undefined_a)\n")
    out = tools.ok("write_file", path="m.py", content="print(undefined_a)\nprint(undefined_b)\n")
    assert "introduced 1 lint error" in out and "undefined_b" in out and "undefined_a" not in out


# ---- kill -9 in the middle of a write ----------------------------------------------------------

BIG_OLD = "first line\n" + "old line\n" * 2_000_000  # 18 MB: the write and its fsync take a while
BIG_NEW = {"write_file": "new line\n" * 2_000_000, "edit_file": BIG_OLD.replace("first", "FIRST")}
_WRITER = """
import json, sys
from tests.agent.helpers import Tools
root, tool, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if tool == "write_file":
    args["content"] = "new line\\n" * 2_000_000
t = Tools(__import__("pathlib").Path(root))
print("ready", flush=True)
t.call(tool, **args)
print("wrote", flush=True)
"""


def _files_under(root) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        out |= {os.path.relpath(os.path.join(dirpath, f), root) for f in filenames}
    return out


def _kill_mid_write(root, tool: str, args: dict, before: set[str]) -> bool:
    """Run `tool` in a child process and SIGKILL it once a new file appears; True if the kill came
    before the write finished (a temp file was seen and the child never said it wrote)."""
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), tool, json.dumps(args)],
                             stdout=subprocess.PIPE, cwd=Path(__file__).parents[2], text=True)
    assert child.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and child.poll() is None:
        if _files_under(root) - before:
            child.send_signal(signal.SIGKILL)
            break
        time.sleep(0.0005)
    out, _ = child.communicate()
    return child.returncode == -signal.SIGKILL and "wrote" not in out


@pytest.mark.parametrize("tool,args", [
    ("write_file", {"path": "big.txt"}),
    ("edit_file", {"path": "big.txt", "old_string": "first line\n", "new_string": "FIRST line\n"}),
])
def test_kill_9_mid_write_leaves_nothing_the_user_sees(git_repo, tool, args):
    """Temp files of writes killed mid-way never show in list_dir, glob, grep or git status, the file is
    whole (old or new), and the next start removes them from disk."""
    root = git_repo
    (root / "big.txt").write_text(BIG_OLD)
    git(root, "add", "big.txt")
    git(root, "commit", "-qm", "big")
    Workspace(root).state_dir()  # .composer/ exists, as in any session, before the kills
    hits = 0
    for _ in range(12):
        hits += _kill_mid_write(root, tool, args, _files_under(root))
        if hits >= 3:
            break
    assert hits, "no kill landed in the middle of a write"
    content = (root / "big.txt").read_text()
    assert content in (BIG_OLD, BIG_NEW[tool])
    t = Tools(root)
    assert "composer-tmp" not in t.ok("list_dir") and "tmp" not in t.ok("list_dir")
    assert t.ok("glob", pattern="*").splitlines()[1:] == ["big.txt"]
    assert "1 file(s) match" in t.ok("grep", pattern="line")
    assert [ln for ln in git(root, "status", "--porcelain", "--untracked-files=all").splitlines()
            if not ln.endswith("big.txt")] == []
    build(Config(), root, emit=lambda e: None, model=DeterministicModel([])).session.close()
    leftovers = {f for f in _files_under(root) if os.path.getsize(root / f) > 1_000_000} - {"big.txt"}
    assert leftovers == set(), "a killed write's temp file was not cleaned at the next start"


def test_only_temp_files_of_dead_writers_are_removed(tmp_path):
    from agent.tools.fileio import _owner_tag, remove_stale_temps

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = _owner_tag().rpartition("~")[0]
    names = {"dead": f".a~b.c.{host}~{dead.pid}.x1y2.composer-tmp", "alive": f"{_owner_tag()}.q9.composer-tmp",
             "users": "notes.composer-tmp", "other_host": f"elsewhere~{dead.pid}.z.composer-tmp"}
    for name in names.values():
        (tmp_path / name).write_text("x")
    assert remove_stale_temps(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "dead")
