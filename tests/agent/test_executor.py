"""The executor: parallelism, ordering around writers, result order, and errors as observations."""

from __future__ import annotations

import json
import threading
import time

import pytest

from agent.tools import Executor, ToolCall, ToolContext, ToolResult, default_registry, tool
from agent.tools.registry import Registry


@pytest.fixture
def ctx(tmp_path):
    return ToolContext.for_root(tmp_path)


def call(name, i=0, **args):
    return ToolCall(f"call_{i}", name, json.dumps(args))


def test_three_sleeps_run_in_parallel(ctx):
    ex = Executor(default_registry(), ctx)
    calls = [call("shell", i, command=f"sleep 1; echo done-{i}") for i in range(3)]
    start = time.monotonic()
    results = ex.run(calls)
    elapsed = time.monotonic() - start
    assert [r.content.splitlines()[0] for r in results] == ["done-0", "done-1", "done-2"]
    assert elapsed < 2.0, f"three 1 s calls took {elapsed:.2f} s: not parallel"


def test_results_come_back_in_call_order_not_finish_order(ctx):
    ex = Executor(default_registry(), ctx)
    calls = [call("shell", 0, command="sleep 0.6; echo slow"), call("shell", 1, command="echo fast")]
    finished = []
    ex.on_finish = lambda i, c, r: finished.append(i)
    results = ex.run(calls)
    assert finished == [1, 0]
    assert [r.content.splitlines()[0] for r in results] == ["slow", "fast"]


def _recording_registry(log, lock):
    def make(name, parallel_safe, delay):
        def handler(ctx, label: str) -> ToolResult:
            with lock:
                log.append(("start", label, time.monotonic()))
            time.sleep(delay)
            with lock:
                log.append(("end", label, time.monotonic()))
            return ToolResult(label)

        handler.__doc__ = "Record.\n\nArgs:\n    label: Label.\n"
        handler.__name__ = name
        return tool(parallel_safe=parallel_safe)(handler)

    return Registry([make("reader", True, 0.3), make("writer", False, 0.2)])


def test_writers_wait_for_earlier_calls_and_block_later_ones(ctx):
    log, lock = [], threading.Lock()
    ex = Executor(_recording_registry(log, lock), ctx)
    seq = [("reader", "r1"), ("reader", "r2"), ("writer", "w1"), ("reader", "r3"), ("reader", "r4"),
           ("writer", "w2"), ("writer", "w3"), ("reader", "r5")]
    results = ex.run([call(n, i, label=lb) for i, (n, lb) in enumerate(seq)])
    assert [r.content for r in results] == [lb for _, lb in seq]
    t = {(kind, lb): ts for kind, lb, ts in log}
    # r1 and r2 overlap; w1 starts after both end; r3/r4 start after w1 ends and overlap each other.
    assert t[("start", "r2")] < t[("end", "r1")]
    assert t[("start", "w1")] >= max(t[("end", "r1")], t[("end", "r2")])
    assert min(t[("start", "r3")], t[("start", "r4")]) >= t[("end", "w1")]
    assert t[("start", "r4")] < t[("end", "r3")]
    assert t[("start", "w2")] >= max(t[("end", "r3")], t[("end", "r4")])
    assert t[("start", "w3")] >= t[("end", "w2")]
    assert t[("start", "r5")] >= t[("end", "w3")]
    starts = [lb for kind, lb, _ in log if kind == "start"]
    assert starts.index("w1") > starts.index("r2") and starts.index("r3") > starts.index("w1")


def test_a_real_edit_then_read_sees_the_edit(ctx, tmp_path):
    (tmp_path / "f.txt").write_text("before\n")
    ex = Executor(default_registry(), ctx)
    results = ex.run([
        call("read_file", 0, path="f.txt"),
        call("edit_file", 1, path="f.txt", old_string="before", new_string="after"),
        call("read_file", 2, path="f.txt"),
    ])
    assert "before" in results[0].content and results[1].ok and "after" in results[2].content


