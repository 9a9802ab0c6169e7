"""Runs one shell command as the root of its process tree, so that a kill reaches all of it.

    python -I -S reaper.py STATUS_FD -- ARGV...

A process group is not enough: `setsid`, daemons and double forks leave the group, and their orphans
are re-parented to init where nobody can tell them apart. This process makes itself a child subreaper
(prctl PR_SET_CHILD_SUBREAPER, Linux), so every orphan of the tree is re-parented to it instead: the
tree's processes are exactly its descendants, whatever sessions or groups they moved to. On SIGTERM
(the shell tool's timeout or interrupt) it sends SIGTERM to every descendant, then after a short grace
SIGKILL until none is left, and reports on STATUS_FD (one JSON object) what it killed and what, if
anything, it could not. Without prctl (not Linux) it falls back to its process group and says so.

When the command ends by itself, background processes it started are left running, as a terminal
would; only a kill request sweeps the tree. Stdlib only, run with -S: it starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
TERM_GRACE_S = 1.0
KILL_DEADLINE_S = 5.0
POLL_S = 0.01

_kill_requested = False


def main(argv: list[str]) -> int:
    status_fd, command = int(argv[1]), argv[3:]
    os.set_inheritable(status_fd, False)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _request_kill)
    tracked = _become_subreaper()
    report: dict = {"tracked": tracked, "killed": 0, "survivors": []}
    try:
        child = os.posix_spawnp(command[0], command, dict(os.environ),
                                setsigdef=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
    except OSError as e:
        os.write(status_fd, json.dumps(report | {"spawn_error": f"{command[0]}: {e.strerror}"}).encode())
        return 127
    status = _wait_for(child)
    if status is None:  # a kill was requested while the command ran
        status, report["killed"], report["survivors"] = _kill_tree(child, tracked)
    report["exit_code"] = _exit_code(status)
    os.write(status_fd, json.dumps(report).encode())
    os.close(status_fd)
    code = report["exit_code"]
    return code if code is not None and code >= 0 else 128 + -(code or 0)


def _request_kill(signum, frame) -> None:
    global _kill_requested
    _kill_requested = True


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: no prctl
        return False


def _wait_for(child: int) -> int | None:
    """The command's wait status once it exits, reaping orphans meanwhile; None if a kill came first."""
    while not _kill_requested:
        status = _reap(child)
        if status is not None:
            return status
        time.sleep(POLL_S)
    return None


def _reap(child: int) -> int | None:
    """Reap every exited child (orphans of the tree come to us); return `child`'s status if it was one."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == child:
            found = status


def _kill_tree(child: int, tracked: bool) -> tuple[int | None, int, list[int]]:
    """TERM the whole tree, then KILL what is left; (command's wait status, processes signalled, survivors)."""
    me = os.getpid()
    signalled: set[int] = set()
    status = None
    for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, KILL_DEADLINE_S)):
        end = time.monotonic() + grace
        sent: set[int] = set()
        if sig == signal.SIGTERM:
            # The group at once, as a terminal's Ctrl-C would: signalled one by one, a child dying
            # first would let its parent run on a moment (`sleep; echo never` printing "never").
            in_group = _group_members(me)
            _send_group(me, sig)
            sent |= in_group
        while time.monotonic() < end:
            targets = _targets(me, tracked)
            if not targets:
                break
            # Parents before children, once each: processes forked meanwhile are caught on the next sweep.
            sent |= {pid for pid in targets if pid not in sent and _send(pid, sig)}
            time.sleep(POLL_S)
            found = _reap(child)
            status = found if found is not None else status
        signalled |= sent
    found = _reap(child)
    status = found if found is not None else status
    return status, len(signalled), sorted(_targets(me, tracked))


def _targets(me: int, tracked: bool) -> list[int]:
    """What a kill must reach, parents first: our live descendants; without a subreaper also our group."""
    targets = _live_descendants(me)
    if not tracked:
        targets += sorted(_group_members(me) - set(targets))
    return targets


def _send_group(me: int, sig: int) -> None:
    """Signal our process group (the command's, unless it left it); we only note the request ourselves."""
    try:
        os.killpg(os.getpgid(me), sig)
    except (ProcessLookupError, PermissionError):
        pass


def _send(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _processes() -> list[tuple[int, int, int, str]]:
    """(pid, parent pid, process group, state) of every process we can see."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # The command name may hold spaces and parentheses: the fields start after the last ")".
        fields = stat.rsplit(")", 1)[1].split()
        out.append((int(name), int(fields[1]), int(fields[2]), fields[0]))
    return out


def _live_descendants(root: int) -> list[int]:
    """Descendants of `root` that still run, breadth first (parents before their children); zombies
    are dead already: reaping them is enough."""
    children: dict[int, list[tuple[int, str]]] = {}
    for pid, ppid, _, state in _processes():
        children.setdefault(ppid, []).append((pid, state))
    live, level = [], [root]
    while level:
        nxt = []
        for parent in level:
            for pid, state in children.get(parent, []):
                nxt.append(pid)
                if state != "Z":
                    live.append(pid)
        level = nxt
    return live


def _group_members(me: int) -> set[int]:
    """Without a subreaper: the live processes of our own group (the old killpg reach), ourselves aside."""
    pgid = os.getpgid(me)
    return {pid for pid, _, group, state in _processes() if group == pgid and pid != me and state != "Z"}


def _exit_code(status: int | None) -> int | None:
    """The exit code, or -N for a command killed by signal N; None if it could not be reaped."""
    if status is None:
        return None
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
