"""The procedural arithmetic set: seeded word problems with exact answers, the pipeline's default data.

What: ``arithmetic_problems(n, seed, split, levels)`` returns ``n`` distinct ``Problem`` s at six
difficulty levels (1: single-digit addition in a few short phrasings; 2: one- and two-digit addition
and subtraction; 3: two-digit +/- and one-digit products; 4: a two-step word problem; 5: fractions,
answered in lowest terms; 6: two-digit sums without a carry, 23 + 41, in level 1's phrasings), each
with an exact integer or fraction answer. Level 1 is easy enough for the demo's tiny model (hidden
128, 4 layers) to learn in minutes of CPU training, but only by heart: on a pair of digits it never
saw it is right about 2% of the time. Level 6 is the demo's: each digit of its answer is a one-digit
sum, a rule the same model learns from some pairs of numbers and applies to others (about half of
its test problems right after the warm-up), so a held-out figure measures what was learned.

How it departs from the usual recipes: the train/test split is a function of the problem's
*numbers*, not its text (``split_of`` of its ``group``: the sha256 decides), so the two splits are
disjoint by construction whatever the seed or size, and no test problem is a training problem with
its operands swapped or its words changed: level 1's 55 unordered pairs of digits (its 100 ordered
pairs in 6 phrasings) fall wholly on one side. The group (``1:3+7``; ``2:41-6``; level 4 its three
numbers) travels with each problem, so the validation split a run holds out of its training data
takes whole groups too (``qerl.pipeline.evaluation.eval_config.validation_split``), and the demo's
warm-up leaves out the groups a run holds out (``exclude``). Problems are drawn round-robin across the
requested levels from a generator seeded by ``seed``, so a seed always gives the same list.
"""

from __future__ import annotations

import hashlib
import random
from fractions import Fraction

from qerl.pipeline.data.prompts import Problem

__all__ = ["ARITHMETIC_LEVELS", "TEST_PERCENT", "arithmetic_problems", "split_of"]

ARITHMETIC_LEVELS = (1, 2, 3, 4, 5, 6)
TEST_PERCENT = 20  # share of the arithmetic problem space that hashes into the test split

_NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Ben")
_ITEMS = ("apples", "books", "coins", "pens", "cards")
_LEVEL1 = (
    "{a} + {b} = ?",
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "{a} plus {b}?",
    "Sum of {a} and {b}?",
    "{a} and {b} make?",
)


def _fmt(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _make(level: int, rng: random.Random) -> tuple[str, Fraction, str]:
    """One question of ``level``, its exact answer and its group (the numbers it is about)."""
    r = rng.randint
    if level == 1:  # single-digit addition, one of a few short phrasings
        a, b = r(0, 9), r(0, 9)
        phrase = rng.choice(_LEVEL1)
        return phrase.format(a=a, b=b), Fraction(a + b), f"1:{min(a, b)}+{max(a, b)}"
    if level == 2:  # one-digit and two-digit addition / subtraction
        a, b = r(10, 49), r(0, 9)
        if rng.random() < 0.5:
            return f"What is {a} + {b}?", Fraction(a + b), f"2:{a}+{b}"
        return f"What is {a} - {b}?", Fraction(a - b), f"2:{a}-{b}"
    if level == 3:  # two-digit +/-, one-digit products
        if rng.random() < 0.5:
            a, b = r(2, 9), r(2, 9)
            return f"What is {a} * {b}?", Fraction(a * b), f"3:{min(a, b)}*{max(a, b)}"
        a, b = r(10, 99), r(10, 99)
        op = rng.choice("+-")
        group = f"3:{min(a, b)}+{max(a, b)}" if op == "+" else f"3:{a}-{b}"
        return f"What is {a} {op} {b}?", Fraction(a + b if op == "+" else a - b), group
    if level == 4:  # a two-step word problem
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, c = r(5, 40), r(2, 20), r(1, 9)
        q = f"{name} has {a} {item}, buys {b} more and gives away {c}. How many {item} now?"
        return q, Fraction(a + b - c), f"4:{a},{b},{c}"
    if level == 5:  # fractions, answer in lowest terms
        a, b, c, d = r(1, 9), r(2, 9), r(1, 9), r(2, 9)
        x, y = Fraction(a, b), Fraction(c, d)
        op = rng.choice("+-*")
        value = x + y if op == "+" else x - y if op == "-" else x * y
        pair = sorted([f"{a}/{b}", f"{c}/{d}"]) if op in "+*" else [f"{a}/{b}", f"{c}/{d}"]
        return f"What is {a}/{b} {op} {c}/{d}?", value, f"5:{pair[0]}{op}{pair[1]}"
    if level == 6:  # two-digit sums without a carry: each digit of the answer is a one-digit sum
        tens, units = r(1, 4), r(0, 9)
        a, b = 10 * tens + units, 10 * r(1, 4) + r(0, 9 - units)
        phrase = rng.choice(_LEVEL1)
        return phrase.format(a=a, b=b), Fraction(a + b), f"6:{min(a, b)}+{max(a, b)}"
    raise ValueError(f"unknown arithmetic level {level}; valid: {list(ARITHMETIC_LEVELS)}")


def split_of(group: str) -> str:
    """'test' or 'train', a fixed function of a problem's group (its numbers): the splits cannot
    overlap, nor share two numbers."""
    bucket = int(hashlib.sha256(f"qerl-arithmetic-split-{group}".encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < TEST_PERCENT else "train"


def arithmetic_problems(
    n: int,
    seed: int = 0,
    split: str = "train",
    levels: list[int] | None = None,
    exclude: frozenset[str] = frozenset(),
) -> list[Problem]:
    """``n`` distinct procedural problems of ``split`` at ``levels`` (default [1]), reproducible by
    seed, none of whose group is in ``exclude``."""
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic split must be 'train' or 'test', not '{split}'")
    levels = sorted(set(levels or [1]))
    for level in levels:
        if level not in ARITHMETIC_LEVELS:
            raise ValueError(f"unknown arithmetic level {level}; valid: {list(ARITHMETIC_LEVELS)}")
    rng = random.Random(f"qerl-arithmetic-{seed}")
    seen: set[str] = set()
    out: list[Problem] = []
    misses = 0
    while len(out) < n:
        level = levels[len(out) % len(levels)]  # balanced across levels
        question, value, group = _make(level, rng)
        if question in seen or split_of(group) != split or group in exclude:
            misses += 1
            if misses > 200 * n + 10_000:
                raise ValueError(
                    f"only {len(out)} distinct {split} problems found at levels {levels} (asked for {n}); "
                    "add levels or ask for fewer"
                )
            continue
        seen.add(question)
        pid = hashlib.sha256(question.encode()).hexdigest()[:12]
        out.append(
            Problem(
                id=f"arith-{pid}",
                question=question,
                answer=_fmt(value),
                source="arithmetic",
                level=level,
                group=group,
            )
        )
    return out
