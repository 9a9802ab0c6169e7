"""Which interface `composer-agent` opens, and with which approval mode."""

from __future__ import annotations

import io

import pytest

from agent import cli
from agent.config import load_config


def test_interactive_default_is_ask_unless_a_file_or_flag_says_otherwise(tmp_path):
    assert load_config(tmp_path, {}, env={}, defaults={"approval": "ask"}).approval == "ask"
    assert load_config(tmp_path, {}, env={}).approval == "auto"  # no front-end's default: eval and RL build on it
    (tmp_path / ".composer").mkdir()
    (tmp_path / ".composer" / "config.toml").write_text('approval = "auto"\n')
    assert load_config(tmp_path, {}, env={}, defaults={"approval": "ask"}).approval == "auto"
    flags = {"approval": "read-only"}
    assert load_config(tmp_path, flags, env={}, defaults={"approval": "ask"}).approval == "read-only"


class Tty(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("term, stdin_tty, stdout_tty, full", [
    ("xterm-256color", True, True, True),
    ("dumb", True, True, False),
    ("", True, True, False),
    ("xterm-256color", True, False, False),  # output piped to a file or a log
    ("xterm-256color", False, True, False),  # input piped in
])
def test_full_screen_only_on_a_full_terminal(monkeypatch, term, stdin_tty, stdout_tty, full):
    monkeypatch.setenv("TERM", term)
    monkeypatch.setattr("sys.stdin", Tty(stdin_tty))
    monkeypatch.setattr("sys.stdout", Tty(stdout_tty))
    assert cli.full_terminal() is full
