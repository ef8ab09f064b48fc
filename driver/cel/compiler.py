"""Compile a CEL expression into Python closures, evaluated without re-parsing.

Parsing is cel-python's (its Lark grammar of the CEL spec); evaluation is ours.
celpy's own evaluator walks the parse tree on every evaluation (about a millisecond
per device) and lacks the Kubernetes libraries, so each tree node becomes one closure
instead, with constant sub-expressions (``quantity("40Gi")``, ``semver("8.0.0")``)
computed once and field paths of the input (``device.attributes["d"].name``) fused
into one lookup.

Semantics are cel-go's, as kube-scheduler runs it: ``&&``/``||`` absorb errors when
the other side decides the result, ``has()`` tests map keys, the comprehension macros
(``all``, ``exists``, ``exists_one``, ``map``, ``filter``) and ``cel.bind`` scope their
variables, and ``.?field`` / ``[?key]`` select optionally. Unknown identifiers,
functions, fields of a declared variable and wrong argument counts are compile
errors, as the type checker makes them upstream; the rest fails at evaluation.

Why ~700 lines in one module: ``_Compiler`` is one recursive walk over the grammar,
and the literal and macro helpers below it exist only for that walk; split apart,
each half would be read with the other open beside it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from celpy.celparser import CELParseError, CELParser
from celpy.evaluation import celbytes, celstr

from drasil.driver.cel import functions as lib
from drasil.driver.cel import operators as ops
from drasil.driver.cel.values import (
    COST_KEY,
    INT64_MAX,
    INT64_MIN,
    UINT64_MAX,
    CelError,
    CostMeter,
    UInt,
    cel_equal,
    cel_order,
    no_overload,
    type_name,
)

Activation = dict[str, Any]
Eval = Callable[[Activation], Any]
# celpy's parse trees (lark.Tree / lark.Token); duck-typed so only celpy is imported.
Tree = Any
Fields = frozenset[str] | None
"""The fields a declared variable has (checked at compile time), or None for any."""


@dataclass(frozen=True, slots=True)
class Node:
    """A compiled sub-expression: its closure, its value if constant, its input path."""

    run: Eval
    constant: bool = False
    value: Any = None
    root: str | None = None
    path: tuple[str, ...] = ()
    fields: Fields = None


class CelCompileError(ValueError):
    """An expression that does not compile; the message points at the offending spot."""

    def __init__(self, detail: str, *, expression: str, line: int, column: int) -> None:
        self.detail = detail
        self.expression = expression
        self.line = line
        self.column = column
        super().__init__(self._render())

    def _render(self) -> str:
        # cel-go's issue format, which the API server prefixes with "compilation failed: ".
        lines = self.expression.splitlines() or [""]
        source = lines[min(self.line, len(lines)) - 1]
        caret = "." * max(self.column - 1, 0) + "^"
        return (
            f"compilation failed: ERROR: <input>:{self.line}:{self.column}: {self.detail}\n"
            f" | {source}\n | {caret}"
        )


MAX_NESTING = 500
"""Deepest nesting compiled, counted in operators and calls (not parentheses).

cel-go's parser stops at a recursion depth of 250, so everything the API server
accepts fits; beyond, the expression gets a compile error instead of exhausting
the stack.

