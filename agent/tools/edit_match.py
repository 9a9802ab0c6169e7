"""Finding `old_string` in a file: an exact match first, then tolerant tiers, each accepted only if unique.

All matching happens on LF text (the caller converts CRLF files and converts back). Tiers, in order:

  exact               `old` is a substring of the text.
  trailing_whitespace whole lines equal after stripping trailing blanks.
  indentation         whole lines equal after stripping leading blanks, with a consistent mapping of
                      indentation (a uniform shift or another indent unit; tab widths 4 and 8 tried);
                      the mapping is re-applied to `new`, rendered with the file's tabs or spaces.
  unicode             typographic quotes, dashes and odd spaces folded to ASCII (works mid-line), and
                      then line by line together with the whitespace tolerances above.
  whitespace          last resort: whole lines equal once every whitespace run is folded.

When nothing matches, `closest_region` finds the most similar window of lines to show the model.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

# One-to-one character folds, so offsets in the folded text are offsets in the original.
_FOLD_1TO1 = str.maketrans({
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032\u00b4\u0060", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb", '"'),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
    **dict.fromkeys("\u00a0\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f"
                    "\u205f\u3000", " "),
})
_ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff]")
TAB_WIDTHS = (4, 8)


@dataclass
class Match:
    start: int
    end: int
    replacement: str


@dataclass
class Found:
    tier: str
    matches: list[Match]


class Ambiguous(Exception):
    def __init__(self, tier: str, lines: list[int]):
        super().__init__(tier)
        self.tier = tier
        self.lines = lines


def find(text: str, old: str, new: str, replace_all: bool) -> Found | None:
    """Locate `old` in `text` (both LF). Raise Ambiguous when a tier matches several places."""
    starts = _all_occurrences(text, old)
    if starts:
        if len(starts) > 1 and not replace_all:
            raise Ambiguous("exact", [line_of(text, s) for s in starts])
        return Found("exact", [Match(s, s + len(old), new) for s in starts])
    lines = text.split("\n")
    for tier, finder in _TIERS:
        found = finder(text, lines, old, new)
        if not found:
            continue
        if len(found) > 1:
            raise Ambiguous(tier, [line_of(text, m.start) for m in found])
        return Found(tier, found)
    return None


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _all_occurrences(text: str, sub: str) -> list[int]:
    out, i = [], text.find(sub)
    while i != -1:
        out.append(i)
        i = text.find(sub, i + max(1, len(sub)))
    return out


# ---- line-window matching -------------------------------------------------------------------------

def _split_old(old: str) -> tuple[list[str], bool]:
    trailing_nl = old.endswith("\n")
    body = old[:-1] if trailing_nl else old
    return body.split("\n"), trailing_nl


def _line_windows(text: str, lines: list[str], old: str, new: str,
                  norm: Callable[[str], str], reindent: bool, loose_shift: bool = False) -> list[Match]:
    old_lines, trailing_nl = _split_old(old)
    n = len(old_lines)
    if n == 0 or not any(s.strip() for s in old_lines):
        return []
    want = [norm(s) for s in old_lines]
    normed = [norm(s) for s in lines]
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln) + 1)
    matches: list[Match] = []
    i = 0
    while i + n <= len(lines):
        if normed[i : i + n] != want:
            i += 1
            continue
        window = lines[i : i + n]
        replacement = new
        if reindent:
            shifted = _reindent(window, old_lines, new, loose_shift)
            if shifted is None:
                i += 1
                continue
            replacement = shifted
        start = offsets[i]
        end = offsets[i + n - 1] + len(lines[i + n - 1])
        if trailing_nl and i + n < len(lines):
            end += 1
        matches.append(Match(start, end, replacement))
        i += n
    return matches


def _indent(s: str) -> str:
    return s[: len(s) - len(s.lstrip(" \t"))]


def _width(ws: str, tab: int) -> int:
    return len(ws.expandtabs(tab))


def _reindent(window: list[str], old_lines: list[str], new: str, loose: bool) -> str | None:
    """Re-indent `new` the way the file's `window` is indented relative to `old_lines`.

    Indentation widths (tabs expanded) of old lines are mapped to those of the file lines they matched.
    The map must be consistent and order-preserving (a uniform shift, or a change of indent unit such as
    2 → 4 spaces); `loose` accepts any map. New lines take the mapped width of the nearest old width at
    or below theirs, plus the remainder; the result uses tabs where the file's lines do.
    """
    pairs = [(f, o) for f, o in zip(window, old_lines, strict=True) if o.strip() and f.strip()]
    if not pairs:
        return new
    uses_tabs = any("\t" in _indent(f) for f, _ in pairs)
    for tab in TAB_WIDTHS:
        mapping: dict[int, int] = {}
        consistent = True
        for f, o in pairs:
            ow, fw = _width(_indent(o), tab), _width(_indent(f), tab)
            if mapping.setdefault(ow, fw) != fw:
                consistent = False
        keys = sorted(mapping)
        if any(mapping[a] >= mapping[b] for a, b in zip(keys, keys[1:], strict=False)):
            consistent = False
        if not consistent and not loose:
            continue
        out = []
        for line in new.split("\n"):
            if not line.strip():
                out.append(line)
                continue
            w = _width(_indent(line), tab)
            below = [k for k in keys if k <= w]
            base = below[-1] if below else keys[0]
            width = max(0, mapping[base] + (w - base))
            ws = "\t" * (width // tab) + " " * (width % tab) if uses_tabs else " " * width
            out.append(ws + line.lstrip(" \t"))
        return "\n".join(out)
    return None


def fold_unicode_full(s: str) -> str:
    s = _ZERO_WIDTH.sub("", s).translate(_FOLD_1TO1).replace("\u2026", "...")
    return unicodedata.normalize("NFKC", s)


def _tier_trailing(text, lines, old, new):
    return _line_windows(text, lines, old, new, str.rstrip, reindent=False)


def _tier_indent(text, lines, old, new):
    return _line_windows(text, lines, old, new, str.strip, reindent=True)


def _tier_unicode(text, lines, old, new):
    folded_old = old.translate(_FOLD_1TO1)
    if folded_old != old or text.translate(_FOLD_1TO1) != text:
        starts = _all_occurrences(text.translate(_FOLD_1TO1), folded_old)
        if starts:
            return [Match(s, s + len(old), new) for s in starts]
    return _line_windows(text, lines, old, new, lambda s: fold_unicode_full(s).strip(), reindent=True)


def _tier_whitespace(text, lines, old, new):
    return _line_windows(text, lines, old, new, lambda s: " ".join(fold_unicode_full(s).split()),
                         reindent=True, loose_shift=True)


_TIERS = [
    ("trailing_whitespace", _tier_trailing),
    ("indentation", _tier_indent),
    ("unicode", _tier_unicode),
    ("whitespace", _tier_whitespace),
]


# ---- the closest region, for "no match" errors ----------------------------------------------------

@dataclass
class Closest:
    start_line: int  # 1-based
    end_line: int
    similarity: float
    first_diff: tuple[int, str, str] | None  # (file line number, expected, found)


def closest_region(text: str, old: str) -> Closest | None:
    lines = text.split("\n")
    old_lines, _ = _split_old(old)
    n = max(1, len(old_lines))
    if not lines or not old.strip():
        return None
    key = [s.strip() for s in lines]
    votes: dict[int, int] = {}
    index: dict[str, list[int]] = {}
    for i, k in enumerate(key):
        if k:
            index.setdefault(k, []).append(i)
    for j, o in enumerate(old_lines):
        for i in index.get(o.strip(), ()) if o.strip() else ():
            votes[i - j] = votes.get(i - j, 0) + 1
    candidates = sorted(votes, key=lambda s: -votes[s])[:10]
    if not candidates:
        # No line agrees exactly: anchor on the file line most similar to each of the first old lines.
        for j, o in enumerate(old_lines[:3]):
            if not o.strip():
                continue
            close = difflib.get_close_matches(o.strip(), [k for k in key if k], n=3, cutoff=0.4)
            for c in close:
                candidates += [i - j for i in index[c][:3]]
    if not candidates:
        return None
    target = "\n".join(s.strip() for s in old_lines)
    best: tuple[float, int] | None = None
    for start in set(candidates):
        start = min(max(0, start), max(0, len(lines) - n))
        window = "\n".join(key[start : start + n])
        ratio = difflib.SequenceMatcher(None, window, target, autojunk=False).ratio()
        if best is None or ratio > best[0]:
            best = (ratio, start)
    assert best is not None
    ratio, start = best
    first_diff = None
    for j, o in enumerate(old_lines):
        f = lines[start + j] if start + j < len(lines) else ""
        if f != o:
            first_diff = (start + j + 1, o, f)
            break
    return Closest(start + 1, min(len(lines), start + n), ratio, first_diff)
