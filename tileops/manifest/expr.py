"""A small, closed expression language for manifest rules.

Rules in manifests (``head_dim % 2 == 0``, ``rotary_dim <= head_dim``) are parsed here into a tree
and evaluated against a dict of names. Nothing is ever handed to Python's ``eval``: the grammar has
literals, names, arithmetic, comparisons, ``and``/``or``/``not``, parentheses and a fixed set of
functions. Anything else (attribute access, indexing, lambdas, imports) fails to parse.

Grammar (lowest precedence first)::

    expr    := or
    or      := and ("or" and)*
    and     := not ("and" not)*
    not     := "not" not | cmp
    cmp     := sum (("=="|"!="|"<"|"<="|">"|">=") sum)*      # chained, as in Python
    sum     := prod (("+"|"-") prod)*
    prod    := unary (("*"|"/"|"//"|"%") unary)*
    unary   := "-" unary | power
    power   := atom ("**" unary)?
    atom    := NUMBER | STRING | NAME | "none" | "true" | "false" | FUNC "(" expr ("," expr)* ")" | "(" expr ")"
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Expr", "ExprError", "parse_expr", "FUNCTIONS"]


class ExprError(ValueError):
    """A rule that does not parse, names something unknown, or cannot be evaluated."""


def _finite(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in xs)


#: The only functions a rule may call.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "isfinite": _finite,
    "abs": abs,
    "min": min,
    "max": max,
    "log2": math.log2,
    "is_pow2": lambda n: isinstance(n, int) and n > 0 and n & (n - 1) == 0,
}

_KEYWORDS = {"and", "or", "not", "none", "true", "false"}
_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\.\d+(?:[eE][+-]?\d+)?|\d+)"
    r"|(?P<str>'[^'\\]*'|\"[^\"\\]*\")"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<op>\*\*|//|==|!=|<=|>=|[-+*/%<>(),]))"
)
_CMP: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


def _div(a: Any, b: Any) -> Any:
    if b == 0:
        raise ExprError("division by zero")
    return a / b


def _floordiv(a: Any, b: Any) -> Any:
    if b == 0:
        raise ExprError("division by zero")
    return a // b


def _mod(a: Any, b: Any) -> Any:
    if b == 0:
        raise ExprError("modulo by zero")
    return a % b


def _pow(a: Any, b: Any) -> Any:
    # Rules are small arithmetic: an exponent past 64 only serves to make `9 ** 9 ** 9` compute a
    # 370-million-digit integer, so it is refused.
    if abs(b) > 64 and a not in (0, 1, -1):
        raise ExprError(f"exponent {b!r} is too large (at most 64)")
    return a**b


#: integers past this many bits are refused: every operand stays cheap (nested `** 64` would
#: otherwise build a 2**30-bit integer)
MAX_INT_BITS = 4096


def _number(x: Any, what: str) -> Any:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ExprError(f"{what}: arithmetic needs numbers, got {x!r}")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ExprError(f"{what}: integer too large (over {MAX_INT_BITS} bits)")
    return x


_ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul,
    "/": _div, "//": _floordiv, "%": _mod, "**": _pow,
}


@dataclass(frozen=True)
class Expr:
    """A parsed rule: evaluate it with :meth:`evaluate`, list its names with :attr:`names`."""

    text: str
    tree: tuple
    names: frozenset[str]

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        return _eval(self.tree, env)

    def __str__(self) -> str:
        return self.text


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ExprError(f"unexpected character {text[pos:].lstrip()[:1]!r} at column {pos + 1}")
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    tokens.append(("end", ""))
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokenize(text)
        self.i = 0
        self.names: set[str] = set()

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i]

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.tokens[self.i]
        if value is not None and tok[1] != value:
            got = tok[1] or "end of rule"
            raise ExprError(f"expected {value!r}, found {got!r}")
        self.i += 1
        return tok

    def at(self, *values: str) -> bool:
        kind, value = self.peek()
        return kind in ("op", "name") and value in values

    def parse(self) -> tuple:
        tree = self.or_()
        if self.peek()[0] != "end":
            raise ExprError(f"unexpected {self.peek()[1]!r} after a complete expression")
        return tree

    def or_(self) -> tuple:
        node = self.and_()
        while self.at("or"):
            self.take()
            node = ("or", node, self.and_())
        return node

    def and_(self) -> tuple:
        node = self.not_()
        while self.at("and"):
            self.take()
            node = ("and", node, self.not_())
        return node

    def not_(self) -> tuple:
        if self.at("not"):
            self.take()
            return ("not", self.not_())
        return self.cmp()

    def cmp(self) -> tuple:
        first = self.sum()
        ops, rest = [], []
        while self.at(*_CMP):
            ops.append(self.take()[1])
            rest.append(self.sum())
        if not ops:
            return first
        return ("cmp", first, tuple(ops), tuple(rest))

    def sum(self) -> tuple:
        node = self.prod()
        while self.at("+", "-"):
            op = self.take()[1]
            node = ("bin", op, node, self.prod())
        return node

    def prod(self) -> tuple:
        node = self.unary()
        while self.at("*", "/", "//", "%"):
            op = self.take()[1]
            node = ("bin", op, node, self.unary())
        return node

    def unary(self) -> tuple:
        if self.at("-"):
            self.take()
            return ("neg", self.unary())
        return self.power()

    def power(self) -> tuple:
        node = self.atom()
        if self.at("**"):
            self.take()
            node = ("bin", "**", node, self.unary())
        return node

    def atom(self) -> tuple:
        kind, value = self.take()
        if kind == "num":
            if len(value) > MAX_LITERAL_CHARS:
                raise ExprError(f"number literal too long ({len(value)} characters; at most {MAX_LITERAL_CHARS})")
            return ("lit", float(value) if any(c in value for c in ".eE") else int(value))
        if kind == "str":
            return ("lit", value[1:-1])
        if kind == "op" and value == "(":
            node = self.or_()
            self.take(")")
            return node
        if kind == "name":
            if value in ("none", "None"):
                return ("lit", None)
            if value in ("true", "True"):
                return ("lit", True)
            if value in ("false", "False"):
                return ("lit", False)
            if value in _KEYWORDS:
                raise ExprError(f"unexpected keyword {value!r}")
            if self.at("("):
                if value not in FUNCTIONS:
                    raise ExprError(f"unknown function {value!r}; known: {', '.join(sorted(FUNCTIONS))}")
                self.take("(")
                args = [self.or_()]
                while self.at(","):
                    self.take()
                    args.append(self.or_())
                self.take(")")
                return ("call", value, tuple(args))
            self.names.add(value)
            return ("name", value)
        raise ExprError(f"unexpected {value or 'end of rule'!r}")


#: a rule is data from a file: bounded in length, nesting and literal size before it is parsed
MAX_RULE_CHARS = 2000
MAX_NESTING = 32
MAX_LITERAL_CHARS = 100


def parse_expr(text: str) -> Expr:
    """Parse ``text`` into an :class:`Expr`; raises :class:`ExprError` naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ExprError("a rule must be a non-empty string")
    if len(text) > MAX_RULE_CHARS:
        raise ExprError(f"rule too long ({len(text)} characters; at most {MAX_RULE_CHARS})")
    depth = deepest = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise ExprError(f"parentheses nested {deepest} deep; at most {MAX_NESTING}")
    p = _Parser(text)
    tree = p.parse()
    return Expr(text.strip(), tree, frozenset(p.names))