The compiler and the compiled closures recurse a few Python frames per level of the
parse tree: the recursion limit ``drasil.api.limits.allow_nesting`` sets leaves room
for MAX_NESTING levels. Importing this module does not set it (that would change the
whole process for whoever imports it); every process that compiles selectors calls it
where it starts. Without it, expressions the API server accepts may fail as too deep.
"""


def compile_expression(source: str, *, variables: Mapping[str, Fields]) -> Node:
    """Compile ``source`` with ``variables`` declared; raises ``CelCompileError``."""
    text, optional_at = _mark_optional_syntax(source)
    try:
        tree = CELParser().parse(text)
    except CELParseError as err:
        raise _syntax_error(err, source) from None
    except RecursionError:
        raise _too_deep(source) from None
    _check_nesting(tree, source)
    try:
        return _Compiler(source, optional_at, variables).node(tree, frozenset())
    except RecursionError:
        # Nesting that _check_nesting does not count (brackets in brackets).
        raise _too_deep(source) from None


def _too_deep(source: str, meta: Any = None) -> CelCompileError:
    return CelCompileError(
        f"expression nests deeper than {MAX_NESTING} levels",
        expression=source,
        line=getattr(meta, "line", None) or 1,
        column=getattr(meta, "column", None) or 1,
    )


_FLAT = frozenset({"conditionalor", "conditionaland"})


def _check_nesting(tree: Tree, source: str) -> None:
    """Refuse trees deeper than MAX_NESTING, measured without recursing."""
    stack: list[tuple[Tree, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise _too_deep(source, getattr(node, "meta", None))
        children = getattr(node, "children", ())
        # Single-child pass-through nodes (a literal's ten grammar levels) do not nest
        # anything, and && / || chains are compiled flat (cel-go balances them).
        step = 0 if len(children) == 1 or getattr(node, "data", "") in _FLAT else 1
        stack.extend((child, depth + step) for child in children if not isinstance(child, str))


def _syntax_error(err: CELParseError, source: str) -> CelCompileError:
    detail = _syntax_detail(err)
    line, column = err.line or 1, err.column or 1
    if detail.endswith("end of expression"):
        lines = source.splitlines() or [""]
        line, column = len(lines), len(lines[-1]) + 1
    return CelCompileError(detail, expression=source, line=line, column=column)


def _syntax_detail(err: CELParseError) -> str:
    cause = err.__context__  # the Lark exception celpy re-raised
    token = getattr(cause, "token", None)
    if token is not None and getattr(token, "type", "") == "$END":
        return "Syntax error: unexpected end of expression"
    if token is not None:
        return f"Syntax error: unexpected {str(token)!r}"
    char = getattr(cause, "char", None)
    return f"Syntax error: unexpected character {char!r}" if char else "Syntax error"


# --- optional syntax ---------------------------------------------------------------
# celpy's grammar predates CEL's optional selection. ".?" and "[?" become ". " and
# "[ " (same length, so error positions still match the user's text) and the position
# of what follows is remembered, so the compiler knows which selections are optional.


def _mark_optional_syntax(source: str) -> tuple[str, frozenset[int]]:
    chars = list(source)
    marks: set[int] = set()
    for position in _code_positions(source):
        if source[position] in ".[" and source.startswith("?", position + 1):
            chars[position + 1] = " "
            after = position + 2
            while after < len(source) and source[after].isspace():
                after += 1
            marks.add(after)
    return "".join(chars), frozenset(marks)


def _code_positions(source: str) -> Iterator[int]:
    """Positions outside string literals and comments."""
    i = 0
    while i < len(source):
        char = source[i]
        if char in "'\"":
            i = _string_end(source, i)
        elif source.startswith("//", i):
            newline = source.find("\n", i)
            i = len(source) if newline < 0 else newline
        else:
            yield i
            i += 1


def _string_end(source: str, start: int) -> int:
    quote = source[start] * 3 if source.startswith(source[start] * 3, start) else source[start]
    i = start + len(quote)
    while i < len(source):
        if source[i] == "\\":
            i += 2
        elif source.startswith(quote, i):
            return i + len(quote)
        else:
            i += 1
    return i


# --- node helpers ------------------------------------------------------------------


def constant(value: Any) -> Node:
    return Node(lambda _activation: value, constant=True, value=value)


def _failing(error: CelError) -> Node:
    def run(_activation: Activation) -> Any:
        raise error

    return Node(run)


def apply(function: Callable[..., Any], args: list[Node]) -> Node:
    """``function(*args)`` at evaluation time, or now when every argument is constant."""
    if all(a.constant for a in args):
        try:
            return constant(function(*(a.value for a in args)))
        except CelError as err:
            return _failing(err)
    runs = [a.run for a in args]
    if len(runs) == 1:
        (first,) = runs
        return Node(lambda act: function(first(act)))
    if len(runs) == 2:
        first, second = runs
        return Node(lambda act: function(first(act), second(act)))
    return Node(lambda act: function(*[run(act) for run in runs]))


def _path(root: str, keys: tuple[str, ...]) -> Node:
    """``root.k1["k2"]…`` as one lookup; on any miss, the exact walk gives the error.

    Only string keys are fused: indexing a string or list with a string fails in
    Python too, so the fast path never returns what CEL would not.
    """

    def run(activation: Activation) -> Any:
        value = activation[root]
        try:
            for key in keys:
                value = value[key]
        except (KeyError, TypeError, IndexError):
            value = activation[root]
            for key in keys:
                value = ops.select(value, key)
        return value

    return Node(run, root=root, path=keys)


def _iterable(macro: str, value: Any) -> list[Any] | tuple[Any, ...]:
    if isinstance(value, list | tuple):
        return value
    if isinstance(value, Mapping):
        return list(value)
    raise no_overload(macro, value)


def _unwrap(tree: Tree) -> Tree:
    """The first node below single-child precedence levels (``a`` in ``((a))``)."""
    while not isinstance(tree, str) and tree.data in _PASS_THROUGH and len(tree.children) == 1:
        tree = tree.children[0]
    return tree


def _ident_name(tree: Tree) -> str | None:
    inner = _unwrap(tree)
    if not isinstance(inner, str) and inner.data == "ident":
        return str(inner.children[0])
    return None


def _arguments(tree: Tree | None) -> list[Tree]:
    return [] if tree is None else list(tree.children)


_PASS_THROUGH = frozenset(
    {
        "expr",
        "conditionalor",
        "conditionaland",
        "relation",
        "addition",
        "multiplication",
        "unary",
        "member",
        "primary",
        "paren_expr",
    }
)

_ORDERINGS: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "relation_lt": ("_<_", operator.lt),
    "relation_le": ("_<=_", operator.le),
    "relation_gt": ("_>_", operator.gt),
    "relation_ge": ("_>=_", operator.ge),
}
_ARITHMETIC: dict[str, Callable[[Any, Any], Any]] = {
    "addition_add": ops.add,
    "addition_sub": ops.subtract,
    "multiplication_mul": ops.multiply,
    "multiplication_div": ops.divide,
    "multiplication_mod": ops.modulo,
}
_COMPREHENSIONS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_NAMESPACES = frozenset({"optional", "sets"})
_METHOD_HINTS = {
    "sign": "sign is a global function in the Kubernetes quantity library: write sign(q)",
}


class _Compiler:
    """One expression's compilation: tree node → ``Node``, with a scope of locals."""

    def __init__(self, source: str, optional_at: frozenset[int], variables: Mapping[str, Fields]):
        self.source = source
        self.optional_at = optional_at
        self.variables = variables

    def error(self, tree: Tree, detail: str) -> CelCompileError:
        meta = getattr(tree, "meta", None)
        line = getattr(tree, "line", None) or getattr(meta, "line", None) or 1
        column = getattr(tree, "column", None) or getattr(meta, "column", None) or 1
        return CelCompileError(detail, expression=self.source, line=line, column=column)

    def node(self, tree: Tree, scope: frozenset[str]) -> Node:
        tree = _unwrap(tree)
        handler = getattr(self, f"_{tree.data}", None)
        if handler is None:
            raise self.error(tree, f"unsupported syntax ({tree.data})")
        result: Node = handler(tree, scope)
        return result

    def nodes(self, trees: list[Tree], scope: frozenset[str]) -> list[Node]:
        return [self.node(t, scope) for t in trees]

    # Logical operators and the conditional.

    def _expr(self, tree: Tree, scope: frozenset[str]) -> Node:
        condition, if_true, if_false = self.nodes(tree.children, scope)
        test, yes, no = condition.run, if_true.run, if_false.run

        def run(act: Activation) -> Any:
            chosen = test(act)
            if chosen is True:
                return yes(act)
            if chosen is False:
                return no(act)
            raise no_overload("_?_:_", chosen)

        return Node(run)

    def _conditionaland(self, tree: Tree, scope: frozenset[str]) -> Node:
        return _logical(self.nodes(_flatten(tree, "conditionaland"), scope), decisive=False)

    def _conditionalor(self, tree: Tree, scope: frozenset[str]) -> Node:
        return _logical(self.nodes(_flatten(tree, "conditionalor"), scope), decisive=True)

    # Relations and arithmetic.

    def _relation(self, tree: Tree, scope: frozenset[str]) -> Node:
        operation, right_tree = tree.children
        left, right = self.nodes([operation.children[0], right_tree], scope)
        kind = operation.data
        if kind == "relation_eq":
            return _equality(left, right)
        if kind == "relation_ne":
            return apply(lambda a, b: not cel_equal(a, b), [left, right])
        if kind == "relation_in":
            return apply(ops.contains_item, [left, right])
        name, order = _ORDERINGS[kind]
        return apply(lambda a, b: cel_order(name, order, a, b), [left, right])

    def _arithmetic(self, tree: Tree, scope: frozenset[str]) -> Node:
        operation, right_tree = tree.children
        left, right = self.nodes([operation.children[0], right_tree], scope)
        return apply(_ARITHMETIC[operation.data], [left, right])

    _addition = _arithmetic
    _multiplication = _arithmetic

    def _unary(self, tree: Tree, scope: frozenset[str]) -> Node:
        operation, operand_tree = tree.children
        function = ops.logical_not if operation.data == "unary_not" else ops.negate
        return apply(function, [self.node(operand_tree, scope)])

    # Selection, indexing and calls.

    def _member_dot(self, tree: Tree, scope: frozenset[str]) -> Node:
        target_tree, field_token = tree.children
        field = str(field_token)
        target = self.node(target_tree, scope)
        if field_token.start_pos in self.optional_at:
            return apply(lambda value: ops.select_optional(value, field), [target])
        self._check_field(target, field, field_token)
        if target.root is not None:
            return _path(target.root, (*target.path, field))
        return apply(lambda value: ops.select(value, field), [target])

    def _check_field(self, target: Node, field: str, token: Tree) -> None:
        if target.root is None or target.path or target.fields is None:
            return
        if field not in target.fields:
            raise self.error(token, f"undefined field '{field}'")

    def _member_index(self, tree: Tree, scope: frozenset[str]) -> Node:
        target_tree, key_tree = tree.children
        target, key = self.nodes([target_tree, key_tree], scope)
        if getattr(key_tree.meta, "start_pos", None) in self.optional_at:
            return apply(ops.index_optional, [target, key])
        if target.root is not None and key.constant and type(key.value) is str:
            return _path(target.root, (*target.path, key.value))
        return apply(ops.index, [target, key])

    def _member_dot_arg(self, tree: Tree, scope: frozenset[str]) -> Node:
        target_tree, name_token, *rest = tree.children
        name = str(name_token)
        args = _arguments(rest[0] if rest else None)
        namespace = _ident_name(target_tree)
        if namespace is not None and namespace not in scope and namespace not in self.variables:
            return self._namespaced(tree, f"{namespace}.{name}", args, scope)
        if name in _COMPREHENSIONS:
            return self._comprehension(tree, name, target_tree, args, scope)
        overload = lib.METHODS.get(name)
        if overload is None:
            hint = _METHOD_HINTS.get(name, f"undeclared reference to '{name}' (in container '')")
            raise self.error(name_token, hint)
        self._check_arity(name_token, name, overload, len(args))
        return apply(overload.function, self.nodes([target_tree, *args], scope))

    def _namespaced(self, tree: Tree, name: str, args: list[Tree], scope: frozenset[str]) -> Node:
        if name == "cel.bind":
            return self._bind(tree, args, scope)
        overload = lib.GLOBALS.get(name) if name.partition(".")[0] in _NAMESPACES else None
        if overload is None:
            raise self.error(tree, f"undeclared reference to '{name}' (in container '')")
        self._check_arity(tree, name, overload, len(args))
        return apply(overload.function, self.nodes(args, scope))

    def _check_arity(self, tree: Tree, name: str, overload: lib.Overload, count: int) -> None:
        if count not in overload.arities:
            raise self.error(
                tree, f"found no matching overload for '{name}' applied to {count} argument(s)"
            )

    def _member_object(self, tree: Tree, scope: frozenset[str]) -> Node:
        raise self.error(tree, "message construction is not supported in device selectors")

    # Primaries.

    def _ident(self, tree: Tree, scope: frozenset[str]) -> Node:
        name = str(tree.children[0])
        if name in scope:
            return Node(operator.itemgetter(name), root=name)
        if name not in self.variables:
            raise self.error(tree, f"undeclared reference to '{name}' (in container '')")
        return Node(operator.itemgetter(name), root=name, fields=self.variables[name])

    def _dot_ident(self, tree: Tree, scope: frozenset[str]) -> Node:
        # A leading dot names the root scope; macro variables live in the same
        # activation, so a root name they shadow cannot be reached.
        name = str(tree.children[0])
        if name in scope:
            raise self.error(tree, f"'.{name}' refers to a name shadowed by a macro variable")
        return self._ident(tree, frozenset())

    def _ident_arg(self, tree: Tree, scope: frozenset[str]) -> Node:
        name_token, *rest = tree.children
        name = str(name_token)
        args = _arguments(rest[0] if rest else None)
        if name == "has":
            return self._has(tree, args, scope)
        overload = lib.GLOBALS.get(name) if "." not in name else None
        if overload is None:
            raise self.error(tree, f"undeclared reference to '{name}' (in container '')")
        self._check_arity(tree, name, overload, len(args))
        return apply(overload.function, self.nodes(args, scope))

    _dot_ident_arg = _ident_arg

    def _literal(self, tree: Tree, scope: frozenset[str]) -> Node:
        token = tree.children[0]
        try:
            return constant(_literal_value(token))
        except ValueError as err:
            raise self.error(tree, str(err)) from None

    def _list_lit(self, tree: Tree, scope: frozenset[str]) -> Node:
        elements = self.nodes(_arguments(tree.children[0] if tree.children else None), scope)
        return apply(lambda *values: list(values), elements)

    def _map_lit(self, tree: Tree, scope: frozenset[str]) -> Node:
        entries = self.nodes(_arguments(tree.children[0] if tree.children else None), scope)
        return apply(_build_map, entries)

    # Macros.

    def _has(self, tree: Tree, args: list[Tree], scope: frozenset[str]) -> Node:
        selection = _unwrap(args[0]) if len(args) == 1 else None
        if selection is None or isinstance(selection, str) or selection.data != "member_dot":
            raise self.error(tree, "invalid argument to has() macro")
        target_tree, field_token = selection.children
        field = str(field_token)
        target = self.node(target_tree, scope)
        self._check_field(target, field, field_token)
        return apply(lambda value: _has_field(value, field), [target])

    def _variable(self, tree: Tree, macro: str) -> str:
        name = _ident_name(tree)
        if name is None:
            raise self.error(tree, f"{macro}() variable name must be a simple identifier")
        return name

    def _bind(self, tree: Tree, args: list[Tree], scope: frozenset[str]) -> Node:
        if len(args) != 3:
            raise self.error(tree, "cel.bind() takes a variable, its value and an expression")
        name = self._variable(args[0], "cel.bind")
        init = self.node(args[1], scope).run
        body = self.node(args[2], scope | {name}).run

        def run(act: Activation) -> Any:
            inner = dict(act)
            inner[name] = init(act)
            return body(inner)

        return Node(run)

    def _comprehension(
        self, tree: Tree, macro: str, target_tree: Tree, args: list[Tree], scope: frozenset[str]
    ) -> Node:
        allowed = (2, 3) if macro == "map" else (2,)
        if len(args) not in allowed:
            raise self.error(
                tree, f"found no matching overload for '{macro}' applied to {len(args)} argument(s)"
            )
        name = self._variable(args[0], macro)
        target = self.node(target_tree, scope).run
        body = [self.node(arg, scope | {name}).run for arg in args[1:]]
        loop = _LOOPS[macro] if len(body) == 1 else _filter_map
        return Node(lambda act: loop(macro, _iterable(macro, target(act)), act, name, body))


