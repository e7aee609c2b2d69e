"""The `calculate_output` formula of the `multi` grader: a small arithmetic language, parsed here
and evaluated here, never by Python's eval.

Grammar (precedence from loosest to tightest):

    formula := sum
    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/") unary)*
    unary   := ("-" | "+") unary | power
    power   := atom ("^" unary)?              right-associative: 2^3^2 = 2^(3^2)
    atom    := NUMBER | NAME | FUNCTION "(" sum ("," sum)* ")" | "(" sum ")"

so `-2^2` is -(2^2) = -4 and `2^-1` is 0.5, as in mathematics. NAME is a sub-grader's key in
`graders`; FUNCTION is one of min, max (one or more arguments), abs, floor, ceil, exp, sqrt,
log (natural logarithm; one argument each). Positions in messages count characters from 1.

The parser is a Pratt parser over a regex tokenizer. Nesting is capped so that a hostile
formula cannot exhaust the Python stack of the process that grades it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

MAX_DEPTH = 64  # parentheses, signs and `^` nested in one another
MAX_HEIGHT = 256  # of the syntax tree, which also grows with a long `1 + 1 + ...` chain
# name -> (implementation, number of arguments; None = one or more)
FUNCTIONS: dict[str, tuple[Callable[..., float], int | None]] = {
    "min": (lambda *args: min(args), None), "max": (lambda *args: max(args), None),
    "abs": (abs, 1), "floor": (math.floor, 1), "ceil": (math.ceil, 1),
    "exp": (math.exp, 1), "sqrt": (math.sqrt, 1), "log": (math.log, 1),
}
_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>[-+*/^(),]))"
)
# Binding powers of the infix operators; `^` binds tighter than a prefix sign.
_INFIX = {"+": 10, "-": 10, "*": 20, "/": 20, "^": 40}
_PREFIX_POWER = 30


class FormulaError(ValueError):
    """The formula does not parse; `position` is the 1-based character where it went wrong."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


class FormulaMathError(ArithmeticError):
    """The formula parsed but its value is undefined (division by zero, log of 0, overflow...)."""


@dataclass(frozen=True)
class Token:
    kind: str  # "number", "name", "op" or "end"
    text: str
    position: int


@dataclass(frozen=True)
class Number:
    value: float
    position: int
    height: int = 1


@dataclass(frozen=True)
class Name:
    name: str
    position: int
    height: int = 1


@dataclass(frozen=True)
class Unary:
    op: str
    operand: Node
    position: int
    height: int = 1


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node
    position: int
    height: int = 1


@dataclass(frozen=True)
class Call:
    function: str
    args: tuple[Node, ...]
    position: int
    height: int = 1


Node = Number | Name | Unary | Binary | Call


def tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.lastgroup is None:
            if text[pos:].strip() == "":
                break
            bad = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise FormulaError(f"unexpected character {text[bad]!r} at position {bad + 1}", bad + 1)
        kind = match.lastgroup
        tokens.append(Token(kind, match.group(kind), match.start(kind) + 1))
        pos = match.end()
    tokens.append(Token("end", "", len(text) + 1))
    return tokens


