"""Small Python functions to write, each checked by unit tests: the ``sandbox`` reward's task
(the ``smollm2_code`` recipe).

Each task names a function, says what it does and shows one call with its result, e.g. "Write
a Python function `count_vowels(s)` that returns the number of vowels (a, e, i, o, u) in the
lower-case string s. For example, count_vowels('hello') returns 2." Its ``tests`` are 4 asserts
against literal values (``assert count_vowels('sky') == 0``), made here by running the task's
reference solution (our own code, run on the host) on fixed inputs: the expected values are
right by construction, and ``reference`` (that solution's source) lets a test check that the
sandbox passes every task. String, list and arithmetic tasks, 80 in all; the test split holds
out whole functions (a stable hash of the name: 16 of 80), so a held-out function was never
asked in training.
"""

from __future__ import annotations

import hashlib
import math
import textwrap
from dataclasses import dataclass
from typing import Any

SUFFIX = " Reply with only the function in a ```python code block."


@dataclass(frozen=True)
class Task:
    """One function to write: ``name(params)`` that ``does`` (a phrase after "that");
    ``solution`` the reference body (it may use ``math``), run on each of ``inputs`` (argument
    tuples) to make the tests."""

    name: str
    params: str
    does: str
    solution: str
    inputs: tuple[tuple[Any, ...], ...]

    def source(self) -> str:
        """The reference solution as a module: ``import math`` and the function."""
        return f"import math\n\n\ndef {self.name}({self.params}):\n{textwrap.indent(self.solution, '    ')}\n"


def _t(name: str, params: str, does: str, solution: str, *inputs: tuple[Any, ...]) -> Task:
    return Task(name, params, does, solution, inputs)


