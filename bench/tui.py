"""The TUI's feel, measured in a real pseudo-terminal: start-up, and keeping up with a fast stream.

    python bench/tui.py [--repeat 10] [--tokens 1200] [--rate 200] [--plain]

1. Start-up: spawn `python -m agent.cli` in a pty (120x40) against a scripted loopback server and
   time until the input box is painted (its placeholder appears in the terminal's output) and until
   the status bar shows the model (the connection is up). Median, min and max of --repeat runs.
2. Streaming: the server streams --tokens words, one per SSE chunk, at --rate chunks/s (a token is
   taken as a word here). For every word, the latency from the server writing it to the terminal
   showing it, measured on one clock (the server runs in this process); plus how many screen updates
   per second the app wrote, and how far behind the last word was painted. Goal: no visible lag,
   i.e. latency within a couple of frames (Textual paints at most 60 frames/s).

Figures depend on the machine; the CPU count is printed with them.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pexpect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.scripted import ScriptedServer  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")
WORD = re.compile(r"w(\d{5})")


def spawn(repo: Path, base_url: str, plain: bool = False) -> pexpect.spawn:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLORTERM": "truecolor",
           "XDG_CONFIG_HOME": str(repo / ".xdg")}
    argv = ["-m", "agent.cli", "--cwd", str(repo), "--base-url", base_url, "--approval", "auto"]
    argv += ["--plain"] if plain else []
    return pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", codec_errors="replace",
                         dimensions=(40, 120), timeout=30)


def read_until(child: pexpect.spawn, text: str, start: float, timeout: float = 20.0) -> float:
    """Seconds from `start` until `text` shows up in the (ANSI-stripped) output."""
    seen = ""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        try:
            seen += child.read_nonblocking(65536, timeout=0.005)
        except pexpect.TIMEOUT:
            continue
        if text in ANSI.sub("", seen):
            return time.perf_counter() - start
    raise RuntimeError(f"{text!r} never appeared")


def quit_app(child: pexpect.spawn) -> None:
    child.sendcontrol("q")  # the TUI's quit key; line mode gets Ctrl-D below
    child.sendcontrol("d")
    try:
        child.expect(pexpect.EOF, timeout=5)
    except pexpect.TIMEOUT:
        child.terminate(force=True)
    child.close()


def bench_startup(repo: Path, repeat: int) -> None:
    ready, connected = [], []
    with ScriptedServer([]) as srv:
        for _ in range(repeat + 1):
            start = time.perf_counter()
            child = spawn(repo, srv.base_url)
            ready.append(read_until(child, "Ask Composer", start))
            connected.append(read_until(child, "scripted-model", start))
            quit_app(child)
    ready, connected = ready[1:], connected[1:]  # the first run warms the page cache
    for name, xs in (("launch → input box painted", ready), ("launch → connected (model shown)", connected)):
        print(f"{name:<36} median {1e3 * statistics.median(xs):6.0f} ms   "
              f"min {1e3 * min(xs):5.0f}   max {1e3 * max(xs):5.0f}   (n={len(xs)})")


def answer(tokens: int) -> str:
    """A plausible answer: paragraphs of 40 words, a bulleted list now and then."""
    out = []
    for i in range(tokens):
        sep = " "
        if i % 40 == 39:
            sep = "\n\n" if (i // 40) % 3 else "\n\n- "
        out.append(f"w{i:05d}{sep}")
    return "".join(out)


def bench_stream(repo: Path, tokens: int, rate: float, plain: bool = False) -> None:
    text = answer(tokens)
    turn = {"content": text, "delay_s": 1.0 / rate}
    with ScriptedServer([turn], chunk_chars=7) as srv:  # about one "w00000 " word per chunk
        child = spawn(repo, srv.base_url, plain)
        read_until(child, "scripted-model", time.perf_counter())
        time.sleep(0.3)
        child.send("stream please\r")
        first_seen: dict[int, float] = {}
        tail, writes, deadline = "", [], time.perf_counter() + tokens / rate * 3 + 10
        while len(first_seen) < tokens and time.perf_counter() < deadline:
            try:
                chunk = child.read_nonblocking(1 << 20, timeout=0.002)
            except pexpect.TIMEOUT:
                continue
            now = time.perf_counter()
            writes.append(now)
            # A word can straddle two reads: search up to the last blank, keep the rest for the next read.
            pending = tail + chunk
            cut = max(pending.rfind(" "), pending.rfind("\n")) + 1
            for m in WORD.finditer(ANSI.sub("", pending[:cut])):
                first_seen.setdefault(int(m.group(1)), now)
            tail = pending[cut:]
        try:  # let the turn end (usage shown) before quitting, or the server writes into a closed socket
            read_until(child, "tok/s", time.perf_counter(), timeout=10)
        except RuntimeError:
            pass
        quit_app(child)
        # A word counts as sent when the chunk holding its last character was written.
        streamed, ends = "", []
        for t, piece in srv.content_sent:
            streamed += piece
            ends.append((len(streamed), t))
        sent, k = [], 0
        for m in WORD.finditer(streamed):
            while ends[k][0] < m.end():
                k += 1
            sent.append((ends[k][1], int(m.group(1))))
    lat = [first_seen[i] - t for t, i in sent if i in first_seen]
    missing = tokens - len(first_seen)
    span = sent[-1][0] - sent[0][0]
    during = [w for w in writes if sent[0][0] <= w <= sent[-1][0] + 0.5]
    print(f"{'line mode' if plain else 'TUI'} stream: {tokens} words sent in {span:.2f} s = {tokens / span:.0f} words/s "
          f"(target {rate:.0f})" + (f"; {missing} words never seen on screen" if missing else ""))
    qs = statistics.quantiles(lat, n=100)
    print(f"server write → on screen   p50 {1e3 * qs[49]:5.0f} ms   p95 {1e3 * qs[94]:5.0f} ms   "
          f"max {1e3 * max(lat):5.0f} ms")
    last = sent[-1]
    if last[1] in first_seen:
        print(f"last word painted {1e3 * (first_seen[last[1]] - last[0]):.0f} ms after it was sent")
    print(f"terminal writes while streaming: {len(during) / (span + 0.5):.0f}/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1200)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--plain", action="store_true", help="also stream through line mode, for comparison")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        bench_startup(repo, args.repeat)
        bench_stream(repo, args.tokens, args.rate)
        if args.plain:
            bench_stream(repo, args.tokens, args.rate, plain=True)


if __name__ == "__main__":
    main()
