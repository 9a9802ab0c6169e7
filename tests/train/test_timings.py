"""SFT's varied tool timings (train/timings.py): only the times change, the expert's answers stay
token-exact, and the episode is still one append-only sample."""

from __future__ import annotations

import random

from agent.session import load
from serve.chat_format import ChatFormat
from train.samples import build_samples
from train.timings import SHELL_TIME, retime, slowness, vary_timings

SHELL = ("..F..                                                                    [100%]\n"
         "E       assert 3.333 == 3.33\ntests/test_money.py:16: AssertionError\n"
         "1 failed, 4 passed in 0.03s\n[exit code 1; 0.3 s]")


def test_retime_scales_the_shell_and_pytest_times_and_nothing_else():
    out = retime(SHELL, 10.0, random.Random(0))
    head, pytest_line, shell_line = out.rsplit("\n", 2)
    assert head == SHELL.rsplit("\n", 2)[0]  # test output, line numbers and asserted values untouched
    assert 0.24 <= float(pytest_line.removeprefix("1 failed, 4 passed in ").removesuffix("s")) <= 0.36
    assert shell_line.startswith("[exit code 1; ") and 2.4 <= float(shell_line[14:-3]) <= 3.6
    assert retime(SHELL, 1.0, random.Random(0)) == SHELL
    assert retime("no times here 0.3 s", 10.0, random.Random(0)) == "no times here 0.3 s"
    killed = retime("out\n[timed out after 30 s: killed (exit code -9); 30.0 s]", 0.5, random.Random(1))
    assert killed.startswith("out\n[timed out after 30 s: killed (exit code -9); ") and not killed.endswith("30.0 s]")


def test_slowness_keeps_the_recorded_times_about_as_often_as_asked():
    rng = random.Random(0)
    draws = [slowness(rng, keep=0.5) for _ in range(2000)]
    assert 900 < sum(d == 1.0 for d in draws) < 1100
    varied = [d for d in draws if d != 1.0]
    assert min(varied) >= 0.3 and max(varied) <= 30.0 and sum(d > 3 for d in varied) > 300


def test_varied_episode_keeps_the_expert_answers_token_exact(tiny, expert_data):
    chat = ChatFormat(tiny)
    timed = 0
    for path in sorted((expert_data / "sessions").glob("*.jsonl")):
        data = load(path)
        before = build_samples(data, chat=chat)
        varied = vary_timings(data, chat, random.Random(3), keep=0.0)
        after = build_samples(varied, chat=chat)  # raises if a prompt is not what the chat format renders
        assert len(before) == len(after) == 1
        b, a = before[0], after[0]
        assert [t for t, m in zip(b.token_ids, b.mask, strict=True) if m] == [t for t, m in zip(a.token_ids, a.mask, strict=True) if m]
        tools = [rec["message"]["content"] for rec in varied.records
                 if rec["type"] == "message" and rec["message"]["role"] == "tool"]
        originals = [rec["message"]["content"] for rec in data.records
                     if rec["type"] == "message" and rec["message"]["role"] == "tool"]
        assert len(tools) == len(originals)
        if any(SHELL_TIME.search(t) for t in originals):  # bugfix runs its tests; find-def only greps
            timed += 1
            assert a.token_ids != b.token_ids and tools != originals
        else:
            assert a.token_ids == b.token_ids and tools == originals
        assert load(path).records == data.records  # the recorded session is not modified
    assert timed >= 1
