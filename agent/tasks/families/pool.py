"""The code the synthetic families are built from: small, plain functions in themed modules, each with
test cases (arguments -> expected result). Sources are kept in `ast.unparse` form so that a mutation
changes exactly the mutated expression when the module is written back."""

from __future__ import annotations

import ast
from dataclasses import dataclass


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


def find(name: str) -> tuple[str, Fn]:
    for module, fns in MODULES.items():
        for fn in fns:
            if fn.name == name:
                return module, fn
    raise KeyError(name)
