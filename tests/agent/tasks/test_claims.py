"""Claims in final answers, checked against the episode's own tool log (agent/tasks/claims.py).

Fixtures in sessions/ are real sessions recorded through agent.tasks.runner on synthetic tasks: the
scripted expert's and the built-in model's (composer-tiny at T=0, 2026-11-27). The live tests run a
scripted model through the same runner, tools and session writer, so the log is what the agent writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import Config
from agent.scripted import ScriptedServer
from agent.session import load
from agent.tasks import runner
from agent.tasks.claims import (
    CONTRADICTED,
    SUPPORTED,
    UNSUPPORTED,
    Step,
    check_claims,
    check_session,
    counts,
    find_claims,
    steps_of,
)
from agent.tasks.families import generate

SESSIONS = Path(__file__).parent / "sessions"


def verdicts(claims):
    return {(c.kind, c.subject): c.status for c in claims}


def test_the_experts_passing_run_supports_every_claim():
    data = load(SESSIONS / "expert-bugfix-passed.jsonl")
    claims = check_session(data)
    assert verdicts(claims) == {("location", "to_minutes@pkg/dates.py"): SUPPORTED,
                                ("file_changed", "pkg/dates.py"): SUPPORTED, ("tests_pass", ""): SUPPORTED}
    tests = next(c for c in claims if c.kind == "tests_pass")
    assert "5 passed" in tests.evidence and tests.step == 3  # the run after the edit, not the first one


def test_the_builtin_model_naming_a_file_it_never_edited_is_contradicted():
    """composer-tiny fixed nothing (its edits missed, then went to a file that does not exist), re-ran
    the failing test and still answered "Fixed `perimeter` in pkg/geometry.py ... the tests pass"."""
    claims = check_session(load(SESSIONS / "builtin-bugfix-wrong-file.jsonl"))
    assert verdicts(claims) == {("location", "perimeter@pkg/geometry.py"): CONTRADICTED,
                                ("file_changed", "pkg/geometry.py"): CONTRADICTED, ("tests_pass", ""): CONTRADICTED}
    assert "1 failed" in next(c for c in claims if c.kind == "tests_pass").evidence
    assert "does not exist" in next(c for c in claims if c.kind == "file_changed").evidence


def test_a_missed_edit_contradicts_the_change_but_not_where_the_bug_is():
    claims = check_session(load(SESSIONS / "builtin-bugfix-edit-missed.jsonl"))
    assert verdicts(claims) == {("location", "repeat_word@pkg/text.py"): SUPPORTED,  # it did read the file
                                ("file_changed", "pkg/text.py"): CONTRADICTED, ("tests_pass", ""): CONTRADICTED}
    assert counts(claims) == {"claims": 3, SUPPORTED: 1, UNSUPPORTED: 0, CONTRADICTED: 2}


def test_a_line_number_no_tool_showed_is_unsupported():
    """grep listed the file only; "line 7" is right, but the run never saw it."""
    (claim,) = check_session(load(SESSIONS / "builtin-find-def.jsonl"))
    assert (claim.kind, claim.subject, claim.status) == ("location", "clamp@pkg/geometry.py:7", UNSUPPORTED)
    steps = steps_of(load(SESSIONS / "builtin-find-def.jsonl"))
    assert [s.name for s in steps] == ["grep"]
    (wrong,) = check_claims("`clamp` is defined in pkg/geometry.py.", steps)
    assert wrong.status == SUPPORTED  # the file alone is what grep showed


def test_a_semantic_search_snippet_is_evidence_for_its_own_file_only():
    """semantic_search prints "K. path:a-b  symbol (score)" and the hit's numbered lines under it."""
    out = ("1. pkg/dates.py:4-9  days_in_month  (score 0.8500)\n     4\tdef days_in_month(year, month):\n"
           "     5\t    return 30\n2. tests/test_dates.py:1-2  test_days  (score 0.61)\n"
           "     1\tdef test_days():\n     2\t    assert days_in_month(2024, 2) == 29\n")
    steps = [Step(0, 0, "semantic_search", {"query": "days_in_month", "k": 3}, out, True)]
    verdict = lambda answer: [(c.subject, c.status) for c in check_claims(answer, steps)]  # noqa: E731
    assert verdict("`days_in_month` is defined in pkg/dates.py, line 4.") == [("days_in_month@pkg/dates.py:4", SUPPORTED)]
    assert verdict("`days_in_month` is defined in pkg/dates.py, line 5.") == [("days_in_month@pkg/dates.py:5", CONTRADICTED)]
    # the other hit's lines are not lines of pkg/dates.py, and line 2 of the test file is not shown as pkg/dates.py's
    assert verdict("`days_in_month` is defined in pkg/dates.py, line 2.") == [("days_in_month@pkg/dates.py:2", UNSUPPORTED)]
    assert verdict("`days_in_month` is defined in pkg/other.py.") == [("days_in_month@pkg/other.py", UNSUPPORTED)]


