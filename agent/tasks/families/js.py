"""js-bugfix: the bugfix family in JavaScript, run with node's own test runner (no npm packages).

A small CommonJS package (src/<module>.js, test/<module>.test.js with node:test and node:assert,
package.json whose `npm test` is `node --test`) with one injected bug. Mutations are token-level
(JavaScript has no parser in the standard library of Python): an operator swapped (+ -, * +, < <=,
> >=, === !==, && ||), a number constant plus one, `- 1` made `- 2`; each candidate is kept only if
one node process, running the function's cases on it, says a case now fails. Verification puts the
pristine test file back and runs it with a hidden checker of every function's cases
(`node --test test/<module>.test.js _hidden/check.test.js`), so editing the test cannot pass.
Needs `node` (18 or later) on PATH, to build the tasks and to verify them.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from typing import Any

from agent.tasks.families.mutate import edit_strings

# module -> [(name, source, [(args, expected), ...])]; sources in one style (2 spaces, semicolons)
POOL: dict[str, list[tuple[str, str, list[tuple[list[Any], Any]]]]] = {
    "geometry": [
        ("rectArea", "function rectArea(width, height) {\n  return width * height;\n}", [([3, 4], 12), ([5, 1], 5)]),
        ("perimeter", "function perimeter(width, height) {\n  return 2 * (width + height);\n}",
         [([3, 4], 14), ([1, 1], 4)]),
        ("clamp", "function clamp(value, low, high) {\n  if (value < low) {\n    return low;\n  }\n"
         "  if (value > high) {\n    return high;\n  }\n  return value;\n}",
         [([5, 0, 10], 5), ([-3, 0, 10], 0), ([12, 0, 10], 10), ([10, 0, 10], 10), ([0, 0, 10], 0)]),
        ("manhattan", "function manhattan(x1, y1, x2, y2) {\n  return Math.abs(x1 - x2) + Math.abs(y1 - y2);\n}",
         [([0, 0, 3, 4], 7), ([1, 5, 4, 1], 7)]),
    ],
    "text": [
        ("countVowels", "function countVowels(text) {\n  let n = 0;\n  for (const ch of text.toLowerCase()) {\n"
         "    if ('aeiou'.includes(ch)) {\n      n += 1;\n    }\n  }\n  return n;\n}",
         [(["Hello"], 2), (["rhythm"], 0), (["AEIOU"], 5)]),
        ("truncate", "function truncate(text, limit) {\n  if (text.length <= limit) {\n    return text;\n  }\n"
         "  return text.slice(0, limit - 3) + '...';\n}",
         [(["hello world", 8], "hello..."), (["short", 10], "short"), (["exactly", 7], "exactly")]),
        ("lastWord", "function lastWord(text) {\n  const words = text.split(' ').filter((w) => w.length > 0);\n"
         "  return words.length > 0 ? words[words.length - 1] : '';\n}",
         [(["the quick fox"], "fox"), ([""], ""), (["one"], "one")]),
        ("repeatWord", "function repeatWord(word, times, sep) {\n  return Array(times).fill(word).join(sep);\n}",
         [(["ab", 3, "-"], "ab-ab-ab"), (["x", 1, ","], "x")]),
    ],
    "stats": [
        ("mean", "function mean(values) {\n  let total = 0;\n  for (const v of values) {\n    total += v;\n  }\n"
         "  return total / values.length;\n}", [([[1, 2, 3, 4]], 2.5), ([[5]], 5)]),
        ("valueRange", "function valueRange(values) {\n  return Math.max(...values) - Math.min(...values);\n}",
         [([[3, 9, 1]], 8), ([[4, 4]], 0)]),
        ("countAbove", "function countAbove(values, threshold) {\n  return values.filter((v) => v > threshold).length;\n}",
         [([[1, 5, 7, 5], 5], 1), ([[10, 20], 0], 2)]),
        ("pairwiseDiffs", "function pairwiseDiffs(values) {\n  const out = [];\n"
         "  for (let i = 0; i < values.length - 1; i++) {\n    out.push(values[i + 1] - values[i]);\n  }\n"
         "  return out;\n}", [([[1, 4, 9]], [3, 5]), ([[2]], [])]),
    ],
}
SIZES = {"small": 1, "medium": 2, "large": 3}
_SWAPS = [(r"(?<![+=])\+(?![+=])", "-"), (r"(?<![-=])-(?![-=>])", "+"), (r"(?<![*/])\*(?![*=])", "+"),
          (r"<=", "<"), (r"<(?!=)", "<="), (r">=", ">"), (r"(?<!=)>(?!=)", ">="), (r"===", "!=="),
          (r"&&", "||"), (r"\|\|", "&&")]


class NodeMissing(RuntimeError):
    """The js-bugfix tasks need node on PATH."""


def _module(fns: list[tuple[str, str, list]]) -> str:
    return ("'use strict';\n\n" + "\n\n".join(src for _, src, _ in fns) + "\n\nmodule.exports = { "
            + ", ".join(n for n, _, _ in fns) + " };\n")


def _tests(mod: str, fns: list[tuple[str, str, list]]) -> str:
    head = ("'use strict';\n\nconst test = require('node:test');\nconst assert = require('node:assert/strict');\n"
            f"const {{ {', '.join(n for n, _, _ in fns)} }} = require('../src/{mod}.js');\n")
    body = "".join(f"\ntest('{n}', () => {{\n" + "".join(
        f"  assert.deepStrictEqual({n}({', '.join(json.dumps(a) for a in args)}), {json.dumps(want)});\n"
        for args, want in cases) + "});\n" for n, _, cases in fns)
    return head + body


def _mutants(src: str, rng: random.Random) -> list[tuple[str, str]]:
    """(kind, source) of every single-token mutation inside the function's body, in a seeded order."""
    start = src.index("{") + 1  # the body: leave the signature alone
    out = []
    for pattern, repl in _SWAPS:
        for m in re.finditer(pattern, src[start:]):
            i = start + m.start()
            if src[:i].count("'") % 2 == 0:  # not inside a string literal
                out.append(("operator", src[:i] + repl + src[i + len(m.group()):]))
    for m in re.finditer(r"(?<![\w.])(\d+)(?![\w.])", src[start:]):
        i = start + m.start()
        if src[:i].count("'") % 2 == 0:
            kind = "off_by_one" if src[:i].rstrip().endswith("-") else "constant"
            out.append((kind, src[:i] + str(int(m.group()) + 1) + src[i + len(m.group()):]))
    rng.shuffle(out)
    return out