class _Parser:
    def __init__(self, text: str, names: Collection[str]) -> None:
        self.tokens = tokenize(text)
        self.index = 0
        self.names = set(names)
        self.depth = 0

    @property
    def current(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.current
        self.index += 1
        return token

    def fail(self, token: Token, message: str | None = None) -> FormulaError:
        what = "end of formula" if token.kind == "end" else repr(token.text)
        return FormulaError(message or f"unexpected {what} at position {token.position}", token.position)

    def expect(self, op: str, opener: Token) -> None:
        if self.current.text == op and self.current.kind == "op":
            self.advance()
            return
        if self.current.kind == "end":
            raise self.fail(self.current, f"missing ')' for the '(' at position {opener.position}")
        raise self.fail(self.current, f"expected ')' at position {self.current.position}, found {self.current.text!r}")

    def expression(self, min_power: int = 0) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            where = self.current.position
            raise self.fail(self.current, f"formula nested more than {MAX_DEPTH} levels deep at position {where}")
        node = self.prefix()
        while self.current.kind == "op" and _INFIX.get(self.current.text, -1) > min_power:
            op = self.advance()
            # `^` is right-associative: its right side may hold another `^` (and a sign).
            right = self.expression(_INFIX[op.text] - 1 if op.text == "^" else _INFIX[op.text])
            node = self.checked(Binary(op.text, node, right, op.position, 1 + max(node.height, right.height)))
        self.depth -= 1
        return node

    def prefix(self) -> Node:
        token = self.advance()
        if token.kind == "number":
            return Number(float(token.text), token.position)
        if token.kind == "name":
            return self.name_or_call(token)
        if token.text in ("-", "+"):
            operand = self.expression(_PREFIX_POWER)
            return self.checked(Unary(token.text, operand, token.position, 1 + operand.height))
        if token.text == "(":
            inner = self.expression()
            self.expect(")", token)
            return inner
        if token.text == "*" and self.tokens[self.index - 2].text == "*":
            raise self.fail(token, f"unexpected '*' at position {token.position}: powers are written a ^ b")
        raise self.fail(token)

    def checked(self, node: Node) -> Node:
        # Evaluation recurses over the tree: a tree this tall would exhaust the Python stack.
        if node.height > MAX_HEIGHT:
            raise self.fail(self.current, f"formula is too long: more than {MAX_HEIGHT} operations in a chain")
        return node

    def name_or_call(self, token: Token) -> Node:
        if self.current.text == "(" and self.current.kind == "op":
            return self.call(token)
        if token.text in self.names:
            return Name(token.text, token.position)
        if token.text in FUNCTIONS:
            raise self.fail(
                token, f"{token.text} at position {token.position} is a function: call it as {token.text}(...)"
            )
        raise self.fail(
            token, f"unknown name {token.text!r} at position {token.position}; the graders are {sorted(self.names)}"
        )

    def call(self, token: Token) -> Node:
        if token.text not in FUNCTIONS:
            raise self.fail(
                token,
                f"unknown function {token.text!r} at position {token.position}; functions are {', '.join(FUNCTIONS)}",
            )
        opener = self.advance()
        args = [self.expression()]
        while self.current.text == "," and self.current.kind == "op":
            self.advance()
            args.append(self.expression())
        self.expect(")", opener)
        arity = FUNCTIONS[token.text][1]
        if arity is not None and len(args) != arity:
            raise self.fail(
                token, f"{token.text} takes {arity} argument, got {len(args)} (position {token.position})"
            )
        return self.checked(Call(token.text, tuple(args), token.position, 1 + max(a.height for a in args)))


def parse_formula(text: str, names: Collection[str]) -> Node:
    """The formula's syntax tree; names must be among `names`. Raises FormulaError."""
    parser = _Parser(text, names)
    if parser.current.kind == "end":
        raise FormulaError("the formula is empty", 1)
    node = parser.expression()
    if parser.current.kind != "end":
        raise parser.fail(parser.current)
    return node


def evaluate(node: Node, values: Mapping[str, float]) -> float:
    """The formula's value with each name bound to `values[name]`. Raises FormulaMathError."""
    result = _value(node, values)
    if not math.isfinite(result):
        raise FormulaMathError(f"calculate_output evaluates to {result}, not a finite number")
    return result


def _value(node: Node, values: Mapping[str, float]) -> float:
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Name):
        return float(values[node.name])
    if isinstance(node, Unary):
        operand = _value(node.operand, values)
        return -operand if node.op == "-" else operand
    if isinstance(node, Binary):
        return _binary(node, _value(node.left, values), _value(node.right, values))
    args = [_value(arg, values) for arg in node.args]
    try:
        return float(FUNCTIONS[node.function][0](*args))
    except (ValueError, OverflowError) as exc:
        shown = ", ".join(f"{a:g}" for a in args)
        raise FormulaMathError(f"{node.function}({shown}) at position {node.position} is undefined: {exc}") from None


def _binary(node: Binary, left: float, right: float) -> float:
    if node.op == "+":
        return left + right
    if node.op == "-":
        return left - right
    if node.op == "*":
        return left * right
    if node.op == "/":
        if right == 0:
            raise FormulaMathError(f"division by zero at position {node.position}")
        return left / right
    try:  # math.pow, not **: a negative base with a fractional exponent raises instead of going complex
        return math.pow(left, right)
    except (ValueError, OverflowError, ZeroDivisionError) as exc:
        raise FormulaMathError(f"{left:g} ^ {right:g} at position {node.position} is undefined: {exc}") from None