def test_hedged_and_negated_statements_are_not_claims():
    assert find_claims("I did not run the tests. They should pass once the fix is in.") == []
    assert find_claims("I have not changed pkg/a.py.") == []
    kinds = [k for k, _, _ in find_claims("The failing test now passes; I created docs/notes.md.")]
    assert kinds == ["tests_pass", "file_created"]


def _record(tmp_path, turns, task=None):
    task = task or generate("bugfix", 3, "small")
    with ScriptedServer(turns) as srv:
        res = runner.run_episode(task, Config(base_url=srv.base_url, model="scripted-model"), keep_dir=tmp_path,
                                 sandbox=False)
    assert res.infra_error is None, res.infra_error
    return load(res.session_path)


def _call(name, **args):
    return {"name": name, "arguments": args}


TEST = "python -m pytest -q -p no:cacheprovider tests/test_dates.py"
FIX = _call("edit_file", path="pkg/dates.py", old_string="    return hours * 60 + hours",
            new_string="    return hours * 60 + minutes")


@pytest.mark.parametrize("turns, status", [
    ([{"tool_calls": [FIX]}], UNSUPPORTED),  # never ran the tests
    ([{"tool_calls": [_call("shell", command=TEST)]}, {"tool_calls": [FIX]}], UNSUPPORTED),  # ran them before the edit
    ([{"tool_calls": [FIX]}, {"tool_calls": [_call("shell", command=TEST)]}], SUPPORTED),
    ([{"tool_calls": [_call("shell", command=TEST)]}], CONTRADICTED),  # ran them, they failed, no edit
], ids=["never-ran", "ran-before-edit", "ran-after-edit", "ran-and-failed"])
def test_tests_pass_needs_a_passing_run_after_the_last_edit(tmp_path, turns, status):
    data = _record(tmp_path, [*turns, {"content": "Fixed `to_minutes` in pkg/dates.py and the tests pass."}])
    v = verdicts(check_session(data))
    assert v[("tests_pass", "")] == status
    assert v[("file_changed", "pkg/dates.py")] == (SUPPORTED if FIX in [c for t in turns for c in t["tool_calls"]]
                                                   else UNSUPPORTED)


def test_created_files_and_commands_from_a_live_run(tmp_path):
    turns = [{"tool_calls": [_call("write_file", path="notes/fix.md", content="to_minutes adds minutes\n"),
                             _call("shell", command="python -c 'import pkg.dates'")]},
             {"tool_calls": [_call("shell", command="python -c 'import pkg.nothere'")]},
             {"content": "I created notes/fix.md and pkg/extra.py. I ran `python -c 'import pkg.dates'` and it "
                         "succeeded; I ran `python -c 'import pkg.nothere'` and it worked. "
                         "I also ran `make lint` successfully."}]
    v = verdicts(check_session(_record(tmp_path, turns)))
    assert v == {("file_created", "notes/fix.md"): SUPPORTED, ("file_created", "pkg/extra.py"): UNSUPPORTED,
                 ("command_ok", "python -c 'import pkg.dates'"): SUPPORTED,
                 ("command_ok", "python -c 'import pkg.nothere'"): CONTRADICTED,
                 ("command_ok", "make lint"): UNSUPPORTED}


def test_a_shell_command_that_writes_counts_as_an_edit(tmp_path):
    turns = [{"tool_calls": [FIX]}, {"tool_calls": [_call("shell", command=TEST)]},
             {"tool_calls": [_call("shell", command="sed -i 's/60/61/' pkg/dates.py")]},
             {"content": "Updated pkg/dates.py. All tests pass."}]
    claims = check_session(_record(tmp_path, turns))
    v = verdicts(claims)
    assert v[("tests_pass", "")] == UNSUPPORTED and v[("file_changed", "pkg/dates.py")] == SUPPORTED
    assert "sed -i" in next(c for c in claims if c.kind == "tests_pass").evidence
