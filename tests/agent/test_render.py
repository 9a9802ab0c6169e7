"""What both interactive front-ends say about events: summaries, diffs, hits, status, completion, history,
and the TUI's per-frame batching of events. Pure functions, tested on the data the tools really return."""

from __future__ import annotations

import asyncio
import threading

from agent import history
from agent.completion import suggest
from agent.protocol import (
    Finished,
    Retrying,
    SessionStarted,
    Summarized,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
    UsageReport,
)
from agent.render import (
    Status,
    approval_preview,
    call_brief,
    detail_lines,
    diff_lines,
    hit_lines,
    one_line,
    output_tail,
    result_summary,
    run_notice,
    typed_text,
)
from agent.tui.pump import EventPump, coalesce

from .helpers import Tools


def finished(name: str, result) -> ToolCallFinished:
    return ToolCallFinished(1, 0, "c1", name, result.ok, result.content, 0.1, result.data)


def test_summaries_of_real_tool_results(tmp_path):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    tools = Tools(tmp_path)
    edit = tools.call("edit_file", path="calc.py", old_string="a - b", new_string="a + b")
    assert result_summary(finished("edit_file", edit)) == "+1 −1"
    kinds = [k for k, _ in detail_lines(finished("edit_file", edit))]
    assert kinds == ["header", "header", "hunk", "context", "remove", "add"]
    new = tools.call("write_file", path="new.py", content="x = 1\ny = 2\n")
    assert result_summary(finished("write_file", new)) == "+2 −0 (new file)"

    sh = tools.call("shell", command="seq 1 30; exit 3")
    assert result_summary(finished("shell", sh)) == "exit 3"
    lines = detail_lines(finished("shell", sh))
    assert lines[0] == ("command", "$ seq 1 30; exit 3") and lines[-1] == ("status", "exit code 3")
    assert [ln for _, ln in lines[1:-1]] == ["…"] + [str(i) for i in range(19, 31)]  # the tail

    grep = tools.call("grep", pattern="return", output_mode="content")
    assert result_summary(finished("grep", grep)) == "1 matching line in 1 file"
    assert detail_lines(finished("grep", grep)) == [("hit", "calc.py:2: return a + b")]
    assert result_summary(finished("grep", tools.call("grep", pattern="zzz"))) == "0 files"

    read = tools.call("read_file", path="calc.py")
    assert result_summary(finished("read_file", read)) == "lines 1–2 of 2"
    missing = tools.call("read_file", path="nope.py")
    assert result_summary(finished("read_file", missing)).startswith("nope.py does not exist")
    todo = tools.call(
        "todo_write", todos=[{"content": "a", "status": "completed"}, {"content": "b", "status": "pending"}]
    )
    assert result_summary(finished("todo_write", todo)) == "1/2 done"
    assert detail_lines(finished("todo_write", todo)) == [("completed", "✓ a"), ("pending", "○ b")]


def test_declined_and_interrupted_calls_say_so():
    denied = ToolCallFinished(1, 0, "c", "shell", False, "Error: The user declined", 0.0, {"denied": True})
    assert result_summary(denied) == "declined"
    cut = ToolCallFinished(
        1,
        0,
        "c",
        "shell",
        False,
        "x\n[interrupted]",
        0.2,
        {"command": "sleep 9", "exit_code": 130, "interrupted": True},
    )
    assert result_summary(cut) == "interrupted"


def test_typed_text_drops_the_attached_files(tmp_path):
    from agent.mentions import expand
    from agent.tools import ToolContext

    (tmp_path / "a.py").write_text("x = 1\n")
    sent, attached = expand("look at @a.py", ToolContext.for_root(tmp_path))
    assert attached == ["a.py"] and typed_text(sent) == "look at @a.py"


def test_briefs_hits_and_lines():
    assert call_brief("shell", {"command": "pytest -q\necho done"}) == "pytest -q …"
    assert call_brief("grep", {"pattern": "def f", "path": "src"}) == "'def f' in src"
    assert call_brief("read_file", {"path": "a.py", "offset": 40}) == "a.py:40"
    assert call_brief("lint", {"paths": ["a.py", "b.py"]}) == "a.py, b.py"
    assert call_brief("todo_write", {"todos": [{}]}) == "1 item"
    assert call_brief("mystery", "raw text") == "raw text"
    assert one_line("x" * 10, 5) == "xxxx…"
    hits = [
        {"path": "a.py", "line": 3, "text": "  x = 1"},
        {"path": "b.py"},
        {"path": "c.py", "start_line": 10, "end_line": 20, "text": "def f():\n  pass"},
    ]
    assert hit_lines(hits) == ["a.py:3: x = 1", "b.py", "c.py:10-20: def f(): …"]
    assert hit_lines(hits, limit=1) == ["a.py:3: x = 1", "… 2 more"]
    assert output_tail("(no output)\n[exit code 0; 0.0 s]") == []
    assert diff_lines("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n c") == [
        ("header", "--- a/x"),
        ("header", "+++ b/x"),
        ("hunk", "@@ -1 +1 @@"),
        ("remove", "-a"),
        ("add", "+b"),
        ("context", " c"),
    ]


