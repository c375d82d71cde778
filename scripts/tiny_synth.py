"""Short, self-contained Python functions written from task descriptions, for the tiny models.

The library code the tiny models learn from (scripts/tiny_corpus.py) is long and leans
on its own package; a few-million-parameter model trained on it alone answers "write a
function that ..." with a plausible first line and then wanders. This module adds what
a first programming course would show: small functions over numbers, lists, strings and
dicts, each with a one-sentence docstring, written several ways (a loop, a
comprehension, a builtin), with several names and argument names.

Every task carries a reference (a Python callable) and sample inputs: the tests run
every variant of every task against it, and the doctest examples that some variants
show are the reference's own results, so nothing here teaches a wrong answer.

Each task gives:

- chat exchanges, "Write a Python function `name(args)` that <sentence>." answered with
  the function in a python fence (and sometimes "What does this function do?");
- plain source documents of a few functions each, as a module would hold them.

NOTE: `is_prime` is one of the tasks, so the README's samples (`ssmserve generate "def
is_prime(n):"` and the chat request for `is_prime(n)`) show a function the model was
trained on, and the README says so. A first run without it (2026-12-06, one H100, 8
minutes) answered the chat request with `return n % 2 == 0`: at 7.8 M parameters the
model recalls the nearest function it saw rather than composing a new one (held-out
requests like "sum of the squares" got `return sum(numbers)`).
"""

from __future__ import annotations

import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tiny_chat


@dataclass(frozen=True)
class Task:
    """One small function, written several ways.

    `says` are imperative sentences ("return True if @0 is even"), `bodies` function
    bodies; in both, @0, @1, ... stand for the arguments' names, one tuple of which
    `args` chooses. `ref` computes the right answer for each of `samples`. `_t` takes
    `bodies` as one indented block, the variants separated by `---` lines.
    """

    names: tuple[str, ...]
    args: tuple[tuple[str, ...], ...]
    says: tuple[str, ...]
    bodies: tuple[str, ...]
    ref: Callable[..., Any]
    samples: tuple[tuple[Any, ...], ...]


def _t(names, args, says, bodies, ref, samples) -> Task:
    def split(text):
        return tuple(text.split("|")) if isinstance(text, str) else tuple(text)

    arg_sets = tuple(tuple(a.split(",")) for a in split(args))
    variants = textwrap.dedent(bodies).strip("\n").split("\n---\n")
    return Task(split(names), arg_sets, split(says), tuple(variants), ref, tuple(samples))


def _digits_sum(n):
    return sum(int(c) for c in str(abs(n)))