def _flatten(tree: Tree, kind: str) -> list[Tree]:
    """``a && b && c`` (left-nested in the parse tree) as ``[a, b, c]``."""
    terms = []
    while not isinstance(tree, str) and tree.data == kind and len(tree.children) == 2:
        terms.append(tree.children[1])
        tree = tree.children[0]
    terms.append(tree)
    return terms[::-1]


def _logical(terms: list[Node], *, decisive: bool) -> Node:
    """cel-go's ``&&`` (decisive False) and ``||`` (decisive True) over all terms.

    A term equal to ``decisive`` decides the result even if another term failed;
    otherwise the first error (or non-bool operand) is the result.
    """
    runs = [t.run for t in terms]
    name = "_||_" if decisive else "_&&_"

    def run(act: Activation) -> bool:
        error: CelError | None = None
        for term in runs:
            try:
                value = term(act)
            except CelError as err:
                error = error or err
                continue
            if value is decisive:
                return bool(decisive)
            if value is not (not decisive) and error is None:
                error = no_overload(name, value)
        if error is not None:
            raise error
        return not decisive

    return Node(run)


def _equality(left: Node, right: Node) -> Node:
    """``==``, with a fast path for the common ``<attribute> == "literal"``."""
    if right.constant and type(right.value) is str and not left.constant:
        expected, read = right.value, left.run

        def run(act: Activation) -> bool:
            value = read(act)
            if type(value) is str:
                return bool(value == expected)
            return cel_equal(value, expected)

        return Node(run)
    return apply(cel_equal, [left, right])