def _eval(node: tuple, env: Mapping[str, Any]) -> Any:
    tag = node[0]
    if tag == "lit":
        return node[1]
    if tag == "name":
        try:
            return env[node[1]]
        except KeyError:
            raise ExprError(f"unknown name {node[1]!r}") from None
    if tag == "and":
        return bool(_eval(node[1], env)) and bool(_eval(node[2], env))
    if tag == "or":
        return bool(_eval(node[1], env)) or bool(_eval(node[2], env))
    if tag == "not":
        return not _eval(node[1], env)
    if tag == "neg":
        return -_number(_eval(node[1], env), "-")
    if tag == "bin":
        op = node[1]
        a, b = _number(_eval(node[2], env), op), _number(_eval(node[3], env), op)
        try:
            return _number(_ARITH[op](a, b), op)
        except (TypeError, OverflowError, ValueError) as e:
            raise ExprError(f"cannot compute {a!r} {op} {b!r}: {e}") from e
    if tag == "cmp":
        left = _eval(node[1], env)
        for op, rhs in zip(node[2], node[3]):
            right = _eval(rhs, env)
            try:
                if not _CMP[op](left, right):
                    return False
            except TypeError:
                if op in ("==", "!="):
                    return op == "!="
                raise ExprError(f"cannot compare {left!r} {op} {right!r}") from None
            left = right
        return True
    if tag == "call":
        args = [_eval(a, env) for a in node[2]]
        try:
            return FUNCTIONS[node[1]](*args)
        except (TypeError, ValueError, OverflowError) as e:
            raise ExprError(f"{node[1]}({', '.join(map(repr, args))}) failed: {e}") from e
    raise ExprError(f"bad node {tag!r}")  # pragma: no cover - the parser makes no other nodes