def _collatz(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _dedupe(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _merge(a, b):
    return sorted(a + b)


def _camel(s):
    head, *rest = s.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _first_unique(s):
    return next((c for c in s if s.count(c) == 1), None)


TASKS: tuple[Task, ...] = (
    # ---------------------------------------------------------------- numbers
    _t(
        "is_even",
        "n|number|x",
        "return True if @0 is even|check whether @0 is even",
        """
        return @0 % 2 == 0
        ---
        if @0 % 2 == 0:
            return True
        return False
        """,
        lambda n: n % 2 == 0,
        [(4,), (7,), (0,)],
    ),
    _t(
        "is_odd",
        "n|number|x",
        "return True if @0 is odd|check whether @0 is odd",
        """
        return @0 % 2 == 1
        ---
        return @0 % 2 != 0
        """,
        lambda n: n % 2 == 1,
        [(3,), (8,), (1,)],
    ),
    _t(
        "is_divisible|divides",
        "n,d|a,b|number,divisor",
        "return True if @0 is divisible by @1|check whether @1 divides @0 evenly",
        """
        return @0 % @1 == 0
        """,
        lambda n, d: n % d == 0,
        [(10, 5), (10, 3), (9, 3)],
    ),
    _t(
        "factorial",
        "n|number",
        "return the factorial of @0|compute @0 factorial",
        """
        result = 1
        for i in range(2, @0 + 1):
            result *= i
        return result
        ---
        if @0 <= 1:
            return 1
        return @0 * factorial(@0 - 1)
        ---
        result = 1
        while @0 > 1:
            result *= @0
            @0 -= 1
        return result
        """,
        lambda n: __import__("math").factorial(n),
        [(0,), (1,), (5,)],
    ),
    _t(
        "fibonacci|fib",
        "n|k",
        "return the @0-th Fibonacci number|compute the Fibonacci number at index @0",
        """
        a, b = 0, 1
        for _ in range(@0):
            a, b = b, a + b
        return a
        ---
        if @0 < 2:
            return @0
        previous, current = 0, 1
        for _ in range(@0 - 1):
            previous, current = current, previous + current
        return current
        """,
        _fib,
        [(0,), (1,), (10,)],
    ),
    _t(
        "gcd|greatest_common_divisor",
        "a,b|x,y|m,n",
        "return the greatest common divisor of @0 and @1",
        """
        while @1:
            @0, @1 = @1, @0 % @1
        return @0
        ---
        if @1 == 0:
            return @0
        return gcd(@1, @0 % @1)
        """,
        lambda a, b: __import__("math").gcd(a, b),
        [(12, 18), (7, 5), (100, 75)],
    ),
    _t(
        "lcm|least_common_multiple",
        "a,b|x,y",
        "return the least common multiple of @0 and @1",
        """
        larger = max(@0, @1)
        while larger % @0 or larger % @1:
            larger += 1
        return larger
        ---
        p, q = @0, @1
        while q:
            p, q = q, p % q
        return @0 * @1 // p
        """,
        lambda a, b: a * b // __import__("math").gcd(a, b),
        [(4, 6), (3, 5), (12, 18)],
    ),
    _t(
        "sum_of_digits|digit_sum",
        "n|number",
        "return the sum of the digits of @0|add up the decimal digits of @0",
        """
        total = 0
        @0 = abs(@0)
        while @0 > 0:
            total += @0 % 10
            @0 //= 10
        return total
        ---
        return sum(int(digit) for digit in str(abs(@0)))
        """,
        _digits_sum,
        [(123,), (0,), (9045,)],
    ),
    _t(
        "count_digits|num_digits",
        "n|number",
        "return how many decimal digits @0 has|count the digits of @0",
        """
        return len(str(abs(@0)))
        ---
        @0 = abs(@0)
        count = 1
        while @0 >= 10:
            @0 //= 10
            count += 1
        return count
        """,
        lambda n: len(str(abs(n))),
        [(0,), (7,), (12345,)],
    ),
    _t(
        "reverse_number|reverse_digits",
        "n|number",
        "return @0 with its digits in reverse order",
        """
        result = 0
        while @0 > 0:
            result = result * 10 + @0 % 10
            @0 //= 10
        return result
        ---
        return int(str(@0)[::-1])
        """,
        lambda n: int(str(n)[::-1]),
        [(123,), (1200,), (5,)],
    ),
    _t(
        "is_palindrome_number",
        "n|number",
        "return True if @0 reads the same forwards and backwards",
        """
        text = str(@0)
        return text == text[::-1]
        ---
        return str(@0) == str(@0)[::-1]
        """,
        lambda n: str(n) == str(n)[::-1],
        [(121,), (123,), (7,)],
    ),
    _t(
        "is_perfect_square",
        "n|number",
        "return True if @0 is a perfect square",
        """
        if @0 < 0:
            return False
        root = int(@0 ** 0.5)
        return root * root == @0
        ---
        i = 0
        while i * i < @0:
            i += 1
        return i * i == @0
        """,
        lambda n: n >= 0 and int(n**0.5) ** 2 == n,
        [(16,), (15,), (0,)],
    ),
    _t(
        "is_power_of_two",
        "n|number",
        "return True if @0 is a power of two",
        """
        if @0 < 1:
            return False
        while @0 % 2 == 0:
            @0 //= 2
        return @0 == 1
        ---
        return @0 > 0 and @0 & (@0 - 1) == 0
        """,
        lambda n: n > 0 and n & (n - 1) == 0,
        [(8,), (12,), (1,)],
    ),
    _t(
        "is_prime",
        "n|number|x",
        (
            "return True if @0 is a prime",
            "return True if @0 is a prime number",
            "check whether @0 is prime",
        ),
        """
        if @0 < 2:
            return False
        for i in range(2, @0):
            if @0 % i == 0:
                return False
        return True
        ---
        if @0 < 2:
            return False
        i = 2
        while i * i <= @0:
            if @0 % i == 0:
                return False
            i += 1
        return True
        ---
        if @0 < 2:
            return False
        return all(@0 % i != 0 for i in range(2, int(@0 ** 0.5) + 1))
        """,
        lambda n: n >= 2 and all(n % i for i in range(2, n)),
        [(2,), (15,), (17,), (1,)],
    ),
    _t(
        "primes_up_to|primes",
        "n|limit",
        "return a list of the prime numbers up to and including @0",
        """
        result = []
        for candidate in range(2, @0 + 1):
            if all(candidate % i != 0 for i in range(2, candidate)):
                result.append(candidate)
        return result
        ---
        return [k for k in range(2, @0 + 1) if all(k % i for i in range(2, k))]
        """,
        lambda n: [k for k in range(2, n + 1) if all(k % i for i in range(2, k))],
        [(10,), (1,), (20,)],
    ),
    _t(
        "count_divisors|num_divisors",
        "n|number",
        "return the number of positive divisors of @0|count the numbers that divide @0",
        """
        count = 0
        for i in range(1, @0 + 1):
            if @0 % i == 0:
                count += 1
        return count
        ---
        return sum(1 for i in range(1, @0 + 1) if @0 % i == 0)
        """,
        lambda n: sum(1 for i in range(1, n + 1) if n % i == 0),
        [(1,), (12,), (7,)],
    ),
    _t(
        "divisors|get_divisors",
        "n|number",
        "return a list of the positive divisors of @0",
        """
        return [i for i in range(1, @0 + 1) if @0 % i == 0]
        ---
        result = []
        for i in range(1, @0 + 1):
            if @0 % i == 0:
                result.append(i)
        return result
        """,
        lambda n: [i for i in range(1, n + 1) if n % i == 0],
        [(12,), (1,), (9,)],
    ),
    _t(
        "has_divisor",
        "n,low,high|number,start,stop",
        "return True if some number from @1 up to but not including @2 divides @0",
        """
        for i in range(@1, @2):
            if @0 % i == 0:
                return True
        return False
        ---
        return any(@0 % i == 0 for i in range(@1, @2))
        """,
        lambda n, lo, hi: any(n % i == 0 for i in range(lo, hi)),
        [(15, 2, 5), (7, 2, 7), (9, 4, 9)],
    ),
    _t(
        "smallest_divisor",
        "n|number",
        "return the smallest divisor of @0 greater than 1",
        """
        i = 2
        while @0 % i != 0:
            i += 1
        return i
        ---
        for i in range(2, @0 + 1):
            if @0 % i == 0:
                return i
        return @0
        """,
        lambda n: next(i for i in range(2, n + 1) if n % i == 0),
        [(15,), (49,), (2,)],
    ),
    _t(
        "is_perfect|is_perfect_number",
        "n|number",
        "return True if @0 equals the sum of its proper divisors",
        """
        total = 0
        for i in range(1, @0):
            if @0 % i == 0:
                total += i
        return total == @0
        ---
        return @0 > 1 and sum(i for i in range(1, @0) if @0 % i == 0) == @0
        """,
        lambda n: n > 1 and sum(i for i in range(1, n) if n % i == 0) == n,
        [(6,), (28,), (12,)],
    ),
    _t(
        "power|pow_int",
        "base,exp|x,n",
        "return @0 raised to the power @1, for a non-negative integer @1",
        """
        result = 1
        for _ in range(@1):
            result *= @0
        return result
        ---
        if @1 == 0:
            return 1
        return @0 * power(@0, @1 - 1)
        """,
        lambda b, e: b**e,
        [(2, 10), (3, 0), (5, 3)],
    ),
    _t(
        "square|squared",
        "x|n|value",
        "return the square of @0",
        """
        return @0 * @0
        ---
        return @0 ** 2
        """,
        lambda x: x * x,
        [(3,), (-4,), (0,)],
    ),
    _t(
        "cube",
        "x|n",
        "return the cube of @0",
        """
        return @0 * @0 * @0
        ---
        return @0 ** 3
        """,
        lambda x: x**3,
        [(2,), (-3,)],
    ),
    _t(
        "absolute|abs_value",
        "x|n|value",
        "return the absolute value of @0",
        """
        if @0 < 0:
            return -@0
        return @0
        ---
        return -@0 if @0 < 0 else @0
        """,
        abs,
        [(-5,), (3,), (0,)],
    ),
    _t(
        "sign",
        "x|n",
        "return 1 if @0 is positive, -1 if it is negative and 0 if it is zero",
        """
        if @0 > 0:
            return 1
        if @0 < 0:
            return -1
        return 0
        ---
        return (@0 > 0) - (@0 < 0)
        """,
        lambda x: (x > 0) - (x < 0),
        [(5,), (-2,), (0,)],
    ),
    _t(
        "clamp",
        "x,low,high|value,lo,hi",
        "return @0 limited to the range from @1 to @2",
        """
        if @0 < @1:
            return @1
        if @0 > @2:
            return @2
        return @0
        ---
        return max(@1, min(@0, @2))
        """,
        lambda x, lo, hi: max(lo, min(x, hi)),
        [(5, 0, 10), (-3, 0, 10), (12, 0, 10)],
    ),
    _t(
        "celsius_to_fahrenheit|to_fahrenheit",
        "celsius|c|degrees",
        "convert a temperature of @0 degrees Celsius to Fahrenheit",
        """
        return @0 * 9 / 5 + 32
        """,
        lambda c: c * 9 / 5 + 32,
        [(0,), (100,), (-40,)],
    ),
    _t(
        "fahrenheit_to_celsius|to_celsius",
        "fahrenheit|f|degrees",
        "convert a temperature of @0 degrees Fahrenheit to Celsius",
        """
        return (@0 - 32) * 5 / 9
        """,
        lambda f: (f - 32) * 5 / 9,
        [(32,), (212,), (-40,)],
    ),
    _t(
        "is_leap_year|is_leap",
        "year|y",
        "return True if @0 is a leap year",
        """
        return @0 % 4 == 0 and (@0 % 100 != 0 or @0 % 400 == 0)
        ---
        if @0 % 400 == 0:
            return True
        if @0 % 100 == 0:
            return False
        return @0 % 4 == 0
        """,
        lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0),
        [(2024,), (1900,), (2000,), (2023,)],
    ),
    _t(
        "triangular|sum_to",
        "n|number",
        "return the sum of the integers from 1 to @0",
        """
        total = 0
        for i in range(1, @0 + 1):
            total += i
        return total
        ---
        return @0 * (@0 + 1) // 2
        ---
        return sum(range(1, @0 + 1))
        """,
        lambda n: n * (n + 1) // 2,
        [(4,), (0,), (10,)],
    ),
    _t(
        "collatz_steps",
        "n|number",
        "return how many steps the Collatz sequence takes from @0 to reach 1",
        """
        steps = 0
        while @0 != 1:
            if @0 % 2 == 0:
                @0 //= 2
            else:
                @0 = 3 * @0 + 1
            steps += 1
        return steps
        """,
        _collatz,
        [(1,), (6,), (27,)],
    ),
    _t(
        "to_binary|binary",
        "n|number",
        "return the binary digits of a non-negative integer @0 as a string",
        """
        if @0 == 0:
            return "0"
        digits = ""
        while @0 > 0:
            digits = str(@0 % 2) + digits
            @0 //= 2
        return digits
        ---
        return bin(@0)[2:]
        """,
        lambda n: bin(n)[2:],
        [(0,), (5,), (255,)],
    ),
    _t(
        "average|mean_of_two",
        "a,b|x,y",
        "return the average of @0 and @1",
        """
        return (@0 + @1) / 2
        """,
        lambda a, b: (a + b) / 2,
        [(2, 4), (1, 2)],
    ),
    _t(
        "max_of_three|largest_of_three",
        "a,b,c|x,y,z",
        "return the largest of @0, @1 and @2",
        """
        largest = @0
        if @1 > largest:
            largest = @1
        if @2 > largest:
            largest = @2
        return largest
        ---
        return max(@0, @1, @2)
        """,
        max,
        [(1, 5, 3), (7, 2, 2), (-1, -5, -3)],
    ),
    # ------------------------------------------------------------------ lists
    _t(
        "total|sum_list",
        "numbers|items|values",
        "return the sum of the numbers in @0",
        """
        result = 0
        for x in @0:
            result += x
        return result
        ---
        return sum(@0)
        """,
        sum,
        [([1, 2, 3],), ([],), ([5, -5, 10],)],
    ),
    _t(
        "mean|average_of",
        "numbers|values|data",
        "return the arithmetic mean of @0, or 0 if it is empty",
        """
        if not @0:
            return 0
        return sum(@0) / len(@0)
        ---
        total = 0
        count = 0
        for x in @0:
            total += x
            count += 1
        return total / count if count else 0
        """,
        lambda xs: sum(xs) / len(xs) if xs else 0,
        [([1, 2, 3, 4],), ([],), ([10],)],
    ),
    _t(
        "largest|find_max|maximum",
        "numbers|items|values",
        "return the largest item of the non-empty list @0",
        """
        best = @0[0]
        for x in @0[1:]:
            if x > best:
                best = x
        return best
        ---
        return max(@0)
        """,
        max,
        [([3, 9, 2],), ([-4, -1],), ([7],)],
    ),
    _t(
        "smallest|find_min|minimum",
        "numbers|items|values",
        "return the smallest item of the non-empty list @0",
        """
        best = @0[0]
        for x in @0:
            if x < best:
                best = x
        return best
        ---
        return min(@0)
        """,
        min,
        [([3, 9, 2],), ([-4, -1],), ([7],)],
    ),
    _t(
        "count_even|count_evens",
        "numbers|values",
        "return how many even numbers @0 contains",
        """
        count = 0
        for x in @0:
            if x % 2 == 0:
                count += 1
        return count
        ---
        return sum(1 for x in @0 if x % 2 == 0)
        """,
        lambda xs: sum(1 for x in xs if x % 2 == 0),
        [([1, 2, 3, 4],), ([],), ([1, 3],)],
    ),
    _t(
        "count_positive|count_positives",
        "numbers|values",
        "return how many numbers in @0 are greater than zero",
        """
        count = 0
        for x in @0:
            if x > 0:
                count += 1
        return count
        ---
        return len([x for x in @0 if x > 0])
        """,
        lambda xs: sum(1 for x in xs if x > 0),
        [([1, -2, 3, 0],), ([],)],
    ),
    _t(
        "count_occurrences|count_item",
        "items,target|values,value|xs,x",
        "return how many times @1 occurs in @0",
        """
        count = 0
        for item in @0:
            if item == @1:
                count += 1
        return count
        ---
        return @0.count(@1)
        """,
        lambda xs, t: xs.count(t),
        [([1, 2, 1, 3], 1), ([], 5), (["a", "b"], "c")],
    ),
    _t(
        "evens|filter_even|even_numbers",
        "numbers|values",
        "return the even numbers of @0 in their original order",
        """
        return [x for x in @0 if x % 2 == 0]
        ---
        result = []
        for x in @0:
            if x % 2 == 0:
                result.append(x)
        return result
        """,
        lambda xs: [x for x in xs if x % 2 == 0],
        [([1, 2, 3, 4, 6],), ([],)],
    ),
    _t(
        "positives|filter_positive",
        "numbers|values",
        "return a list of the numbers in @0 that are greater than zero",
        """
        return [x for x in @0 if x > 0]
        ---
        result = []
        for x in @0:
            if x > 0:
                result.append(x)
        return result
        """,
        lambda xs: [x for x in xs if x > 0],
        [([3, -1, 0, 5],), ([],)],
    ),
    _t(
        "squares|square_all",
        "numbers|values",
        "return a list of the squares of the numbers in @0",
        """
        return [x * x for x in @0]
        ---
        result = []
        for x in @0:
            result.append(x ** 2)
        return result
        """,
        lambda xs: [x * x for x in xs],
        [([1, 2, 3],), ([],)],
    ),
    _t(
        "reverse_list|reversed_list",
        "items|values|xs",
        "return a new list with the items of @0 in reverse order",
        """
        return @0[::-1]
        ---
        result = []
        for i in range(len(@0) - 1, -1, -1):
            result.append(@0[i])
        return result
        """,
        lambda xs: xs[::-1],
        [([1, 2, 3],), ([],)],
    ),
    _t(
        "remove_duplicates|unique|dedupe",
        "items|values",
        "return the items of @0 without duplicates, keeping the first occurrence of each",
        """
        seen = set()
        result = []
        for item in @0:
            if item not in seen:
                seen.add(item)
                result.append(item)
        return result
        ---
        return list(dict.fromkeys(@0))
        """,
        _dedupe,
        [([1, 2, 1, 3, 2],), ([],)],
    ),
    _t(
        "index_of|find_index|linear_search",
        "items,target|values,value",
        "return the index of the first @1 in @0, or -1 if it is not there",
        """
        for i, item in enumerate(@0):
            if item == @1:
                return i
        return -1
        ---
        for i in range(len(@0)):
            if @0[i] == @1:
                return i
        return -1
        """,
        lambda xs, t: xs.index(t) if t in xs else -1,
        [([4, 5, 6], 5), ([4, 5, 6], 7), ([], 1)],
    ),
    _t(
        "contains|includes",
        "items,target|values,value",
        "return True if @1 is an item of @0",
        """
        for item in @0:
            if item == @1:
                return True
        return False
        ---
        return @1 in @0
        """,
        lambda xs, t: t in xs,
        [([1, 2, 3], 2), ([1, 2, 3], 4)],
    ),
    _t(
        "is_sorted|is_ascending",
        "items|values|numbers",
        "return True if the items of @0 are in ascending order",
        """
        for i in range(1, len(@0)):
            if @0[i - 1] > @0[i]:
                return False
        return True
        ---
        return all(a <= b for a, b in zip(@0, @0[1:]))
        """,
        lambda xs: xs == sorted(xs),
        [([1, 2, 2, 5],), ([3, 1],), ([],)],
    ),
    _t(
        "product|multiply_all",
        "numbers|values",
        "return the product of the numbers in @0",
        """
        result = 1
        for x in @0:
            result *= x
        return result
        """,
        lambda xs: __import__("math").prod(xs),
        [([1, 2, 3, 4],), ([],), ([5, 0],)],
    ),
    _t(
        "running_sum|cumulative_sum",
        "numbers|values",
        "return the running totals of @0",
        """
        result = []
        total = 0
        for x in @0:
            total += x
            result.append(total)
        return result
        """,
        lambda xs: [sum(xs[: i + 1]) for i in range(len(xs))],
        [([1, 2, 3],), ([],)],
    ),
    _t(
        "flatten",
        "lists|nested|rows",
        "return one list of the items of the lists in @0",
        """
        result = []
        for inner in @0:
            for item in inner:
                result.append(item)
        return result
        ---
        return [item for inner in @0 for item in inner]
        """,
        lambda ls: [x for inner in ls for x in inner],
        [([[1, 2], [3], []],), ([],)],
    ),
    _t(
        "chunks|chunk|split_into_chunks",
        "items,size|values,n",
        "split @0 into lists of @1 items, the last one possibly shorter",
        """
        return [@0[i : i + @1] for i in range(0, len(@0), @1)]
        ---
        result = []
        for start in range(0, len(@0), @1):
            result.append(@0[start : start + @1])
        return result
        """,
        lambda xs, n: [xs[i : i + n] for i in range(0, len(xs), n)],
        [([1, 2, 3, 4, 5], 2), ([], 3)],
    ),
    _t(
        "merge_sorted",
        "a,b|left,right|first,second",
        "merge the sorted lists @0 and @1 into one sorted list",
        """
        result = []
        i = j = 0
        while i < len(@0) and j < len(@1):
            if @0[i] <= @1[j]:
                result.append(@0[i])
                i += 1
            else:
                result.append(@1[j])
                j += 1
        result.extend(@0[i:])
        result.extend(@1[j:])
        return result
        ---
        return sorted(@0 + @1)
        """,
        _merge,
        [([1, 4, 6], [2, 3, 7]), ([], [1])],
    ),
    _t(
        "binary_search",
        "items,target|values,value",
        "return the index of @1 in the sorted list @0, or -1 if it is not there",
        """
        low, high = 0, len(@0) - 1
        while low <= high:
            middle = (low + high) // 2
            if @0[middle] == @1:
                return middle
            if @0[middle] < @1:
                low = middle + 1
            else:
                high = middle - 1
        return -1
        """,
        lambda xs, t: xs.index(t) if t in xs else -1,
        [([1, 3, 5, 7, 9], 7), ([1, 3, 5], 4), ([], 1)],
    ),
    _t(
        "insertion_sort|sort_list",
        "items|values",
        "return a sorted copy of @0",
        """
        result = list(@0)
        for i in range(1, len(result)):
            key = result[i]
            j = i - 1
            while j >= 0 and result[j] > key:
                result[j + 1] = result[j]
                j -= 1
            result[j + 1] = key
        return result
        ---
        return sorted(@0)
        """,
        sorted,
        [([3, 1, 2],), ([],), ([5, 5, 1],)],
    ),
    _t(
        "rotate|rotate_left",
        "items,k|values,steps",
        "rotate @0 left by @1 positions",
        """
        if not @0:
            return []
        @1 %= len(@0)
        return @0[@1:] + @0[:@1]
        """,
        lambda xs, k: xs[k % len(xs) :] + xs[: k % len(xs)] if xs else [],
        [([1, 2, 3, 4], 1), ([1, 2, 3], 5), ([], 2)],
    ),
    _t(
        "second_largest",
        "numbers|values",
        "return the second largest distinct number in @0, or None if there is none",
        """
        distinct = sorted(set(@0))
        if len(distinct) < 2:
            return None
        return distinct[-2]
        """,
        lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None,
        [([3, 1, 4, 4],), ([5, 9, 7],), ([2, 2],)],
    ),
    _t(
        "pairwise_differences|differences",
        "numbers|values",
        "return the differences between neighbouring numbers of @0",
        """
        return [b - a for a, b in zip(@0, @0[1:])]
        ---
        result = []
        for i in range(1, len(@0)):
            result.append(@0[i] - @0[i - 1])
        return result
        """,
        lambda xs: [b - a for a, b in zip(xs, xs[1:])],
        [([1, 4, 9, 16],), ([5],)],
    ),
    _t(
        "frequencies|count_items|histogram",
        "items|values|words",
        "return a dict mapping each item of @0 to how many times it occurs",
        """
        counts = {}
        for item in @0:
            counts[item] = counts.get(item, 0) + 1
        return counts
        ---
        counts = {}
        for item in @0:
            if item in counts:
                counts[item] += 1
            else:
                counts[item] = 1
        return counts
        """,
        lambda xs: {x: xs.count(x) for x in xs},
        [(["a", "b", "a"],), ([],)],
    ),
    # ---------------------------------------------------------------- strings
    _t(
        "reverse_string|reverse",
        "s|text|word",
        "return @0 with its characters in reverse order",
        """
        return @0[::-1]
        ---
        result = ""
        for char in @0:
            result = char + result
        return result
        """,
        lambda s: s[::-1],
        [("hello",), ("",)],
    ),
    _t(
        "is_palindrome",
        "s|text|word",
        "return True if @0 reads the same forwards and backwards",
        """
        return @0 == @0[::-1]
        ---
        left, right = 0, len(@0) - 1
        while left < right:
            if @0[left] != @0[right]:
                return False
            left += 1
            right -= 1
        return True
        """,
        lambda s: s == s[::-1],
        [("level",), ("hello",), ("",)],
    ),
    _t(
        "count_vowels",
        "s|text|word",
        "return the number of vowels in @0",
        """
        return sum(1 for char in @0.lower() if char in "aeiou")
        ---
        count = 0
        for char in @0.lower():
            if char in "aeiou":
                count += 1
        return count
        """,
        lambda s: sum(1 for c in s.lower() if c in "aeiou"),
        [("Hello World",), ("xyz",)],
    ),
    _t(
        "count_words|word_count",
        "s|text|sentence",
        "return the number of words in @0",
        """
        return len(@0.split())
        """,
        lambda s: len(s.split()),
        [("the quick brown fox",), ("",), ("  one  ",)],
    ),
    _t(
        "capitalize_words|title_case",
        "s|text|sentence",
        "return @0 with the first letter of every word in upper case",
        """
        return " ".join(word.capitalize() for word in @0.split())
        """,
        lambda s: " ".join(w.capitalize() for w in s.split()),
        [("hello world",), ("",)],
    ),
    _t(
        "remove_spaces|strip_spaces",
        "s|text",
        "return @0 without its space characters",
        """
        return @0.replace(" ", "")
        ---
        return "".join(char for char in @0 if char != " ")
        """,
        lambda s: s.replace(" ", ""),
        [("a b  c",), ("",)],
    ),
    _t(
        "is_anagram|are_anagrams",
        "a,b|first,second|s1,s2",
        "return True if @0 and @1 have the same letters in any order",
        """
        return sorted(@0) == sorted(@1)
        """,
        lambda a, b: sorted(a) == sorted(b),
        [("listen", "silent"), ("abc", "abd")],
    ),
    _t(
        "longest_word",
        "s|text|sentence",
        "return the longest word of @0, the first one if several are as long",
        """
        best = ""
        for word in @0.split():
            if len(word) > len(best):
                best = word
        return best
        ---
        return max(@0.split(), key=len, default="")
        """,
        lambda s: max(s.split(), key=len, default=""),
        [("a quick brown fox",), ("",)],
    ),
    _t(
        "count_char|count_letter",
        "s,char|text,letter",
        "return how many times @1 occurs in @0",
        """
        count = 0
        for c in @0:
            if c == @1:
                count += 1
        return count
        ---
        return @0.count(@1)
        """,
        lambda s, c: s.count(c),
        [("banana", "a"), ("", "x")],
    ),
    _t(
        "acronym",
        "s|text|phrase",
        "return the upper-case first letters of the words of @0",
        """
        return "".join(word[0].upper() for word in @0.split())
        """,
        lambda s: "".join(w[0].upper() for w in s.split()),
        [("portable network graphics",), ("",)],
    ),
    _t(
        "truncate|shorten",
        "s,width|text,limit",
        'return @0 cut to at most @1 characters, ending with "..." if it was cut',
        """
        if len(@0) <= @1:
            return @0
        return @0[: @1 - 3] + "..."
        """,
        lambda s, w: s if len(s) <= w else s[: w - 3] + "...",
        [("hello world", 8), ("hi", 5)],
    ),
    _t(
        "is_blank",
        "s|text|line",
        "return True if @0 is empty or holds only whitespace",
        """
        return @0.strip() == ""
        ---
        return not @0.strip()
        """,
        lambda s: not s.strip(),
        [("   ",), ("a",), ("",)],
    ),
    _t(
        "snake_to_camel|to_camel_case",
        "name|s|text",
        "convert the snake_case name @0 to camelCase",
        """
        head, *rest = @0.split("_")
        return head + "".join(word.capitalize() for word in rest)
        """,
        _camel,
        [("hello_big_world",), ("name",)],
    ),
    _t(
        "is_digits|is_number_string",
        "s|text",
        "return True if @0 is non-empty and made only of decimal digits",
        """
        if not @0:
            return False
        for char in @0:
            if char not in "0123456789":
                return False
        return True
        """,
        lambda s: bool(s) and all(c in "0123456789" for c in s),
        [("12345",), ("12a",), ("",)],
    ),
    _t(
        "first_unique_char|first_non_repeating",
        "s|text",
        "return the first character of @0 that occurs only once, or None",
        """
        for char in @0:
            if @0.count(char) == 1:
                return char
        return None
        ---
        counts = {}
        for char in @0:
            counts[char] = counts.get(char, 0) + 1
        for char in @0:
            if counts[char] == 1:
                return char
        return None
        """,
        _first_unique,
        [("swiss",), ("level",), ("aabb",)],
    ),
    _t(
        "repeat_string|repeat",
        "s,times|text,n",
        "return @0 repeated @1 times",
        """
        return @0 * @1
        ---
        result = ""
        for _ in range(@1):
            result += @0
        return result
        """,
        lambda s, n: s * n,
        [("ab", 3), ("x", 0)],
    ),
    _t(
        "starts_with_vowel",
        "word|s",
        "return True if @0 begins with a vowel",
        """
        return @0[:1].lower() in ("a", "e", "i", "o", "u")
        """,
        lambda s: s[:1].lower() in ("a", "e", "i", "o", "u"),
        [("apple",), ("pear",), ("",)],
    ),
    # ------------------------------------------------------------------ dicts
    _t(
        "invert_dict|invert",
        "mapping|d",
        "return a dict mapping each value of @0 to its key",
        """
        return {value: key for key, value in @0.items()}
        """,
        lambda d: {v: k for k, v in d.items()},
        [({"a": 1, "b": 2},), ({},)],
    ),
    _t(
        "merge_dicts",
        "a,b|first,second",
        "return a new dict with the items of @0 and @1, @1 winning on equal keys",
        """
        result = dict(@0)
        result.update(@1)
        return result
        ---
        return {**@0, **@1}
        """,
        lambda a, b: {**a, **b},
        [({"x": 1}, {"y": 2}), ({"x": 1}, {"x": 3})],
    ),
    _t(
        "keys_by_value|sort_keys_by_value",
        "mapping|d|scores",
        "return the keys of @0 sorted by their values",
        """
        return sorted(@0, key=@0.get)
        """,
        lambda d: sorted(d, key=d.get),
        [({"a": 3, "b": 1, "c": 2},), ({},)],
    ),
)


def _sub(text: str, names: tuple[str, ...]) -> str:
    for i, name in enumerate(names):
        text = text.replace(f"@{i}", name)
    return text


def render(
    task: Task, name: str, args: tuple[str, ...], say: str, body: str, examples: bool
) -> tuple[str, str, str, str]:
    """One variant: its source, the same without the docstring, and its description in
    the imperative and the third person."""
    base = _sub(say, args)
    verb, _, rest = base.partition(" ")
    third = f"{tiny_chat._inflect(verb)} {rest}"
    doc = base[0].upper() + base[1:] + "."
    if examples:
        shown = [
            f"    >>> {name}({', '.join(map(repr, sample))})\n    {task.ref(*sample)!r}"
            for sample in task.samples
            if task.ref(*sample) is not None  # doctest shows no None
        ][:2]
        doc += "\n\n" + "\n".join(shown) + "\n    "
    # A recursive body calls the task's first name: call the chosen one instead.
    body = _sub(body, args).replace(f"{task.names[0]}(", f"{name}(")
    head = f"def {name}({', '.join(args)}):"
    code = [head] + ["    " + line for line in body.split("\n")]
    source = "\n".join([head, f'    """{doc}"""', *code[1:]])
    return source, "\n".join(code), base, third


def variants(task: Task, rng: random.Random, count: int) -> list[tuple[str, str, str, str, str]]:
    """`count` random variants of a task: (source, source without docstring, signature,
    imperative, third person)."""
    out = []
    for _ in range(count):
        name, args = rng.choice(task.names), rng.choice(task.args)
        say, body = rng.choice(task.says), rng.choice(task.bodies)
        source, code, base, third = render(task, name, args, say, body, rng.random() < 0.3)
        out.append((source, code, f"{name}({', '.join(args)})", base, third))
    return out


def conversations(seed: int = 0, per_task: int = 60) -> list[list[tiny_chat.Message]]:
    """`per_task` exchanges for every task: write requests answered with the function in
    a python fence and, one in four, "what does this do" over it without its docstring."""
    rng = random.Random(f"synth-chat-{seed}")
    out = []
    for task in TASKS:
        for source, code, signature, base, third in variants(task, rng, per_task):
            if rng.random() < 0.25:
                request = rng.choice(tiny_chat.EXPLAIN).format(code=code)
                answer = f"It {third}." if rng.random() < 0.5 else f"{base[0].upper()}{base[1:]}."
            else:
                unnamed = rng.random() < 0.2
                template = rng.choice(tiny_chat.WRITE_UNNAMED if unnamed else tiny_chat.WRITE_NAMED)
                request = template.format(sig=signature, base=base, third=third)
                answer = f"```python\n{source}\n```"
            out.append(
                [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
            )
    return out


def documents(seed: int = 0, count: int = 3000) -> dict[str, str]:
    """`count` small modules of three to eight functions of random tasks."""
    rng = random.Random(f"synth-docs-{seed}")
    docs = {}
    for i in range(count):
        tasks = rng.sample(TASKS, rng.randint(3, 8))
        sources = [variants(task, rng, 1)[0][0] for task in tasks]
        docs[f"synthetic/functions_{i:05d}.py"] = "\n\n\n".join(sources) + "\n"
    return docs
