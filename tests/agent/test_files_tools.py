"""read_file, write_file and path confinement, on real files."""

from __future__ import annotations

import os
import stat

import pytest

from agent.tools import Workspace

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