def _has_field(value: Any, field: str) -> bool:
    if isinstance(value, Mapping):
        return field in value
    raise CelError(f"no such overload: has() on {type_name(value)}")


def _build_map(*entries: Any) -> dict[Any, Any]:
    built: dict[Any, Any] = {}
    for key, value in zip(entries[::2], entries[1::2], strict=True):
        if type(key) not in (str, int, UInt, bool):
            raise CelError(f"unsupported map key type: {type_name(key)}")
        if any(type(k) is type(key) and k == key for k in built):
            raise CelError(f"Failed with repeated key: {key}")
        built[key] = value
    return built


def _int_literal(text: str) -> int:
    value = _integer(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"integer literal out of range: {text}")
    return value


def _uint_literal(text: str) -> UInt:
    value = _integer(text[:-1])
    if not 0 <= value <= UINT64_MAX:
        raise ValueError(f"unsigned integer literal out of range: {text}")
    return UInt(value)


_LITERALS: dict[str, Callable[[Tree], Any]] = {
    "INT_LIT": lambda token: _int_literal(str(token)),
    "UINT_LIT": lambda token: _uint_literal(str(token)),
    "FLOAT_LIT": lambda token: float(str(token)),
    "STRING_LIT": lambda token: str(celstr(token)),
    "MLSTRING_LIT": lambda token: str(celstr(token)),
    "BYTES_LIT": lambda token: bytes(celbytes(token)),
    "BOOL_LIT": lambda token: str(token) == "true",
    "NULL_LIT": lambda token: None,
}


