"""Reading and writing users' files without losing anything.

Text is decoded as UTF-8 (a BOM is remembered), UTF-16 with a BOM, or Latin-1 as a last resort, so
that writing back yields the same bytes everywhere the text did not change. Writes are atomic: a temp
file in the same folder, fsync, rename; a crash mid-write leaves the old file or the new one, never a
torn one. The file's mode is kept.
"""

from __future__ import annotations

import codecs
import difflib
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent.tools.base import ToolError

SNIFF_BYTES = 8192
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


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically, creating parent folders; keep `mode` when given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".composer-tmp", dir=path.parent)
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
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def unified_diff(before: str, after: str, shown: str) -> str:
    """A unified diff (LF) of two versions of a file, for front-ends."""
    a = before.replace("\r\n", "\n").splitlines(keepends=True)
    b = after.replace("\r\n", "\n").splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"a/{shown}", f"b/{shown}", n=3))