def test_incremental_submission_starts_calls_while_streaming(ctx):
    ex = Executor(default_registry(), ctx)
    turn = ex.turn()
    f1 = turn.submit(call("shell", 0, command="sleep 0.3; echo one"))
    time.sleep(0.1)
    assert not f1.done()
    turn.submit(call("shell", 1, command="echo two"))
    assert [r.content.splitlines()[0] for r in turn.results()] == ["one", "two"]


@pytest.mark.parametrize("name,args,expect", [
    ("no_such_tool", "{}", "unknown tool 'no_such_tool'; available tools: read_file"),
    ("read_file", "{not json", "not valid JSON"),
    ("read_file", "[1, 2]", "must be a JSON object"),
    ("read_file", "{}", "'path' is a required property"),
    ("read_file", '{"path": "a", "bogus": 1}', "unknown parameter(s) ('bogus' was unexpected)"),
    ("read_file", '{"path": 5}', "path: 5 is not of type 'string'"),
    ("grep", '{"pattern": "x", "output_mode": "lines"}', "output_mode: 'lines' is not one of"),
    ("read_file", '{"path": "a", "offset": 0}', "offset: 0 is less than the minimum of 1"),
])
def test_bad_calls_become_observations(ctx, name, args, expect):
    r = Executor(default_registry(), ctx).run([ToolCall("x", name, args)])[0]
    assert not r.ok and r.content.startswith("Error: ")
    assert expect in r.content


def test_common_model_slips_are_forgiven(ctx, tmp_path):
    (tmp_path / "f.txt").write_text("a\nb\nc\n")
    ex = Executor(default_registry(), ctx)
    args = json.dumps(json.dumps({"path": "f.txt", "offset": "2", "limit": 1.0}))  # double-encoded
    r = ex.run([ToolCall("x", "read_file", args)])[0]
    assert r.ok and r.content.splitlines()[0] == "     2\tb"
    r = ex.run([ToolCall("x", "grep", '{"pattern": "b", "path": null, "case_insensitive": "true"}')])[0]
    assert r.ok and "f.txt" in r.content
    r = ex.run([ToolCall("x", "lint", '{"paths": "[\\"f.txt\\"]"}')])[0]
    assert r.ok


def test_a_raising_tool_is_an_observation(ctx):
    @tool(parallel_safe=True)
    def boom(ctx) -> ToolResult:
        """Explode."""
        raise RuntimeError("kaput")

    r = Executor(Registry([boom]), ctx).run([ToolCall("x", "boom", "{}")])[0]
    assert not r.ok and "boom failed unexpectedly: RuntimeError: kaput" in r.content


def test_approval_can_refuse_with_a_reason(ctx, tmp_path):
    def approve(c, t, args):
        return "the user declined: not now" if t.mutates else None

    ex = Executor(default_registry(), ctx, approve=approve)
    r = ex.run([call("write_file", 0, path="x.txt", content="x"), call("list_dir", 1)])
    assert not r[0].ok and "not now" in r[0].content and r[0].data["denied"]
    assert not (tmp_path / "x.txt").exists() and r[1].ok


def test_a_calls_duration_leaves_out_the_wait_for_approval(ctx):
    """The person took 1 s to say yes to a 0.2 s command: the call took 0.2 s, and it waited 1 s."""
    def approve(c, t, args):
        time.sleep(1.0)
        return None

    finished = []
    ex = Executor(default_registry(), ctx, approve=approve, on_finish=lambda i, c, r: finished.append(r.duration_s))
    r = ex.run([call("shell", 0, command="sleep 0.2")])[0]
    assert r.ok and 0.15 < r.duration_s < 0.8 and r.approval_s >= 1.0, (r.duration_s, r.approval_s)
    assert finished == [r.duration_s]  # what the front-ends show


def test_cancel_skips_calls_not_yet_started(ctx):
    ex = Executor(default_registry(), ctx)
    ex.cancel()
    r = ex.run([call("list_dir", 0)])[0]
    assert not r.ok and "interrupted" in r.content