def _literal_value(token: Tree) -> Any:
    return _LITERALS[token.type](token)


def _integer(text: str) -> int:
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("-")
    return sign * (int(digits, 16) if digits[:2].lower() == "0x" else int(digits))


# --- comprehension loops -----------------------------------------------------------
# Each gets the macro name, the items, the enclosing activation, the variable and the
# compiled bodies; one activation copy per evaluation is reused across items.

Loop = Callable[[str, Any, Activation, str, list[Eval]], Any]


def _metered(items: Any, act: Activation) -> Iterator[Any]:
    """``items``, each charged to the evaluation's ``CostMeter`` (if it has one)."""
    meter: CostMeter | None = act.get(COST_KEY)
    if meter is None:
        yield from items
        return
    for item in items:
        meter.charge()
        yield item


def _all(macro: str, items: Any, act: Activation, name: str, body: list[Eval]) -> bool:
    return _quantifier(items, act, name, body[0], decisive=False)


def _exists(macro: str, items: Any, act: Activation, name: str, body: list[Eval]) -> bool:
    return _quantifier(items, act, name, body[0], decisive=True)


def _quantifier(items: Any, act: Activation, name: str, test: Eval, *, decisive: bool) -> bool:
    # all() is a chain of &&, exists() of ||, with their error absorption.
    inner = dict(act)
    error: CelError | None = None
    for item in _metered(items, act):
        inner[name] = item
        try:
            value = test(inner)
        except CelError as err:
            error = error or err
            continue
        if value is decisive:
            return bool(decisive)
        if value is not (not decisive) and error is None:
            error = no_overload("exists" if decisive else "all", value)
    if error is not None:
        raise error
    return not decisive


