"""Reading and writing users' files without losing anything.

Text is decoded as UTF-8 (a BOM is remembered), UTF-16 with a BOM, or Latin-1 as a last resort, so
that writing back yields the same bytes everywhere the text did not change. Writes are atomic: a temp
file, fsync, rename; a crash mid-write leaves the old file or the new one, never a torn one. The file's
mode is kept.

Temp files go to `.composer/tmp/` (git-ignored, never listed), not beside the user's file, so a write
killed with -9 leaves nothing in the user's folders; each is named after its host and process, and
the next start removes those whose process is gone. Only when `.composer/tmp/` is on another
filesystem (a rename could not be atomic) does the temp file sit beside the target, with a
`.composer-tmp` suffix that the file tools never list.
"""

from __future__ import annotations

import codecs
import difflib
import errno
import os
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent.tools.base import ToolError

SNIFF_BYTES = 8192
TEMP_SUFFIX = ".composer-tmp"
# Another host's temp file (a workspace shared over the network) cannot be checked for a live writer;
# no write takes this long, so it is stale by then.
FOREIGN_TEMP_MAX_AGE_S = 24 * 3600
_old_umask = os.umask(0o022)
os.umask(_old_umask)
DEFAULT_FILE_MODE = 0o666 & ~_old_umask


@dataclass
class TextFile:
    """A decoded text file and what is needed to write it back byte-faithfully."""

    text: str
    encoding: str = "utf-8"
    bom: bytes = b""
    mode: int | None = None

    @property
    def newline(self) -> str:
        """The dominant line ending: '\\r\\n' when most line breaks are CRLF, else '\\n'."""
        crlf = self.text.count("\r\n")
        return "\r\n" if crlf and crlf * 2 >= self.text.count("\n") else "\n"

    def encode(self, text: str) -> bytes:
        try:
            return self.bom + text.encode(self.encoding)
        except UnicodeEncodeError as e:
            bad = text[e.start : e.end]
            raise ToolError(
                f"the file is {self.encoding}-encoded and cannot hold {bad!r}; use characters it can hold"
            ) from None


def looks_binary(sample: bytes) -> bool:
    if sample.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return False
    return b"\x00" in sample


def decode(raw: bytes) -> TextFile:
    """Decode bytes known not to be binary."""
    if raw.startswith(codecs.BOM_UTF8):
        return TextFile(raw[3:].decode("utf-8", errors="replace"), "utf-8", codecs.BOM_UTF8)
    for bom, enc in ((codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be")):
        if raw.startswith(bom):
            return TextFile(raw[2:].decode(enc, errors="replace"), enc, bom)
    try:
        return TextFile(raw.decode("utf-8"), "utf-8")
    except UnicodeDecodeError:
        return TextFile(raw.decode("latin-1"), "latin-1")


def read_text(path: Path, shown: str) -> TextFile:
    """Read a text file for editing; ToolError for missing, directory or binary files."""
    if path.is_dir():
        raise ToolError(f"{shown} is a directory, not a file (use list_dir to see its contents)")
    try:
        raw = path.read_bytes()
        st = path.stat()
    except FileNotFoundError:
        raise ToolError(f"{shown} does not exist") from None
    except OSError as e:
        raise ToolError(f"cannot read {shown}: {e.strerror}") from None
    if looks_binary(raw[:SNIFF_BYTES]):
        raise ToolError(f"{shown} is a binary file ({len(raw)} bytes); it cannot be read or edited as text")
    tf = decode(raw)
    tf.mode = stat.S_IMODE(st.st_mode)
    return tf


def read_for_edit(path: Path, shown: str, editor=None) -> TextFile:
    """The text a tool edits: the editor's buffer when it has the file open (ToolContext.editor), else
    the file as read_text reads it."""
    text = editor.read(path) if editor is not None else None
    return TextFile(text) if text is not None else read_text(path, shown)


def save(path: Path, tf: TextFile, text: str, tmp_dir: Path, editor=None) -> None:
    """Write an edited text through the editor when it writes files (`editor.write` returns True), else
    atomically to disk in the file's own encoding."""
    if editor is None or not editor.write(path, text):
        atomic_write(path, tf.encode(text), mode=tf.mode, tmp_dir=tmp_dir)


def atomic_write(path: Path, data: bytes, mode: int | None = None, tmp_dir: Path | None = None) -> None:
    """Replace `path` with `data` atomically, creating parent folders; keep `mode` when given.

    The temp file goes to `tmp_dir` (the workspace's `.composer/tmp/`) when it is on the same
    filesystem as `path`, else beside `path`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = tmp_dir if tmp_dir is not None and _same_filesystem(tmp_dir, path.parent) else None
    try:
        _write_and_rename(path, data, mode, folder)
    except OSError as e:
        if folder is None or e.errno != errno.EXDEV:
            raise
        # Same st_dev yet not renamable (some overlay or bind-mount setups): write beside the target.
        _write_and_rename(path, data, mode, None)
    _fsync_dir(path.parent)


def _write_and_rename(path: Path, data: bytes, mode: int | None, folder: Path | None) -> None:
    if folder is None:
        remove_stale_temps(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_owner_tag()}.", suffix=TEMP_SUFFIX, dir=path.parent)
    else:
        fd, tmp = tempfile.mkstemp(prefix=f"{_owner_tag()}.", suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, DEFAULT_FILE_MODE if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def _fsync_dir(folder: Path) -> None:
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _owner_tag() -> str:
    """host~pid: who writes a temp file, so that a later start can tell whether the writer is gone."""
    host = socket.gethostname().replace(".", "_").replace("~", "_") or "localhost"
    return f"{host}~{os.getpid()}"


def remove_stale_temps(folder: Path) -> int:
    """Delete our temp files in `folder` whose writer is dead (killed mid-write); return how many.

    Only names we make are touched: `[.name.]host~pid.random.composer-tmp`.
    """
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    removed = 0
    for entry in entries:
        if entry.name.endswith(TEMP_SUFFIX) and _is_stale(entry) and _unlink(entry.path):
            removed += 1
    return removed


def _is_stale(entry: os.DirEntry) -> bool:
    # [.name.]host~pid.random.composer-tmp, read from the end: the user's file name may hold "~" or ".".
    owner = entry.name[: -len(TEMP_SUFFIX)].rpartition(".")[0].rpartition(".")[2]
    host, _, pid = owner.rpartition("~")
    if not host or not pid.isdigit():
        return False
    if host != _owner_tag().rpartition("~")[0]:
        try:
            return time.time() - entry.stat().st_mtime > FOREIGN_TEMP_MAX_AGE_S
        except OSError:
            return False
    return not _pid_alive(int(pid))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def unified_diff(before: str, after: str, shown: str) -> str:
    """A unified diff (LF) of two versions of a file, for front-ends."""
    a = before.replace("\r\n", "\n").splitlines(keepends=True)
    b = after.replace("\r\n", "\n").splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"a/{shown}", f"b/{shown}", n=3))
