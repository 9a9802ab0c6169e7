"""The code the synthetic families are built from: small, plain functions in themed modules, each with
test cases (arguments -> expected result). Sources are kept in `ast.unparse` form so that a mutation
changes exactly the mutated expression when the module is written back.

Two disjoint pools: `TRAIN` (MODULES, ADD_PARAM) builds every training task, `HELDOUT` (modules and
function names that appear nowhere in TRAIN) builds every held-out task, so a model is evaluated on code
it has never seen, not on new seeds of the repositories it was trained on. `TRAIN.renamed(seed)` is the
training pool under fresh made-up module and function names drawn per seed: with 25 fixed names a small
model can answer "where is X defined?" from memory; with a new name in every task it has to read the
name in the question and the path in the tool's output.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import random
import re
from dataclasses import dataclass

HELDOUT_BASE = 1_000_000
"""Seeds from here on draw from the held-out pool (HELDOUT), whose modules and functions training never sees."""


@dataclass(frozen=True)
class Fn:
    name: str
    source: str
    cases: tuple  # ((args tuple, expected), ...)

    @property
    def canonical(self) -> str:
        return ast.unparse(ast.parse(self.source))


def _fn(name: str, source: str, *cases) -> Fn:
    return Fn(name, source, tuple(cases))


MODULES: dict[str, list[Fn]] = {
    "geometry": [
        _fn("rect_area", "def rect_area(width, height):\n    return width * height\n", ((3, 4), 12), ((5, 1), 5)),
        _fn("perimeter", "def perimeter(width, height):\n    return 2 * (width + height)\n", ((3, 4), 14), ((1, 1), 4)),
        _fn("clamp", "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
            "        return high\n    return value\n", ((5, 0, 10), 5), ((-3, 0, 10), 0), ((12, 0, 10), 10), ((10, 0, 10), 10)),
        _fn("manhattan", "def manhattan(x1, y1, x2, y2):\n    return abs(x1 - x2) + abs(y1 - y2)\n",
            ((0, 0, 3, 4), 7), ((1, 5, 4, 1), 7)),
        _fn("scale_point", "def scale_point(x, y, factor):\n    return (x * factor, y * factor)\n",
            ((2, 3, 2), (4, 6)), ((1, -1, 3), (3, -3))),
    ],
    "text": [
        _fn("count_vowels", "def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in 'aeiou')\n",
            (("Hello",), 2), (("rhythm",), 0), (("AEIOU",), 5)),
        _fn("initials", "def initials(name):\n    return ''.join(part[0].upper() for part in name.split())\n",
            (("ada lovelace",), "AL"), (("grace brewster hopper",), "GBH")),
        _fn("truncate", "def truncate(text, limit):\n    if len(text) <= limit:\n        return text\n"
            "    return text[:limit - 3] + '...'\n", (("hello world", 8), "hello..."), (("short", 10), "short"),
            (("exactly", 7), "exactly")),
        _fn("repeat_word", "def repeat_word(word, times, sep):\n    return sep.join([word] * times)\n",
            (("ab", 3, "-"), "ab-ab-ab"), (("x", 1, ","), "x")),
        _fn("last_word", "def last_word(text):\n    words = text.split()\n    return words[len(words) - 1] if words else ''\n",
            (("the quick fox",), "fox"), (("",), ""), (("one",), "one")),
    ],
    "stats": [
        _fn("mean", "def mean(values):\n    return sum(values) / len(values)\n", (([1, 2, 3, 4],), 2.5), (([5],), 5.0)),
        _fn("value_range", "def value_range(values):\n    return max(values) - min(values)\n",
            (([3, 9, 1],), 8), (([4, 4],), 0)),
        _fn("running_total", "def running_total(values):\n    out = []\n    total = 0\n    for v in values:\n"
            "        total += v\n        out.append(total)\n    return out\n", (([1, 2, 3],), [1, 3, 6]), (([],), [])),
        _fn("count_above", "def count_above(values, threshold):\n    return len([v for v in values if v > threshold])\n",
            (([1, 5, 7, 5], 5), 1), (([10, 20], 0), 2)),
        _fn("pairwise_diffs", "def pairwise_diffs(values):\n    return [values[i + 1] - values[i] for i in range(len(values) - 1)]\n",
            (([1, 4, 9],), [3, 5]), (([2],), [])),
    ],
    "money": [
        _fn("with_tax", "def with_tax(price, rate):\n    return round(price * (1 + rate), 2)\n",
            ((100, 0.2), 120.0), ((10, 0.05), 10.5)),
        _fn("discount", "def discount(price, percent):\n    return price - price * percent / 100\n",
            ((200, 10), 180.0), ((50, 50), 25.0)),
        _fn("split_bill", "def split_bill(total, people):\n    return round(total / people, 2)\n",
            ((100, 4), 25.0), ((10, 3), 3.33)),
        _fn("cents", "def cents(amount):\n    return int(round(amount * 100))\n", ((1.25,), 125), ((0.1,), 10)),
        _fn("compound", "def compound(principal, rate, years):\n    for _ in range(years):\n"
            "        principal = principal * (1 + rate)\n    return round(principal, 2)\n",
            ((100, 0.1, 2), 121.0), ((100, 0.5, 0), 100)),
    ],
    "dates": [
        _fn("is_leap", "def is_leap(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
            ((2024,), True), ((1900,), False), ((2000,), True), ((2023,), False)),
        _fn("days_in_month", "def days_in_month(month, leap):\n    if month == 2:\n        return 29 if leap else 28\n"
            "    return 30 if month in (4, 6, 9, 11) else 31\n", ((2, True), 29), ((2, False), 28), ((4, False), 30),
            ((1, False), 31)),
        _fn("to_minutes", "def to_minutes(hours, minutes):\n    return hours * 60 + minutes\n", ((2, 30), 150), ((0, 5), 5)),
        _fn("weekday_name", "def weekday_name(index):\n    names = ['Mon', 'Tue', 'Wed', 'Thu', 'Fri', 'Sat', 'Sun']\n"
            "    return names[index % 7]\n", ((0,), "Mon"), ((8,), "Tue"), ((6,), "Sun")),
        _fn("quarter", "def quarter(month):\n    return (month - 1) // 3 + 1\n", ((1,), 1), ((4,), 2), ((12,), 4)),
    ],
}

# add-param variants: (function, new parameter, default, what the request says, new source, extra cases)
ADD_PARAM = [
    ("with_tax", "digits", 2, "an optional `digits` argument (default 2) for the rounding",
     "def with_tax(price, rate, digits=2):\n    return round(price * (1 + rate), digits)\n",
     (((100, 0.125, 1), 112.5), ((10, 0.333, 0), 13.0))),
    ("initials", "sep", "''", "an optional `sep` argument (default '') put between the letters",
     "def initials(name, sep=''):\n    return sep.join(part[0].upper() for part in name.split())\n",
     ((("ada lovelace", "."), "A.L"), (("grace hopper",), "GH"))),
    ("split_bill", "tip", 0, "an optional `tip` percentage (default 0) added to the total before splitting",
     "def split_bill(total, people, tip=0):\n    return round(total * (1 + tip / 100) / people, 2)\n",
     (((100, 4, 10), 27.5), ((90, 3), 30.0))),
    ("to_minutes", "seconds", 0, "an optional `seconds` argument (default 0); return fractional minutes",
     "def to_minutes(hours, minutes, seconds=0):\n    return hours * 60 + minutes + seconds / 60\n",
     (((1, 0, 30), 60.5), ((0, 2), 2))),
]


HELDOUT_MODULES: dict[str, list[Fn]] = {
    "vectors": [
        _fn("dot", "def dot(ax, ay, bx, by):\n    return ax * bx + ay * by\n", ((1, 2, 3, 4), 11), ((0, 5, 2, 0), 0)),
        _fn("norm_sq", "def norm_sq(x, y):\n    return x * x + y * y\n", ((3, 4), 25), ((1, 0), 1)),
        _fn("midpoint", "def midpoint(x1, y1, x2, y2):\n    return ((x1 + x2) / 2, (y1 + y2) / 2)\n",
            ((0, 0, 4, 2), (2.0, 1.0)), ((1, 1, 3, 5), (2.0, 3.0))),
        _fn("cross_z", "def cross_z(ax, ay, bx, by):\n    return ax * by - ay * bx\n", ((1, 0, 0, 1), 1), ((2, 3, 4, 5), -2)),
        _fn("translate", "def translate(x, y, dx, dy):\n    return (x + dx, y + dy)\n",
            ((1, 2, 3, 4), (4, 6)), ((0, 0, -1, 1), (-1, 1))),
    ],
    "colors": [
        _fn("clamp_channel", "def clamp_channel(value):\n    if value < 0:\n        return 0\n    if value > 255:\n"
            "        return 255\n    return value\n", ((-5,), 0), ((300,), 255), ((128,), 128), ((255,), 255)),
        _fn("mix", "def mix(a, b, weight):\n    return round(a * (1 - weight) + b * weight)\n",
            ((0, 100, 0.25), 25), ((10, 20, 0.5), 15)),
        _fn("gray", "def gray(red, green, blue):\n    return (red + green + blue) // 3\n", ((30, 60, 90), 60), ((1, 1, 2), 1)),
        _fn("invert", "def invert(value):\n    return 255 - value\n", ((0,), 255), ((200,), 55)),
        _fn("to_hex", "def to_hex(red, green, blue):\n    return '#%02x%02x%02x' % (red, green, blue)\n",
            ((255, 128, 0), "#ff8000"), ((0, 0, 0), "#000000")),
    ],
    "units": [
        _fn("km_to_miles", "def km_to_miles(km):\n    return round(km * 0.621371, 3)\n", ((10,), 6.214), ((0,), 0.0)),
        _fn("celsius_to_f", "def celsius_to_f(c):\n    return c * 9 / 5 + 32\n", ((100,), 212.0), ((0,), 32.0)),
        _fn("inches", "def inches(feet, extra):\n    return feet * 12 + extra\n", ((2, 3), 27), ((0, 5), 5)),
        _fn("kg_to_pounds", "def kg_to_pounds(kg):\n    return round(kg * 2.20462, 2)\n", ((1,), 2.2), ((10,), 22.05)),
        _fn("liters", "def liters(milliliters):\n    return milliliters / 1000\n", ((1500,), 1.5), ((250,), 0.25)),
    ],
    "grades": [
        _fn("letter", "def letter(score):\n    if score >= 90:\n        return 'A'\n    if score >= 80:\n        return 'B'\n"
            "    if score >= 70:\n        return 'C'\n    return 'F'\n",
            ((95,), "A"), ((90,), "A"), ((85,), "B"), ((80,), "B"), ((72,), "C"), ((70,), "C"), ((10,), "F")),
        _fn("average_score", "def average_score(scores):\n    return round(sum(scores) / len(scores), 1)\n",
            (([90, 80, 70],), 80.0), (([1, 2],), 1.5)),
        _fn("passed_count", "def passed_count(scores, cutoff):\n    return len([s for s in scores if s >= cutoff])\n",
            (([50, 60, 70], 60), 2), (([], 10), 0)),
        _fn("curve", "def curve(score, bonus):\n    return min(100, score + bonus)\n", ((95, 10), 100), ((50, 5), 55)),
        _fn("best_of", "def best_of(scores):\n    return max(scores) if scores else 0\n", (([3, 9, 4],), 9), (([],), 0)),
    ],
    "inventory": [
        _fn("restock", "def restock(count, amount):\n    return count + amount\n", ((5, 10), 15), ((0, 0), 0)),
        _fn("total_value", "def total_value(count, price):\n    return round(count * price, 2)\n",
            ((3, 1.5), 4.5), ((0, 9.99), 0.0)),
        _fn("low_stock", "def low_stock(count, minimum):\n    return count < minimum\n",
            ((2, 5), True), ((5, 5), False), ((9, 5), False)),
        _fn("boxes_needed", "def boxes_needed(items, per_box):\n    return (items + per_box - 1) // per_box\n",
            ((10, 4), 3), ((8, 4), 2), ((0, 4), 0)),
        _fn("remaining", "def remaining(count, sold):\n    return max(0, count - sold)\n", ((10, 3), 7), ((2, 5), 0)),
    ],
}

HELDOUT_ADD_PARAM = [
    ("km_to_miles", "digits", 3, "an optional `digits` argument (default 3) for the rounding",
     "def km_to_miles(km, digits=3):\n    return round(km * 0.621371, digits)\n",
     (((10, 1), 6.2), ((5,), 3.107))),
    ("curve", "cap", 100, "an optional `cap` argument (default 100), the highest score it returns",
     "def curve(score, bonus, cap=100):\n    return min(cap, score + bonus)\n",
     (((95, 10, 99), 99), ((50, 5), 55))),
    ("invert", "top", 255, "an optional `top` argument (default 255), the channel's maximum",
     "def invert(value, top=255):\n    return top - value\n",
     (((10, 100), 90), ((0,), 255))),
]


@dataclass(frozen=True)
class Pool:
    name: str
    modules: dict[str, list[Fn]]
    add_param: list[tuple]

    def find(self, name: str) -> tuple[str, Fn]:
        for module, fns in self.modules.items():
            for fn in fns:
                if fn.name == name:
                    return module, fn
        raise KeyError(name)

    def renamed(self, seed: int) -> Pool:
        """This pool with every module and function under a fresh made-up name (a function of `seed`)."""
        rng = random.Random(f"names:{seed}")
        code = " ".join(fn.source for f in self.modules.values() for fn in f)
        taken: set[str] = set()
        names = {fn.name: _fresh(rng, taken, code, words=rng.choice((1, 2, 2))) for f in self.modules.values() for fn in f}
        mods = {m: _fresh(rng, taken, code, words=1) for m in self.modules}

        def sub(text: str) -> str:
            return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: names[m.group(1)], text)

        modules = {mods[m]: [Fn(names[fn.name], sub(fn.source), fn.cases) for fn in f] for m, f in self.modules.items()}
        add_param = [(names[n], p, d, desc, sub(src), cases) for n, p, d, desc, src, cases in self.add_param]
        return Pool(f"{self.name}-renamed-{seed}", modules, add_param)


# Made-up names: words of 1-3 random syllables, so that over many seeds the names cover much of the
# tokenizer's vocabulary and a model cannot answer from a list it has memorised. Rejected: Python
# keywords and builtins, words of the pool's code, any held-out pool name inside (tests check that), and
# module names starting with "r" (pkg/report.py sorts apart from the modules in the tests).
_CONSONANTS, _VOWELS = "bcdfghjklmnpqstvwxyz", "aeiouy"
_ONSETS = tuple(_CONSONANTS) + ("bl", "br", "ch", "cl", "cr", "dr", "fl", "gr", "kn", "ph", "pl", "pr", "sc", "sh",
                                "sk", "sl", "sm", "sn", "sp", "st", "sw", "th", "tr", "wh")
_CODAS = ("", "", "", "b", "d", "g", "k", "l", "m", "n", "p", "s", "t", "x", "ck", "ft", "lt", "mp", "nd", "ng",
          "nk", "nt", "rk", "rt", "sk", "st")


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _fresh(rng: random.Random, taken: set[str], code: str, words: int) -> str:
    while True:
        name = "_".join(
            "".join(_syllable(rng) for _ in range(rng.choice((1, 2, 2, 3))))
            for _ in range(words)
        )
        if (name in taken or keyword.iskeyword(name) or hasattr(builtins, name) or name.startswith("r")
                or re.search(rf"\b{name}\b", code) or any(h in name for h in _HELDOUT_NAMES)):
            continue
        taken.add(name)
        return name


_HELDOUT_NAMES = tuple(HELDOUT_MODULES) + tuple(fn.name for f in HELDOUT_MODULES.values() for fn in f)
TRAIN = Pool("train", MODULES, ADD_PARAM)
HELDOUT = Pool("heldout", HELDOUT_MODULES, HELDOUT_ADD_PARAM)

