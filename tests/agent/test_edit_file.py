"""edit_file: every match tier, every failure mode, and everything an edit must preserve."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from .helpers import Tools


@pytest.fixture
def tools(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    return Tools(ws)


def edit(tools, path, old, new, **kw):
    return tools.call("edit_file", path=path, old_string=old, new_string=new, **kw)


PY = """import os


def load(path):
    with open(path) as f:
        return f.read()


def save(path, text):
    with open(path, "w") as f:
        f.write(text)
"""


# ---- tiers ------------------------------------------------------------------------------------

def test_exact_unique_match(tools):
    p = tools.root / "m.py"
    p.write_text(PY)
    r = edit(tools, "m.py", "        return f.read()", "        return f.read().strip()")
    assert r.ok and r.data["tier"] == "exact" and "matched exactly" in r.content
    assert p.read_text() == PY.replace("return f.read()", "return f.read().strip()")
    assert "  6\t        return f.read().strip()" in r.content  # a numbered snippet of the result
    assert r.data["diff"].startswith("--- a/m.py\n+++ b/m.py\n")


def test_crlf_file_with_lf_old_string(tools):
    p = tools.root / "w.txt"
    p.write_bytes(b"alpha\r\nbeta\r\ngamma\r\n")
    r = edit(tools, "w.txt", "alpha\nbeta\n", "alpha\nBETA\nextra\n")
    assert r.ok and r.data["tier"] == "line_endings"
    assert p.read_bytes() == b"alpha\r\nBETA\r\nextra\r\ngamma\r\n"


def test_lf_file_with_crlf_old_string(tools):
    p = tools.root / "w.txt"
    p.write_bytes(b"alpha\nbeta\ngamma\n")
    r = edit(tools, "w.txt", "alpha\r\nbeta", "alpha\r\nB")
    assert r.ok and r.data["tier"] == "line_endings"
    assert p.read_bytes() == b"alpha\nB\ngamma\n"


def test_single_line_in_crlf_file_is_exact(tools):
    p = tools.root / "w.txt"
    p.write_bytes(b"alpha\r\nbeta\r\n")
    r = edit(tools, "w.txt", "beta", "BETA")
    assert r.ok and r.data["tier"] == "exact"
    assert p.read_bytes() == b"alpha\r\nBETA\r\n"


def test_trailing_whitespace_tier(tools):
    p = tools.root / "t.py"
    p.write_text("x = 1   \ny = 2\t\nz = 3\n")
    r = edit(tools, "t.py", "x = 1\ny = 2\n", "x = 10\ny = 20\n")
    assert r.ok and r.data["tier"] == "trailing_whitespace"
    assert p.read_text() == "x = 10\ny = 20\nz = 3\n"


def test_indentation_shift_is_reapplied_to_new_string(tools):
    p = tools.root / "m.py"
    p.write_text(PY)
    # The model dropped the function-body indentation in both strings.
    old = 'with open(path, "w") as f:\n    f.write(text)'
    new = 'with open(path, "w") as f:\n    f.write(text)\n    f.flush()'
    r = edit(tools, "m.py", old, new)
    assert r.ok and r.data["tier"] == "indentation"
    assert '    with open(path, "w") as f:\n        f.write(text)\n        f.flush()\n' in p.read_text()


def test_tabs_file_edited_with_spaces(tools):
    p = tools.root / "main.go"
    p.write_text("func main() {\n\tif x {\n\t\tfmt.Println(\"hi\")\n\t}\n}\n")
    old = "    if x {\n        fmt.Println(\"hi\")\n    }"
    new = "    if x {\n        fmt.Println(\"hello\")\n        return\n    }"
    r = edit(tools, "main.go", old, new)
    assert r.ok and r.data["tier"] == "indentation"
    assert p.read_text() == "func main() {\n\tif x {\n\t\tfmt.Println(\"hello\")\n\t\treturn\n\t}\n}\n"


def test_other_indent_unit_is_mapped(tools):
    p = tools.root / "k.py"
    p.write_text("class A:\n    def f(self):\n        if x:\n            return 1\n")
    old = "def f(self):\n  if x:\n    return 1"
    new = "def f(self):\n  if x:\n    return 2\n  return 0"
    r = edit(tools, "k.py", old, new)
    assert r.ok and r.data["tier"] == "indentation"
    assert p.read_text() == ("class A:\n    def f(self):\n        if x:\n            return 2\n"
                             "        return 0\n")


def test_unicode_quotes_in_file_ascii_in_old_string(tools):
    p = tools.root / "doc.md"
    p.write_text("He said \u201chello\u201d \u2014 and left\u2026\n")
    r = edit(tools, "doc.md", 'said "hello" - and', 'said "goodbye" - and')
    assert r.ok and r.data["tier"] == "unicode"
    assert p.read_text() == 'He said "goodbye" - and left\u2026\n'


def test_typographic_old_string_against_ascii_file(tools):
    p = tools.root / "a.py"
    p.write_text("msg = 'it''s'  # a\u00a0comment\nprint(msg)\n")
    r = edit(tools, "a.py", "msg = \u2018it\u2019\u2019s\u2019  # a comment", "msg = \"it's\"")
    assert r.ok and r.data["tier"] == "unicode"
    assert p.read_text() == "msg = \"it's\"\nprint(msg)\n"


def test_whitespace_tier_is_the_last_resort(tools):
    p = tools.root / "c.c"
    p.write_text("int main ( void ) {\n    return  0 ;\n}\n")
    r = edit(tools, "c.c", "int main ( void ) {\n  return 0 ;", "int main(void) {\n  return 1;")
    assert r.ok and r.data["tier"] == "whitespace"
    assert p.read_text() == "int main(void) {\n    return 1;\n}\n"


# ---- failures leave the file untouched ---------------------------------------------------------

def test_several_matches_list_their_lines(tools):
    p = tools.root / "m.py"
    p.write_text(PY)
    before = p.read_bytes()
    r = edit(tools, "m.py", "    with open(path", "    with  open(path")
    assert not r.ok
    assert "matches 2 places" in r.content and "lines 5, 10" in r.content
    assert "replace_all" in r.content and "unchanged" in r.content
    assert p.read_bytes() == before


def test_replace_all(tools):
    p = tools.root / "m.py"
    p.write_text(PY)
    r = edit(tools, "m.py", "path", "filename", replace_all=True)
    assert r.ok and r.data["replacements"] == 4
    assert "path" not in p.read_text()


def test_ambiguous_tolerant_match_is_refused(tools):
    p = tools.root / "t.txt"
    p.write_text("  a = 1\nb\n    a = 1\n")
    before = p.read_bytes()
    r = edit(tools, "t.txt", "a = 1\n", "a = 2\n")  # exact matches twice as substring
    assert not r.ok and "matches 2 places" in r.content
    r = edit(tools, "t.txt", "a  =  1", "a = 2")  # only whitespace-tolerant, twice
    assert not r.ok and "whitespace" in r.content and "lines 1, 3" in r.content
    assert p.read_bytes() == before


def test_no_match_shows_the_closest_region(tools):
    p = tools.root / "m.py"
    p.write_text(PY)
    before = p.read_bytes()
    r = edit(tools, "m.py", 'def save(path, txt):\n    with open(path, "w") as f:', "x")
    assert not r.ok
    assert "not found" in r.content and "lines 9-10" in r.content
    assert "     9\tdef save(path, text):" in r.content
    assert "First difference at line 9" in r.content
    assert p.read_bytes() == before


def test_no_match_with_nothing_similar(tools):
    (tools.root / "a.txt").write_text("alpha\n")
    r = edit(tools, "a.txt", "zzzz qqqq", "x")
    assert not r.ok and "not found" in r.content


def test_identical_strings_missing_file_binary_file(tools):
    (tools.root / "a.txt").write_text("alpha\n")
    assert "identical" in tools.err("edit_file", path="a.txt", old_string="alpha", new_string="alpha")
    assert "does not exist" in tools.err("edit_file", path="nope.txt", old_string="a", new_string="b")
    (tools.root / "b.bin").write_bytes(b"ab\x00cd")
    assert "binary" in tools.err("edit_file", path="b.bin", old_string="ab", new_string="x")


def test_empty_old_string_creates_a_missing_file_only(tools):
    out = tools.ok("edit_file", path="new/pkg/mod.py", old_string="", new_string="X = 1\n")
    assert out.startswith("Created new/pkg/mod.py")
    assert (tools.root / "new/pkg/mod.py").read_text() == "X = 1\n"
    out = tools.err("edit_file", path="new/pkg/mod.py", old_string="", new_string="Y = 2\n")
    assert "already has content" in out
    assert (tools.root / "new/pkg/mod.py").read_text() == "X = 1\n"
    (tools.root / "empty.txt").write_text("")
    tools.ok("edit_file", path="empty.txt", old_string="", new_string="filled\n")
    assert (tools.root / "empty.txt").read_text() == "filled\n"


# ---- preservation -----------------------------------------------------------------------------

def test_bom_encoding_final_newline_and_mode_are_kept(tools):
    p = tools.root / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbfone\ntwo")
    os.chmod(p, 0o751)
    tools.ok("edit_file", path="bom.txt", old_string="two", new_string="three")
    assert p.read_bytes() == b"\xef\xbb\xbfone\nthree"
    assert stat.S_IMODE(p.stat().st_mode) == 0o751

    q = tools.root / "latin.txt"
    q.write_bytes(b"caf\xe9 cr\xe8me\n")
    tools.ok("edit_file", path="latin.txt", old_string="cr\u00e8me", new_string="br\u00fbl\u00e9e")
    assert q.read_bytes() == b"caf\xe9 br\xfbl\xe9e\n"
    assert "cannot hold" in tools.err("edit_file", path="latin.txt", old_string="caf", new_string="\u4e2d")


def test_final_newline_presence_survives_sloppy_strings(tools):
    p = tools.root / "a.txt"
    p.write_text("one\ntwo\n")
    tools.ok("edit_file", path="a.txt", old_string="two\n", new_string="TWO")
    assert p.read_text() == "one\nTWO\n"
    q = tools.root / "b.txt"
    q.write_text("one\ntwo")
    tools.ok("edit_file", path="b.txt", old_string="two", new_string="TWO\n")
    assert q.read_text() == "one\nTWO"


def test_mixed_line_endings_stay_mixed(tools):
    p = tools.root / "mixed.txt"
    p.write_bytes(b"a\r\nb\nc\r\nd\n")
    tools.ok("edit_file", path="mixed.txt", old_string="b", new_string="B")
    assert p.read_bytes() == b"a\r\nB\nc\r\nd\n"


# ---- lint --------------------------------------------------------------------------------------

def test_reports_only_lint_errors_the_edit_introduced(tools):
    p = tools.root / "m.py"
    p.write_text("def f():\n    return undefined_old\n\n\ndef g():\n    return 1\n")
    r = edit(tools, "m.py", "    return 1", "    return undefined_new")
    assert r.ok
    assert "introduced 1 lint error" in r.content
    assert "m.py:6:12: F821 Undefined name `undefined_new`" in r.content
    assert "undefined_old" not in r.content.split("introduced")[1]
    r = edit(tools, "m.py", "def g():", "def g(:")
    assert r.ok and "invalid-syntax" in r.content  # the edit lands; the model is told it broke syntax
    r = edit(tools, "m.py", "def g(:", "def g():")
    assert r.ok and "lint error" not in r.content


# ---- atomicity ---------------------------------------------------------------------------------

def test_a_write_killed_midway_leaves_the_old_file(tools, tmp_path):
    target = tools.root / "big.txt"
    target.write_text("precious\n")
    script = (
        "import sys\nfrom pathlib import Path\nfrom agent.tools.fileio import atomic_write\n"
        "print('go', flush=True)\n"
        "atomic_write(Path(sys.argv[1]), b'x' * (1 << 30))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(target)], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"go\n"
    # Wait until the temp file is being written, then kill the writer mid-write.
    deadline = time.time() + 20
    while time.time() < deadline:
        temps = [p for p in tools.root.iterdir() if p.name.endswith(".composer-tmp")]
        if temps and temps[0].stat().st_size > 1 << 20:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert temps, "the writer never started writing"
    assert target.read_text() == "precious\n"