TASKS: tuple[Task, ...] = (
    # ---------------------------------------------------------------- arithmetic
    _t("add", "a, b", "returns the sum of a and b", "return a + b", (2, 3), (-1, 1), (0, 0), (10, 32)),
    _t("subtract", "a, b", "returns a minus b", "return a - b", (5, 3), (0, 4), (-2, -2), (100, 1)),
    _t("multiply", "a, b", "returns the product of a and b", "return a * b", (3, 4), (0, 7), (-2, 5), (6, 6)),
    _t("square", "n", "returns n squared", "return n * n", (3,), (0,), (-4,), (12,)),
    _t("cube", "n", "returns n cubed", "return n ** 3", (2,), (0,), (-3,), (5,)),
    _t("double", "n", "returns twice n", "return 2 * n", (4,), (0,), (-7,), (50,)),
    _t("half", "n", "returns n divided by 2 as a float", "return n / 2", (4,), (5,), (0,), (-3,)),
    _t("absolute", "n", "returns the absolute value of n", "return abs(n)", (-5,), (3,), (0,), (-12,)),
    _t("is_even", "n", "returns True if n is even, else False", "return n % 2 == 0", (4,), (7,), (0,), (-3,)),
    _t("is_odd", "n", "returns True if n is odd, else False", "return n % 2 == 1", (3,), (8,), (0,), (-5,)),
    _t("is_positive", "n", "returns True if n is greater than 0", "return n > 0", (5,), (0,), (-2,), (1,)),
    _t("max_of_two", "a, b", "returns the larger of a and b", "return max(a, b)", (3, 9), (9, 3), (-1, -5), (4, 4)),
    _t(
        "min_of_three",
        "a, b, c",
        "returns the smallest of a, b and c",
        "return min(a, b, c)",
        (3, 1, 2),
        (5, 5, 5),
        (-1, 0, 1),
        (9, 8, 7),
    ),
    _t("factorial", "n", "returns n factorial (factorial(0) is 1)", "return math.factorial(n)", (0,), (1,), (5,), (7,)),
    _t(
        "fibonacci",
        "n",
        "returns the n-th Fibonacci number (fibonacci(0) is 0, fibonacci(1) is 1)",
        "a, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nreturn a",
        (0,),
        (1,),
        (7,),
        (10,),
    ),
    _t(
        "is_prime",
        "n",
        "returns True if n is a prime number",
        "return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))",
        (2,),
        (9,),
        (13,),
        (1,),
    ),
    _t(
        "gcd",
        "a, b",
        "returns the greatest common divisor of a and b",
        "return math.gcd(a, b)",
        (12, 18),
        (7, 5),
        (10, 0),
        (21, 14),
    ),
    _t(
        "lcm",
        "a, b",
        "returns the least common multiple of a and b",
        "return a * b // math.gcd(a, b)",
        (4, 6),
        (3, 5),
        (7, 7),
        (2, 8),
    ),
    _t(
        "digit_sum",
        "n",
        "returns the sum of the decimal digits of the non-negative integer n",
        "return sum(map(int, str(n)))",
        (123,),
        (0,),
        (9,),
        (4096,),
    ),
    _t(
        "count_digits",
        "n",
        "returns how many decimal digits the non-negative integer n has",
        "return len(str(n))",
        (0,),
        (7,),
        (123,),
        (100000,),
    ),
    _t(
        "reverse_number",
        "n",
        "returns the non-negative integer n with its digits reversed",
        "return int(str(n)[::-1])",
        (123,),
        (5,),
        (120,),
        (9081,),
    ),
    _t(
        "sum_to_n",
        "n",
        "returns the sum of the integers from 1 to n",
        "return n * (n + 1) // 2",
        (1,),
        (5,),
        (10,),
        (0,),
    ),
    _t(
        "power",
        "base, exp",
        "returns base raised to the power exp (exp >= 0)",
        "return base ** exp",
        (2, 3),
        (5, 0),
        (3, 4),
        (-2, 3),
    ),
    _t(
        "average",
        "numbers",
        "returns the mean of a non-empty list of numbers as a float",
        "return sum(numbers) / len(numbers)",
        ([1, 2, 3],),
        ([4],),
        ([1, 2],),
        ([-1, 1, 3, 5],),
    ),
    _t(
        "celsius_to_fahrenheit",
        "c",
        "converts c degrees Celsius to Fahrenheit (c * 9 / 5 + 32)",
        "return c * 9 / 5 + 32",
        (0,),
        (100,),
        (-40,),
        (37,),
    ),
    _t(
        "sign",
        "n",
        "returns 1 if n is positive, -1 if negative and 0 if zero",
        "return (n > 0) - (n < 0)",
        (5,),
        (-3,),
        (0,),
        (42,),
    ),
    _t(
        "collatz_steps",
        "n",
        "returns how many steps the Collatz rule (halve if even, else 3n+1) takes to reach 1 from n",
        "steps = 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    steps += 1\nreturn steps",
        (1,),
        (2,),
        (6,),
        (7,),
    ),
    _t(
        "clamp",
        "n, low, high",
        "returns n limited to the range from low to high",
        "return max(low, min(n, high))",
        (5, 0, 10),
        (-3, 0, 10),
        (15, 0, 10),
        (10, 0, 10),
    ),
    _t(
        "is_leap_year",
        "year",
        "returns True if year is a leap year in the Gregorian calendar",
        "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
        (2024,),
        (1900,),
        (2000,),
        (2023,),
    ),
    _t(
        "count_divisors",
        "n",
        "returns how many positive integers divide n (n >= 1)",
        "return sum((n % d == 0 for d in range(1, n + 1)))",
        (1,),
        (6,),
        (7,),
        (12,),
    ),
    # ---------------------------------------------------------------- strings
    _t(
        "reverse_string",
        "s",
        "returns the string s reversed",
        "return s[::-1]",
        ("abc",),
        ("",),
        ("racecar",),
        ("hello world",),
    ),
    _t("to_upper", "s", "returns s in upper case", "return s.upper()", ("abc",), ("Hello",), ("",), ("a1b2",)),
    _t(
        "count_vowels",
        "s",
        "returns the number of vowels (a, e, i, o, u) in the lower-case string s",
        "return sum((c in 'aeiou' for c in s))",
        ("hello",),
        ("sky",),
        ("aeiou",),
        ("",),
    ),
    _t(
        "is_palindrome",
        "s",
        "returns True if the string s reads the same backwards",
        "return s == s[::-1]",
        ("racecar",),
        ("abc",),
        ("",),
        ("abba",),
    ),
    _t(
        "first_char",
        "s",
        "returns the first character of the non-empty string s",
        "return s[0]",
        ("hello",),
        ("a",),
        ("xyz",),
        ("Zoo",),
    ),
    _t(
        "last_char",
        "s",
        "returns the last character of the non-empty string s",
        "return s[-1]",
        ("hello",),
        ("a",),
        ("xyz",),
        ("Zoo",),
    ),
    _t(
        "count_words",
        "s",
        "returns the number of words separated by spaces in s",
        "return len(s.split())",
        ("hello world",),
        ("",),
        ("one",),
        ("a b  c",),
    ),
    _t(
        "repeat_string",
        "s, n",
        "returns the string s repeated n times",
        "return s * n",
        ("ab", 3),
        ("x", 0),
        ("", 5),
        ("hi", 1),
    ),
    _t(
        "capitalize_words",
        "s",
        "returns s with the first letter of every word in upper case (words separated by single spaces)",
        "return ' '.join((w[:1].upper() + w[1:] for w in s.split(' ')))",
        ("hello world",),
        ("a",),
        ("python is fun",),
        ("",),
    ),
    _t(
        "remove_spaces",
        "s",
        "returns s with every space removed",
        "return s.replace(' ', '')",
        ("a b c",),
        ("nospace",),
        ("  ",),
        (" x ",),
    ),
    _t(
        "count_char",
        "s, c",
        "returns how many times the character c occurs in s",
        "return s.count(c)",
        ("banana", "a"),
        ("banana", "z"),
        ("", "a"),
        ("aaa", "a"),
    ),
    _t(
        "starts_with",
        "s, prefix",
        "returns True if s starts with prefix",
        "return s.startswith(prefix)",
        ("hello", "he"),
        ("hello", "lo"),
        ("abc", ""),
        ("", "a"),
    ),
    _t(
        "longest_word",
        "s",
        "returns the longest word in s (the first one if tied; words separated by spaces)",
        "return max(s.split(), key=len)",
        ("a bb ccc",),
        ("hello",),
        ("ab cd",),
        ("x yyy zz",),
    ),
    _t(
        "is_anagram",
        "a, b",
        "returns True if the strings a and b use the same letters the same number of times",
        "return sorted(a) == sorted(b)",
        ("listen", "silent"),
        ("abc", "abd"),
        ("", ""),
        ("aab", "aba"),
    ),
    _t(
        "run_length",
        "s",
        "returns the run-length encoding of s: each run of a character as the character then its count "
        "('aab' -> 'a2b1')",
        "out, i = [], 0\n"
        "while i < len(s):\n"
        "    j = i\n"
        "    while j < len(s) and s[j] == s[i]:\n"
        "        j += 1\n"
        "    out.append(s[i] + str(j - i))\n"
        "    i = j\n"
        "return ''.join(out)",
        ("aab",),
        ("abc",),
        ("",),
        ("zzzz",),
    ),
    _t(
        "swap_case",
        "s",
        "returns s with upper case letters made lower case and lower case made upper",
        "return s.swapcase()",
        ("Hello",),
        ("ABC",),
        ("",),
        ("a1B",),
    ),
    _t(
        "initials",
        "name",
        "returns the upper-case first letters of the words of name joined together",
        "return ''.join((w[0].upper() for w in name.split()))",
        ("ada lovelace",),
        ("Alan Turing",),
        ("x",),
        ("grace brewster hopper",),
    ),
    _t(
        "is_digit_string",
        "s",
        "returns True if s is non-empty and every character is a digit 0-9",
        "return s != '' and all((c in '0123456789' for c in s))",
        ("123",),
        ("12a",),
        ("",),
        ("0",),
    ),
    _t(
        "middle_char",
        "s",
        "returns the middle character of s if its length is odd, else the middle two characters",
        "return s[(len(s) - 1) // 2:len(s) // 2 + 1]",
        ("abc",),
        ("abcd",),
        ("a",),
        ("hello",),
    ),
    _t(
        "remove_vowels",
        "s",
        "returns s without its vowels (a, e, i, o, u)",
        "return ''.join((c for c in s if c not in 'aeiou'))",
        ("hello",),
        ("sky",),
        ("aeiou",),
        ("banana",),
    ),
    _t(
        "count_upper",
        "s",
        "returns the number of upper-case letters in s",
        "return sum((c.isupper() for c in s))",
        ("Hello World",),
        ("abc",),
        ("ABC",),
        ("",),
    ),
    _t(
        "join_words",
        "words",
        "returns the strings in the list words joined with single spaces",
        "return ' '.join(words)",
        (["a", "b"],),
        ([],),
        (["hello"],),
        (["x", "y", "z"],),
    ),
    # ---------------------------------------------------------------- lists
    _t(
        "sum_list",
        "numbers",
        "returns the sum of the numbers in the list",
        "return sum(numbers)",
        ([1, 2, 3],),
        ([],),
        ([-1, 1],),
        ([10],),
    ),
    _t(
        "max_list",
        "numbers",
        "returns the largest number in the non-empty list",
        "return max(numbers)",
        ([1, 5, 3],),
        ([-2, -9],),
        ([7],),
        ([4, 4, 1],),
    ),
    _t(
        "count_even",
        "numbers",
        "returns how many numbers in the list are even",
        "return sum((x % 2 == 0 for x in numbers))",
        ([1, 2, 3, 4],),
        ([],),
        ([1, 3],),
        ([0, -2],),
    ),
    _t(
        "filter_positive",
        "numbers",
        "returns a list of the numbers greater than 0, in order",
        "return [x for x in numbers if x > 0]",
        ([1, -2, 3],),
        ([],),
        ([-1, 0],),
        ([5, 6],),
    ),
    _t(
        "square_list",
        "numbers",
        "returns a list of the squares of the numbers, in order",
        "return [x * x for x in numbers]",
        ([1, 2, 3],),
        ([],),
        ([-2],),
        ([0, 10],),
    ),
    _t(
        "reverse_list",
        "items",
        "returns a new list with the items in reverse order",
        "return items[::-1]",
        ([1, 2, 3],),
        ([],),
        (["a"],),
        ([1, 1, 2],),
    ),
    _t(
        "unique",
        "items",
        "returns the items without duplicates, keeping the first occurrence of each, in order",
        "return list(dict.fromkeys(items))",
        ([1, 2, 1, 3],),
        ([],),
        ([5, 5, 5],),
        (["a", "b", "a"],),
    ),
    _t(
        "second_largest",
        "numbers",
        "returns the second largest distinct number of the list (it has at least two distinct numbers)",
        "return sorted(set(numbers))[-2]",
        ([1, 2, 3],),
        ([5, 5, 4],),
        ([-1, -2],),
        ([10, 20, 20, 30],),
    ),
    _t(
        "flatten",
        "lists",
        "returns one list of the items of the lists in lists, in order",
        "return [x for xs in lists for x in xs]",
        ([[1, 2], [3]],),
        ([],),
        ([[], [1]],),
        ([["a"], ["b", "c"]],),
    ),
    _t(
        "product_list",
        "numbers",
        "returns the product of the numbers in the list (1 for an empty list)",
        "return math.prod(numbers)",
        ([1, 2, 3, 4],),
        ([],),
        ([5],),
        ([2, -3],),
    ),
    _t(
        "count_occurrences",
        "items, x",
        "returns how many times x occurs in the list items",
        "return items.count(x)",
        ([1, 2, 1], 1),
        ([], 3),
        (["a", "b"], "c"),
        ([0, 0, 0], 0),
    ),
    _t(
        "first_index",
        "items, x",
        "returns the index of the first x in items, or -1 if x is not there",
        "return items.index(x) if x in items else -1",
        ([4, 5, 6], 5),
        ([1, 2], 3),
        ([7, 7], 7),
        ([], 1),
    ),
    _t(
        "running_sum",
        "numbers",
        "returns the list of running totals of the numbers ([1, 2, 3] -> [1, 3, 6])",
        "return [sum(numbers[:i + 1]) for i in range(len(numbers))]",
        ([1, 2, 3],),
        ([],),
        ([5],),
        ([1, -1, 1],),
    ),
    _t(
        "merge_sorted",
        "a, b",
        "returns one sorted list of the items of the sorted lists a and b",
        "return sorted(a + b)",
        ([1, 3], [2, 4]),
        ([], [1]),
        ([1, 1], [1]),
        ([5], []),
    ),
    _t(
        "chunk",
        "items, size",
        "returns items split into consecutive lists of length size (the last may be shorter)",
        "return [items[i:i + size] for i in range(0, len(items), size)]",
        ([1, 2, 3, 4, 5], 2),
        ([], 3),
        ([1, 2], 2),
        ([1], 5),
    ),
    _t(
        "rotate_left",
        "items, k",
        "returns items rotated left by k places ([1, 2, 3], 1 -> [2, 3, 1])",
        "return items[k % len(items):] + items[:k % len(items)] if items else []",
        ([1, 2, 3], 1),
        ([1, 2, 3], 3),
        ([], 2),
        ([1, 2, 3, 4], 6),
    ),
    _t(
        "pairwise_sum",
        "a, b",
        "returns the list of sums of items at the same position of the equally long lists a and b",
        "return [x + y for x, y in zip(a, b)]",
        ([1, 2], [3, 4]),
        ([], []),
        ([0], [5]),
        ([-1, 1, 2], [1, -1, 3]),
    ),
    _t(
        "zip_to_dict",
        "keys, values",
        "returns a dict mapping each key to the value at the same position",
        "return dict(zip(keys, values))",
        (["a", "b"], [1, 2]),
        ([], []),
        (["x"], [0]),
        ([1, 2, 3], ["a", "b", "c"]),
    ),
    _t(
        "count_words_dict",
        "s",
        "returns a dict mapping each word of s (separated by spaces) to how many times it occurs",
        "return {w: s.split().count(w) for w in s.split()}",
        ("a b a",),
        ("",),
        ("hi",),
        ("x y z x x",),
    ),
    _t(
        "max_difference",
        "numbers",
        "returns the largest number minus the smallest number of the non-empty list",
        "return max(numbers) - min(numbers)",
        ([1, 5, 3],),
        ([4],),
        ([-2, 2],),
        ([7, 7, 7],),
    ),
    _t(
        "all_equal",
        "items",
        "returns True if every item of the list is equal to the others (True for an empty list)",
        "return len(set(items)) <= 1",
        ([1, 1, 1],),
        ([1, 2],),
        ([],),
        (["a"],),
    ),
    _t(
        "evens_then_odds",
        "numbers",
        "returns the even numbers of the list followed by the odd ones, each group in its original order",
        "return [x for x in numbers if x % 2 == 0] + [x for x in numbers if x % 2]",
        ([1, 2, 3, 4],),
        ([],),
        ([3, 1],),
        ([2, 5, 8, 7],),
    ),
    _t(
        "sort_by_length",
        "words",
        "returns the words sorted by length, shortest first (ties keep their order)",
        "return sorted(words, key=len)",
        (["ccc", "a", "bb"],),
        ([],),
        (["ab", "cd"],),
        (["xyz", "x", "xy"],),
    ),
    _t(
        "nested_sum",
        "lists",
        "returns the sum of all numbers in a list of lists of numbers",
        "return sum((sum(xs) for xs in lists))",
        ([[1, 2], [3]],),
        ([],),
        ([[], [5]],),
        ([[-1], [1, 1]],),
    ),
    _t(
        "moving_average",
        "numbers, k",
        "returns the list of means (floats) of each k consecutive numbers",
        "return [sum(numbers[i:i + k]) / k for i in range(len(numbers) - k + 1)]",
        ([1, 2, 3, 4], 2),
        ([5], 1),
        ([1, 2], 3),
        ([2, 4, 6], 3),
    ),
    _t(
        "dedupe_sorted",
        "numbers",
        "returns the sorted list of the distinct numbers",
        "return sorted(set(numbers))",
        ([3, 1, 3, 2],),
        ([],),
        ([1, 1],),
        ([-1, 5, -1],),
    ),
    _t(
        "index_of_max",
        "numbers",
        "returns the index of the largest number of the non-empty list (the first if tied)",
        "return numbers.index(max(numbers))",
        ([1, 5, 3],),
        ([7],),
        ([2, 2],),
        ([-3, -1, -2],),
    ),
    _t(
        "count_greater",
        "numbers, x",
        "returns how many numbers in the list are greater than x",
        "return sum((n > x for n in numbers))",
        ([1, 5, 3], 2),
        ([], 0),
        ([1, 1], 1),
        ([10, 20], -5),
    ),
)