_HARNESS = r"""
const cands = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const out = cands.map(([src, name, cases]) => {
  try {
    const f = new Function(src + '\nreturn ' + name + ';')();
    return cases.some(([args, want]) => {
      try { return JSON.stringify(f(...args)) !== JSON.stringify(want); } catch (e) { return true; }
    });
  } catch (e) { return true; }
});
process.stdout.write(JSON.stringify(out));
"""


def _breaking(name: str, cases: list, candidates: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The first candidate that fails one of the cases, by one node process over all of them."""
    if shutil.which("node") is None:
        raise NodeMissing("js-bugfix tasks need node (18 or later) on PATH")
    payload = json.dumps([[src, name, cases] for _, src in candidates])
    p = subprocess.run(["node", "-e", _HARNESS], input=payload, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise NodeMissing(f"node could not check the mutations: {p.stderr.strip()[:200]}")
    return next((c for c, broke in zip(candidates, json.loads(p.stdout), strict=True) if broke), None)


def _call(name: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "arguments": args}


def build_js(seed: int, size: str) -> dict[str, Any]:
    """The fields of the task's families.Generated (a dict: this module is imported by that one)."""

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (known: {', '.join(SIZES)})")
    rng = random.Random(f"js-bugfix:{size}:{seed}")
    mods = sorted(POOL)
    rng.shuffle(mods)
    mods = mods[: SIZES[size]]
    target = mods[rng.randrange(len(mods))]
    fns = POOL[target]
    order = list(range(len(fns)))
    rng.shuffle(order)
    for i in order:
        name, src, cases = fns[i]
        found = _breaking(name, cases, _mutants(src, rng))
        if found:
            break
    else:
        raise RuntimeError(f"no breaking mutation in {target}")
    kind, bad = found
    files = {"package.json": json.dumps({"name": "pkg", "version": "1.0.0", "private": True,
                                         "scripts": {"test": "node --test"}}, indent=2) + "\n",
             "README.md": f"# pkg\n\nSmall utilities: {', '.join(mods)}. Tests: `npm test` (node --test).\n"}
    for m in mods:
        files[f"src/{m}.js"] = _module(POOL[m])
        files[f"test/{m}.test.js"] = _tests(m, POOL[m])
    path, test_path = f"src/{target}.js", f"test/{target}.test.js"
    good_module = files[path]
    files[path] = _module([(n, bad if n == name else s, c) for n, s, c in fns])
    # every module's cases, each in its own block scope (the same names are required in each)
    checker = "'use strict';\n" + "\n".join("{\n" + _tests(m, POOL[m]).removeprefix("'use strict';\n") + "}\n"
                                             for m in mods)
    hidden = {"_hidden/check.test.js": checker, test_path: files[test_path]}
    old, new = edit_strings(files[path], src, bad)
    test_cmd = f"node --test {test_path}"
    prompt = rng.choice([f"{test_path} is failing, can you fix it?",
                         f"`npm test` fails on {name}() — fix the bug, not the tests",
                         f"the {name} test fails. please fix"])
    plan = [
        {"reasoning": f"Run the failing test and read {path} at the same time.",
         "tool_calls": [_call("shell", command=test_cmd), _call("read_file", path=path)]},
        {"reasoning": f"{name} has a {kind.replace('_', ' ')} bug.",
         "tool_calls": [_call("edit_file", path=path, old_string=old, new_string=new)]},
        {"tool_calls": [_call("shell", command=test_cmd)]},
        {"content": f"Fixed `{name}` in {path}: the {kind.replace('_', ' ')} is corrected and the tests pass."},
    ]
    return {"files": files, "hidden": hidden, "prompt": prompt, "plan": plan,
            "meta": {"function": name, "module": path, "mutation": kind, "language": "javascript"},
            "expected_tokens": 250, "fixed": {path: good_module}, "verify": f"node --test {test_path} _hidden/check.test.js"}
