"""Real source trees in several languages for the search evaluation, fetched from package registries.

Each corpus is a set of files from a published package, fetched with the registry's own client and
cached under `~/.cache/composer-bench/search-corpora` (override with $COMPOSER_BENCH_CACHE), never in
the repository:

    c           Linux 6.1 `lib/*.c` (Debian `linux-source-6.1`)
    java        OpenJDK 17 `java.util.{regex,zip,jar,stream}` (Debian `openjdk-17-source`)
    javascript  express, commander, moment's `src/lib`, lodash's per-function modules (npm)
    typescript  rxjs `src/internal`, zod `src/v4/core` (npm)
    rust        regex-syntax, itertools, clap (Debian `librust-*-dev`, crate sources)
    jdk         OpenJDK 17 `java.{time,math,net,text,nio.file,util.concurrent}`: a larger standard-library
                set of its own (not one of the six languages' tables), none of `java`'s packages

Each is then cut to MAX_LINES lines of whole files (jdk: JDK_LINES). Versions are pinned where the registry keeps old ones (npm); Debian's stable suite changes them only
for security fixes. `python bench/search_corpora.py` fetches everything and prints what it has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
import zlib
from pathlib import Path

CACHE = Path(os.environ.get("COMPOSER_BENCH_CACHE", Path.home() / ".cache" / "composer-bench"))
NPM = {
    "javascript": [
        ("express@5.3.0", ["package/lib/"]),
        ("commander@14.0.3", ["package/lib/"]),
        ("moment@2.31.0", ["package/src/lib/"]),
        ("lodash@4.17.21", ["package/"]),
    ],
    "typescript": [("rxjs@7.8.2", ["package/src/internal/"]), ("zod@4.6.7", ["package/src/v4/core/"])],
}
# Whole-library bundles that repeat the per-module files (lodash ships both).
BUNDLES = {"lodash.js", "core.js", "fp.js", "lodash.min.js", "core.min.js"}
RUST_CRATES = ["librust-regex-syntax-dev", "librust-itertools-dev", "librust-clap-dev"]
JAVA_DIRS = (
    "java.base/java/util/regex/",
    "java.base/java/util/zip/",
    "java.base/java/util/jar/",
    "java.base/java/util/stream/",
)
JDK_DIRS = tuple(f"java.base/java/{d}/" for d in ("time", "math", "net", "text", "nio/file", "util/concurrent"))
JDK_LINES = 40_000
C_LINES = 40_000
# Every corpus is cut to about this many lines (whole files, in a fixed pseudo-random order): big
# enough to hold hundreds of functions, small enough to embed twice (ours, naive) on 2 CPU cores.
MAX_LINES = 6_000
EXTENSIONS = {
    "c": (".c",),
    "java": (".java",),
    "javascript": (".js",),
    "typescript": (".ts",),
    "rust": (".rs",),
}
LANGUAGES = tuple(EXTENSIONS)  # the six-language tables (with Python)
EXTENSIONS["jdk"] = (".java",)
CAPS = {"jdk": JDK_LINES}


def corpus_dir(lang: str) -> Path:
    """The pristine source tree of `lang`, fetched on first use."""
    root = CACHE / "search-corpora" / lang
    done = root / ".complete"
    if not done.exists():
        if root.exists():
            shutil.rmtree(root)
        tmp = root.with_name(lang + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        FETCH[lang](tmp)
        _prune(tmp, EXTENSIONS[lang])
        _cap(tmp, CAPS.get(lang, MAX_LINES))
        (tmp / ".complete").write_text("ok\n")
        tmp.rename(root)
    return root


def source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _downloads() -> Path:
    d = CACHE / "downloads"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _run(cmd: list[str], cwd: Path) -> None:
    print(f"  $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def _deb(package: str) -> Path:
    d = _downloads()
    found = sorted(d.glob(f"{package}_*.deb"))
    if not found:
        _run(["apt-get", "download", package], d)
        found = sorted(d.glob(f"{package}_*.deb"))
    return found[-1]


def _npm(spec: str) -> Path:
    d = _downloads()
    name, version = spec.rsplit("@", 1)
    path = d / f"{name}-{version}.tgz"
    if not path.exists():
        _run(["npm", "pack", spec, "--silent"], d)
    return path


def _prune(root: Path, exts: tuple[str, ...]) -> None:
    """Keep sources only: no declaration files, tests, minified or generated bundles."""
    for p in list(root.rglob("*")):
        if p.is_file() and (
            not p.name.endswith(exts)
            or p.name.endswith((".d.ts", ".min.js"))
            or "test" in p.relative_to(root).parts[:-1]
            or ".test." in p.name
            or ".spec." in p.name
        ):
            p.unlink()


def _cap(root: Path, max_lines: int) -> None:
    files = sorted(source_files(root), key=lambda p: zlib.crc32(p.relative_to(root).as_posix().encode()))
    lines = 0
    for p in files:
        n = p.read_bytes().count(b"\n")
        if lines + n > max_lines:
            p.unlink()
        else:
            lines += n


def _fetch_npm(lang: str, dst: Path) -> None:
    for spec, prefixes in NPM[lang]:
        name = spec.rsplit("@", 1)[0]
        with tarfile.open(_npm(spec)) as tf:
            for m in tf.getmembers():
                if (
                    m.isfile()
                    and any(m.name.startswith(p) for p in prefixes)
                    and m.name.rsplit("/", 1)[-1] not in BUNDLES
                    and "/fp/" not in m.name
                ):
                    out = dst / name / m.name.removeprefix("package/")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tf.extractfile(m).read())


def _fetch_rust(dst: Path) -> None:
    for package in RUST_CRATES:
        tmp = dst / ".x"
        subprocess.run(["dpkg", "-x", str(_deb(package)), str(tmp)], check=True)
        for crate in (tmp / "usr/share/cargo/registry").iterdir():
            shutil.copytree(crate / "src", dst / crate.name / "src")
        shutil.rmtree(tmp)


def _fetch_java(dst: Path, dirs: tuple[str, ...] = JAVA_DIRS) -> None:
    tmp = dst / ".x"
    subprocess.run(["dpkg", "-x", str(_deb("openjdk-17-source")), str(tmp)], check=True)
    with zipfile.ZipFile(next(tmp.rglob("src.zip"))) as z:
        for name in z.namelist():
            if name.startswith(dirs) and name.endswith(".java"):
                out = dst / name.removeprefix("java.base/")
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
    shutil.rmtree(tmp)


def _fetch_c(dst: Path) -> None:
    """lib/*.c of the kernel, files taken in a fixed pseudo-random order until C_LINES lines."""
    deb = _deb("linux-source-6.1")
    tmp = dst / ".x"
    tmp.mkdir()
    inner = subprocess.run(
        f"dpkg-deb --fsys-tarfile '{deb}' | tar -xO ./usr/src/linux-source-6.1.tar.xz "
        f"| xz -dc | tar -x -C '{tmp}' --wildcards 'linux-source-6.1/lib/*.c'",
        shell=True,
        check=True,
    )
    del inner
    files = sorted((tmp / "linux-source-6.1/lib").glob("*.c"), key=lambda p: zlib.crc32(p.name.encode()))
    lines = 0
    for p in files:
        n = p.read_bytes().count(b"\n")
        if lines + n > C_LINES or n > 4000:
            continue
        out = dst / "lib" / p.name
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, out)
        lines += n
    shutil.rmtree(tmp)


FETCH = {
    "c": _fetch_c,
    "java": _fetch_java,
    "javascript": lambda d: _fetch_npm("javascript", d),
    "typescript": lambda d: _fetch_npm("typescript", d),
    "rust": _fetch_rust,
    "jdk": lambda d: _fetch_java(d, JDK_DIRS),
}


if __name__ == "__main__":
    for lang in sys.argv[1:] or LANGUAGES:
        root = corpus_dir(lang)
        files = source_files(root)
        n = sum(p.read_bytes().count(b"\n") for p in files)
        print(f"{lang:<11} {len(files):4d} files {n:7d} lines  {root}")