def test_approval_previews():
    q, lines = approval_preview("shell", {"command": "make\nmake test"})
    assert q == "Run this command?" and lines == [("command", "$ make"), ("command", "  make test")]
    q, lines = approval_preview(
        "edit_file", {"path": "a.py", "old_string": "x = 1\n", "new_string": "x = 2\n"}
    )
    assert q == "Edit a.py?" and ("remove", "-x = 1") in lines and ("add", "+x = 2") in lines
    _, lines = approval_preview("edit_file", {"path": "a.py", "old_string": "a - b", "new_string": "a + b"})
    assert lines[-2:] == [("remove", "-a - b"), ("add", "+a + b")]
    q, lines = approval_preview("write_file", {"path": "n.txt", "content": "a\nb\n"})
    assert q == "Write n.txt (2 lines)?" and lines == [("add", "+a"), ("add", "+b")]


def test_status_follows_events():
    s = Status(approval="ask")
    assert s.line(0) == "connecting… · approval: ask"
    s.apply(SessionStarted("id", "/r", "qwen", "http://x/v1", "h", 32768))
    s.apply(UsageReport(1, 3000, 200, 3000, 200, 32768, 0.1, 150.4))
    s.running_since = 10.0
    assert s.line(12.5) == "qwen · ctx 3.2k/32.8k (10%) · 150 tok/s · 2.5s · approval: ask"
    s.apply(Finished("completed", "", 1, 61.0, 3000, 200, "id"))
    assert s.line(99) == "qwen · ctx 3.2k/32.8k (10%) · 150 tok/s · 1m01s · approval: ask"
    assert not s.apply(ToolCallStarted(1, 0, "c", "shell", {}))


def test_run_notices():
    def fin(status, error=None):
        return Finished(status, "", 3, 1.0, 0, 0, "id", error)

    assert run_notice(fin("completed")) is None
    assert run_notice(fin("interrupted")) == ("warning", "Interrupted.")
    assert run_notice(fin("error", "401 bad key")) == ("error", "Error: 401 bad key")
    assert run_notice(fin("max_turns")) == ("warning", "Stopped at the turn limit (3 requests).")
    assert run_notice(Retrying(1, 2, 1.5, "HTTP 503")) == ("info", "Retrying in 1.5s (HTTP 503).")
    assert run_notice(Summarized(2, "…", 9000, 1200)) == ("info", "Context summarised (9000 → 1200 tokens).")
    assert run_notice(TextDelta(1, "x")) is None


def test_completion_offers_commands_and_files():
    files = ["agent/loop.py", "agent/cli.py", "README.md"]
    n, found = suggest("/u", lambda: files)
    assert n == 2 and [s.text for s in found] == ["/undo"]
    n, found = suggest("/mo", lambda: files)
    assert found[0].text == "/model " and found[0].label == "/model [NAME]"
    assert suggest("/undo", lambda: files) == (5, [])  # complete already
    assert suggest("/model gpt", lambda: files) == (0, [])
    n, found = suggest("look at @lo", lambda: files)
    assert n == 3 and found[0].text == "@agent/loop.py "
    assert suggest("mail me@lo", lambda: []) == (0, [])
    called = []
    suggest("plain text", lambda: called.append(1) or files)
    assert called == []  # listing files is only paid for when a mention is typed


def test_history_file_round_trip_and_cursor(tmp_path):
    path = history.history_path(tmp_path)
    assert history.load(path) == []
    for entry in ["one", "two\nlines", "two\nlines", "  ", "three"]:
        history.append(path, entry)
    assert history.load(path) == ["one", "two\nlines", "three"]
    assert (tmp_path / ".composer" / ".gitignore").exists()
    cur = history.Cursor(history.load(path))
    assert cur.older("draft") == "three" and cur.older("") == "two\nlines"
    assert cur.newer() == "three" and cur.newer() == "draft" and cur.newer() is None
    cur.add("four")
    assert cur.older("") == "four"


def test_coalesce_joins_text_per_turn_and_keeps_order():
    evs = [
        TextDelta(1, "a"),
        TextDelta(1, "b"),
        ToolCallStarted(1, 0, "c", "x", {}),
        TextDelta(1, "c"),
        TextDelta(2, "d"),
    ]
    assert coalesce(evs) == [TextDelta(1, "ab"), evs[2], TextDelta(1, "c"), TextDelta(2, "d")]


def test_the_pump_delivers_events_from_threads_in_one_batch_per_frame():
    async def body():
        batches = []

        async def apply(events):
            batches.append(events)

        loop = asyncio.get_running_loop()
        pump = EventPump(apply, frame_s=0.05)
        pump.attach(loop, lambda delay, cb: loop.call_later(delay, lambda: asyncio.ensure_future(cb())))
        workers = [
            threading.Thread(target=lambda i=i: [pump(TextDelta(1, f"{i}")) for _ in range(50)])
            for i in range(4)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        await asyncio.sleep(0.2)
        assert len(batches) == 1 and len(batches[0]) == 1  # 200 deltas → one flush, one joined delta
        assert sorted(batches[0][0].text) == sorted("0" * 50 + "1" * 50 + "2" * 50 + "3" * 50)

    asyncio.run(body())
