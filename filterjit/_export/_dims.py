"""Symbolic dimensions as JAX writes them (`2*b + 1`, `b^2`, `floordiv(b, 2)`): read
within fixed limits, so that a payload's shapes are bounded before JAX parses them,
and evaluated for a call's sizes. Nothing here runs Python's parser: a dimension
may be named by any identifier JAX accepts (`in`, `None`, `lambda`)."""

import functools
import operator
import re
from collections.abc import Callable
from typing import Any


MAX_TEXT = 1000
"""The longest dimension a payload may hold, in characters."""
MAX_NESTING = 8
"""How deeply `floordiv`, `mod`, `max` and `min` may nest in one dimension."""
MAX_POWER = 8
"""The largest power of a factor (`b^8`)."""
MAX_TERMS = 256
"""The most terms one dimension may expand to while JAX reads it (the product of
sums that `max` and `min` can simplify to, raised to their powers)."""
MAX_INTEGER = 2**63 - 1
"""The largest integer in a dimension: sizes are 64-bit."""

FUNCTIONS: dict[str, Callable[[int, int], int]] = {
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "max": max,
    "min": min,
}

# A dimension as a tree of tuples: `("int", value)`, `("name", name)`,
# `("sum", ((sign, term), ...))`, `("product", (factor, ...))`,
# `("power", factor, exponent)`, `("call", function, left, right)`.
Dimension = tuple[Any, ...]

_TOKEN = re.compile(r"\s*(?:(0|[1-9][0-9]*)|([^\W\d]\w*)|([-+*^(),]))")


class DimensionError(ValueError):
    """A dimension's text that is not one JAX writes, or beyond the limits."""


def _tokens(text: str) -> list[str]:
    if len(text) > MAX_TEXT:
        raise DimensionError(f"longer than {MAX_TEXT} characters")
    tokens, position = [], 0
    while position < len(text.rstrip()):
        match = _TOKEN.match(text, position)
        if match is None:
            raise DimensionError(f"an unexpected character at {position}")
        token = match.group(match.lastindex or 0)
        if match.lastindex == 2 and (not token.isidentifier() or token == "_"):
            raise DimensionError(f"{token!r} is not a dimension's name")
        tokens.append(token)
        position = match.end()
    return tokens


class _Reader:
    """A recursive-descent reader of JAX's grammar of dimensions; its depth is
    bounded by `MAX_NESTING`."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.position = 0

    def peek(self) -> str:
        return self.tokens[self.position] if self.position < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token == "" or (expected is not None and token != expected):
            raise DimensionError(f"expected {expected or 'more'} at token {token!r}")
        self.position += 1
        return token

    def sum(self, depth: int) -> Dimension:
        terms = []
        sign = -1 if self.peek() == "-" else 1
        if self.peek() in ("-", "+"):
            self.take()
        while True:
            terms.append((sign, self.product(depth)))
            if self.peek() not in ("-", "+"):
                return ("sum", tuple(terms))
            sign = -1 if self.take() == "-" else 1

    def product(self, depth: int) -> Dimension:
        factors = []
        while True:
            factor = self.factor(depth)
            if self.peek() == "^":
                self.take()
                power = self.integer()
                if not 1 <= power <= MAX_POWER:
                    raise DimensionError(f"a power {power}, not 1 to {MAX_POWER}")
                factor = ("power", factor, power)
            factors.append(factor)
            if self.peek() != "*":
                return ("product", tuple(factors))
            self.take()

    def integer(self) -> int:
        token = self.take()
        if not token.isdigit() or len(token) > 19 or int(token) > MAX_INTEGER:
            raise DimensionError(f"{token!r} is not an integer of 64 bits")
        return int(token)

    def factor(self, depth: int) -> Dimension:
        token = self.peek()
        if token == "-":
            self.take()
            return ("int", -self.integer())
        if token.isdigit():
            return ("int", self.integer())
        if token in FUNCTIONS:
            if depth >= MAX_NESTING:
                raise DimensionError(f"nested deeper than {MAX_NESTING}")
            self.take()
            self.take("(")
            left = self.sum(depth + 1)
            self.take(",")
            right = self.sum(depth + 1)
            self.take(")")
            return ("call", token, left, right)
        if token and token.isidentifier():
            return ("name", self.take())
        raise DimensionError(f"expected a name or an integer at {token!r}")


def _terms(tree: Dimension) -> int:
    """How many terms `tree` may expand to when JAX reads it, capped just past
    `MAX_TERMS`."""
    kind = tree[0]
    if kind in ("int", "name"):
        return 1
    if kind == "call":
        return min(_terms(tree[2]) + _terms(tree[3]), MAX_TERMS + 1)
    if kind == "power":
        base, count = _terms(tree[1]), 1
        for _ in range(tree[2]):
            count = min(count * base, MAX_TERMS + 1)
        return count
    if kind == "product":
        count = 1
        for factor in tree[1]:
            count = min(count * _terms(factor), MAX_TERMS + 1)
        return count
    return min(sum(_terms(term) for _, term in tree[1]), MAX_TERMS + 1)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Dimension:
    """The tree of one dimension as JAX writes it; raises `DimensionError` for any
    other text, or one beyond the limits above. Takes time linear in `text`."""
    reader = _Reader(_tokens(text))
    tree = reader.sum(0)
    if reader.position != len(reader.tokens):
        raise DimensionError(f"unexpected {reader.peek()!r}")
    if _terms(tree) > MAX_TERMS:
        raise DimensionError(f"it expands to more than {MAX_TERMS} terms")
    return tree


def names(tree: Dimension) -> set[str]:
    """The dimensions' names in `tree`."""
    kind = tree[0]
    if kind == "name":
        return {tree[1]}
    if kind == "int":
        return set()
    if kind == "power":
        return names(tree[1])
    if kind == "call":
        return names(tree[2]) | names(tree[3])
    parts = tree[1] if kind == "product" else [term for _, term in tree[1]]
    return set().union(*map(names, parts))


def evaluate(tree: Dimension, env: dict[str, int]) -> int:
    """The value of `tree`, its dimensions' values in `env`. Raises `KeyError` for a
    dimension not in `env`, `ZeroDivisionError` for a division by zero."""
    kind = tree[0]
    if kind == "int":
        return tree[1]
    if kind == "name":
        return env[tree[1]]
    if kind == "power":
        return evaluate(tree[1], env) ** tree[2]
    if kind == "call":
        return FUNCTIONS[tree[1]](evaluate(tree[2], env), evaluate(tree[3], env))
    if kind == "product":
        return functools.reduce(
            operator.mul, (evaluate(factor, env) for factor in tree[1]), 1
        )
    return sum(sign * evaluate(term, env) for sign, term in tree[1])
