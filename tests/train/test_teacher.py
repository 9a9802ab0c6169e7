"""Teacher data without token ids (train/teacher.py, `composer-train sft`): the scripted expert's sessions,
recorded through the real harness against a token server, rendered from their text give exactly the ids
that were recorded; the same conversations as OpenAI-style transcripts too; what cannot be taught is
refused with the reason."""

from __future__ import annotations

import json

import pytest

from agent.session import load
from agent.tools import default_registry
from serve.chat_format import ChatFormat
from train.cli import main as train_main
from train.samples import TOKEN_FIELDS, build_samples
from train.teacher import TeacherError, render_samples, session_samples, teacher_samples, transcript_requests


@pytest.fixture(scope="module")
def expert_sessions(expert_data):
    return sorted((expert_data / "sessions").glob("*.jsonl"))


def strip_ids(src, dst):
    """The session as a server without token ids would have left it."""
    lines = []
    for line in src.read_text().splitlines():
        rec = json.loads(line)
        for k in (*TOKEN_FIELDS, "policy_version", "routed_experts"):
            rec.pop(k, None)
        lines.append(json.dumps(rec))
    dst.write_text("\n".join(lines) + "\n")
    return dst


def test_rendered_sessions_are_the_recorded_ids(tiny, expert_sessions, tmp_path):
    chat = ChatFormat(tiny)
    spec = default_registry().spec_hash()
    for path in expert_sessions:
        exact = build_samples(load(path), chat=chat, spec_hash=spec)
        text_only = load(strip_ids(path, tmp_path / path.name))
        rendered = session_samples(text_only, chat, expected_hash=spec)
        assert [(s.token_ids, s.mask) for s in rendered] == [(s.token_ids, s.mask) for s in exact]
        assert sum(s.sampled_tokens for s in rendered) > 50


def test_a_transcript_of_the_same_conversation_renders_the_same(tiny, expert_sessions, tmp_path):
    chat = ChatFormat(tiny)
    data = load(expert_sessions[0])
    messages = data.segments[0]
    transcript = tmp_path / "t.json"
    transcript.write_text(json.dumps({"messages": messages, "tools": data.meta["tools"]}))
    exact = build_samples(data, chat=chat)
    (got,) = teacher_samples(transcript, chat)
    assert (got.token_ids, got.mask) == (exact[0].token_ids, exact[0].mask)
    bare = tmp_path / "bare.jsonl"  # JSONL of bare message lists: this version's tools are assumed
    bare.write_text(json.dumps(messages) + "\n" + json.dumps(messages) + "\n")
    assert [s.token_ids for s in teacher_samples(bare, chat)] == [exact[0].token_ids] * 2


def test_what_cannot_be_taught_is_refused_with_the_reason(tiny, expert_sessions):
    chat = ChatFormat(tiny)
    data = load(expert_sessions[0])
    msgs, tools = data.segments[0], data.meta["tools"]
    spec = default_registry().spec_hash()
    with pytest.raises(TeacherError, match="tools hash to"):
        render_samples("x", transcript_requests(msgs), tools[:-1], chat, expected_hash=spec)
    bad = [dict(m) for m in msgs]
    i = next(i for i, m in enumerate(bad) if m.get("tool_calls"))
    bad[i] = {**bad[i], "tool_calls": [{"id": "c", "type": "function",
                                         "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}]}
    with pytest.raises(TeacherError, match="'shell' .* does not fit the tools' schemas"):
        render_samples("x", transcript_requests(bad), tools, chat, expected_hash=spec)
    with pytest.raises(TeacherError, match="no assistant message"):
        render_samples("x", transcript_requests(msgs[:2]), tools, chat)


def test_sft_trains_on_text_only_sessions_and_transcripts(tiny, expert_sessions, tmp_path, capsys):
    folder = tmp_path / "teacher"
    folder.mkdir()
    strip_ids(expert_sessions[0], folder / "a.jsonl")
    data = load(expert_sessions[1])
    (folder / "b.json").write_text(json.dumps({"messages": data.segments[0], "tools": data.meta["tools"]}))
    (folder / "c.json").write_text(json.dumps([{"role": "user", "content": "hi"},
                                               {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                "function": {"name": "nope", "arguments": "{}"}}]}]))
    # composer-train sft in this process (its main and argument parsing): a subprocess re-imported torch
    capsys.readouterr()
    code = train_main(["sft", str(folder), str(expert_sessions[2]), "--model", str(tiny), "--out",
                       str(tmp_path / "sft"), "--batch", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "1 sessions token-exact, 2 rendered" in err and "1 refused" in err
    assert "c.json" in err and "'nope'" in err  # the reason, named
    assert (tmp_path / "sft" / "composer_policy.json").exists()