def example_of(task: Task, suffix: bool = True) -> dict[str, Any]:
    """A dataset row for ``task``: the chat ``messages``, the ``prompt`` text, its ``tests``
    (one assert per input), the function's ``name`` and ``reference`` (a correct solution)."""
    namespace: dict[str, Any] = {"math": math}
    exec(task.source(), namespace)
    solve = namespace[task.name]
    calls = [f"{task.name}({', '.join(map(repr, args))})" for args in task.inputs]
    values = [solve(*args) for args in task.inputs]
    prompt = (
        f"Write a Python function `{task.name}({task.params})` that {task.does}. "
        f"For example, {calls[0]} returns {values[0]!r}." + (SUFFIX if suffix else "")
    )
    return {
        "messages": [{"role": "user", "content": prompt}],
        "prompt": prompt,
        "tests": [f"assert {call} == {value!r}" for call, value in zip(calls, values)],
        "name": task.name,
        "reference": task.source(),
    }


def in_test_split(name: str, share: float = 0.2) -> bool:
    """Whether the function ``name`` is held out: a stable hash of the name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") < share * 2**32


def code_functions(
    split: str = "train", size: int | None = None, test_share: float = 0.2, suffix: bool = True
) -> list[dict[str, Any]]:
    """The tasks of ``split`` (``train``, ``test`` or ``all``), in a fixed order; ``size`` rows
    (cycling through the split's tasks when larger). ``suffix`` asks for a code block."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"code_functions: split must be 'train', 'test' or 'all', got {split!r}")
    held_out = split == "test"
    rows = [example_of(t, suffix) for t in TASKS if split == "all" or in_test_split(t.name, test_share) == held_out]
    if not rows:
        raise ValueError(
            f"code_functions: the {split} split is empty with test_share={test_share}; use a share in (0, 1)"
        )
    return rows if size is None else [rows[i % len(rows)] for i in range(size)]