def _exists_one(macro: str, items: Any, act: Activation, name: str, body: list[Eval]) -> bool:
    inner = dict(act)
    count = 0
    for item in _metered(items, act):
        inner[name] = item
        value = body[0](inner)
        if type(value) is not bool:
            raise no_overload(macro, value)
        count += value
    return count == 1


def _map(macro: str, items: Any, act: Activation, name: str, body: list[Eval]) -> list[Any]:
    inner = dict(act)
    transform = body[0]
    result = []
    for item in _metered(items, act):
        inner[name] = item
        result.append(transform(inner))
    return result


def _kept(macro: str, value: Any) -> bool:
    if type(value) is not bool:
        raise no_overload(macro, value)
    return bool(value)


def _filter(macro: str, items: Any, act: Activation, name: str, body: list[Eval]) -> list[Any]:
    inner = dict(act)
    result = []
    for item in _metered(items, act):
        inner[name] = item
        if _kept(macro, body[0](inner)):
            result.append(item)
    return result


def _filter_map(macro: str, items: Any, act: Activation, name: str, body: list[Eval]) -> list[Any]:
    inner = dict(act)
    keep, transform = body
    result = []
    for item in _metered(items, act):
        inner[name] = item
        if _kept(macro, keep(inner)):
            result.append(transform(inner))
    return result


_LOOPS: dict[str, Loop] = {
    "all": _all,
    "exists": _exists,
    "exists_one": _exists_one,
    "map": _map,
    "filter": _filter,
}
