"""The docs stay true to the code.

docs/troubleshooting.md quotes what omlx-mtp prints when something is wrong.  These tests read the
package's source by AST (nothing of it is imported but the CLI parser) and check both directions:

* every message the page quotes (the backticked text in the first column of its message tables) is
  made of text that occurs in the package's string literals;
* every message the code builds as an ``MTPError`` (or an instance of any class deriving from it,
  found by AST) is quoted on the page.

On both sides a message is split at the parts that vary: ``{...}`` fields of f-strings (and
non-literal operands of ``+``, ``%`` and ``.format``) in the code; ``<placeholder>`` (with any path
below it, as in ``<dir>/config.json``), ``…`` and ``...`` on the page and in the code.  Only the
literal fragments are compared, so a fragment never matches across a placeholder or across two
different strings.  A field the AST can read is text, not a placeholder: a module-level constant
(``{MODEL_TYPE}``) or a choice between literals (``{'head' if a else 'layer'}``, both variants
checked).  A message built by a helper of the same module (``raise X(_why(...))``) is what the
helper returns.  Where a message is not literal at all, the site must be in NON_LITERAL_SITES.

Further: every ``pip install 'omlx-mtp[<extra>]'`` in docs/ and README.md names an extra that
pyproject.toml declares with at least one requirement, and the ``--synthetic`` shapes and
``--target-bits`` values the docs list are those ``omlx-mtp bench`` offers (its parser's choices,
or the values its help text lists).
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omlx_mtp"
DOCS = ROOT / "docs"
PAGE = DOCS / "troubleshooting.md"
BASE_ERROR = "MTPError"

# A literal fragment shorter than this (": ", " (", "--x") says nothing about which message it is.
MIN_FRAGMENT = 6

# Separates the literal fragments of one string, and different strings from each other.
SEP = "\x00"

# Tables on the page whose first column quotes messages, by their first header cell.
MESSAGE_TABLE_HEADERS = {"message", "problem", "what you see"}

# Messages the page quotes (first column) that the package's literals can't show as they are:
# printed by other code, or quoted with a value filled in.  message -> why.
QUOTED_NOT_LITERALLY = {
    "all outputs identical at T=0: False": "demo prints the boolean it computed",
}

# Constructions of an MTPError (or subclass) whose message has no literal fragment of MIN_FRAGMENT
# characters or more (a variable, or placeholders only), as "path::function".  Each is looked at by
# hand: its message comes from elsewhere, and the page must cover that.  A new one fails the test.
NON_LITERAL_SITES = {
    # mismatch: "<where>: assistant weights do not match its config" and the like, from its callers;
    # the error is "<mismatch> (<mlx's detail>)".
    "omlx_mtp/drafters/quantized.py::load_into",
}

# At most this many variants of one message (f-string fields that choose between literals).
MAX_VARIANTS = 16


# ----------------------------------------------------------------------------------------------------
# Fragments


def _squash(text: str) -> str:
    """Whitespace collapsed, as MTPError.__str__ collapses it."""
    return " ".join(text.split())


# Stripped from a fragment's ends: the quotes and brackets around a placeholder ('<name>' on the
# page is {name!r} in the code, [<shape>] is a list's repr).
_EDGES = " '\"()[]{}"


def fragments(template: str) -> list[str]:
    """The literal fragments of a template (variable parts are SEP), edges stripped, empty ones left
    out.  An ellipsis splits too, as on the page (where it elides)."""
    parts = (_squash(part).strip(_EDGES) for part in re.split(SEP + r"|…|\.\.\.", template))
    return [part for part in parts if part]


def _joined(templates) -> str:
    """Templates as one searchable text: fragments and templates separated by SEP."""
    return SEP + SEP.join(SEP.join(_squash(part) for part in t.split(SEP)) for t in templates) + SEP


# A placeholder on the page: <dir>, <vision/audio>, <first line of git's report> (not "<= 1");
# a path below it (<dir>/config.json) varies with it: the code formats the path in one piece.
_PLACEHOLDER = re.compile(r"<[A-Za-z][^<>`]*>(?:/[\w.*/-]+)?|…|\.\.\.")


def doc_template(message: str) -> str:
    return _PLACEHOLDER.sub(SEP, message.replace("\\|", "|"))


# ----------------------------------------------------------------------------------------------------
# The package's strings, by AST


@functools.lru_cache(maxsize=None)
def _modules() -> tuple[tuple[str, ast.Module], ...]:
    return tuple((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path)))
                 for path in sorted(PACKAGE.rglob("*.py")))


def _module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` (or a number): an f-string field naming one prints that text."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and type(node.value.value) in (str, int, float)):
            out[node.targets[0].id] = node.value.value
    return out


def _product(options: list[list[str]]) -> list[str]:
    out = [""]
    for choices in options:
        out = [a + b for a, b in itertools.product(out, choices)]
        if len(out) > MAX_VARIANTS:
            return [SEP]
    return out


def _field(node: ast.FormattedValue, constants: dict) -> list[str]:
    """An f-string field: the literal texts it can be (a module constant, ``'a' if c else 'b'``),
    else SEP."""
    if node.format_spec is not None:
        return [SEP]
    value = node.value
    if isinstance(value, ast.Name) and value.id in constants:
        texts = [constants[value.id]]
    elif isinstance(value, ast.IfExp) and all(isinstance(v, ast.Constant) and isinstance(v.value, str)
                                              for v in (value.body, value.orelse)):
        texts = [value.body.value, value.orelse.value]
    elif isinstance(value, ast.Constant) and isinstance(value.value, str):
        texts = [value.value]
    else:
        return [SEP]
    return [repr(t) if node.conversion == ord("r") else str(t) for t in texts]


_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0+]*\d*(?:\.\d+)?[sdirfgxec]")


def templates(node: ast.AST, constants: dict) -> list[str] | None:
    """The texts a string expression builds, SEP where they vary; None where it has no literal part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return _product([[value.value] if isinstance(value, ast.Constant) else _field(value, constants)
                         for value in node.values])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = templates(node.left, constants), templates(node.right, constants)
        if left is None and right is None:
            return None
        return _product([left or [SEP], right or [SEP]])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left = templates(node.left, constants)
        return None if left is None else [_PERCENT.sub(SEP, t) for t in left]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
            and isinstance(node.func.value, (ast.Constant, ast.JoinedStr))):
        base = templates(node.func.value, constants)
        return None if base is None else [re.sub(r"\{[^{}]*\}", SEP, t) for t in base]
    if isinstance(node, ast.IfExp):  # either branch is the message
        found = [t for branch in (node.body, node.orelse) for t in (templates(branch, constants) or [])]
        return found or None
    return None


def _bare_strings(tree: ast.Module) -> set[int]:
    """Bare string statements (docstrings): text, but never printed."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Constant, ast.JoinedStr))}


@functools.lru_cache(maxsize=None)
def package_strings() -> str:
    """Every string literal of the package (literal parts of f-strings, concatenations and
    %-templates too) as one text, fragments and strings separated by SEP."""
    found: list[str] = []
    for _, tree in _modules():
        skip, constants = _bare_strings(tree), _module_constants(tree)
        for node in ast.walk(tree):
            if id(node) not in skip and isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                found += [_PERCENT.sub(SEP, t) for t in templates(node, constants) or []]
    return _joined(found)


@functools.lru_cache(maxsize=None)
def error_classes() -> frozenset[str]:
    """MTPError and every class of the package deriving from it, however deep."""
    bases: dict[str, set[str]] = {}
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(
                    base.id if isinstance(base, ast.Name) else base.attr
                    for base in node.bases if isinstance(base, (ast.Name, ast.Attribute)))
    found = {BASE_ERROR}
    while more := {name for name, parents in bases.items() if parents & found} - found:
        found |= more
    return frozenset(found)


@dataclass(frozen=True)
class Site:
    """One construction of an MTPError (or subclass) in the package, with one variant of its message."""

    path: str
    line: int
    function: str
    cls: str
    template: str | None  # None: no literal message

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def key(self) -> str:
        return f"{self.path}::{self.function}"

    @property
    def shown(self) -> str:
        return "(not a literal)" if self.template is None else _squash(self.template.replace(SEP, "<…>"))

    @property
    def fragment(self) -> str | None:
        """The message's longest literal fragment; None where none has MIN_FRAGMENT characters."""
        best = max(fragments(self.template) if self.template is not None else [], key=len, default="")
        return best if len(best) >= MIN_FRAGMENT else None


def _owners(tree: ast.Module) -> dict[int, str]:
    """id(node) -> qualified name of the function or class around it."""
    owner: dict[int, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if name == "<module>" else f"{name}.{child.name}"
            owner[id(child)] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return owner


def _returned(function: ast.FunctionDef, constants: dict) -> list[str] | None:
    """What a helper that builds a message returns: the templates of its return statements."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            found += templates(node.value, constants) or [SEP]
    return found or None


def _message_templates(message: ast.AST | None, helpers: dict[str, ast.FunctionDef],
                       constants: dict) -> list[str] | None:
    if message is None:
        return None
    if isinstance(message, ast.Call) and isinstance(message.func, ast.Name) and message.func.id in helpers:
        return _returned(helpers[message.func.id], constants)  # raise X(_why(...)): the helper's message
    return templates(message, constants)


@functools.lru_cache(maxsize=None)
def error_sites() -> tuple[Site, ...]:
    """Every call of an MTPError class in the package (``raise X(...)``, ``return X(...)``, ...), one
    Site per variant of its message."""
    classes = error_classes()
    sites = []
    for path, tree in _modules():
        owner, constants = _owners(tree), _module_constants(tree)
        helpers = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name not in classes:
                continue
            found = _message_templates(node.args[0] if node.args else None, helpers, constants)
            for template in found or [None]:
                sites.append(Site(path, node.lineno, owner.get(id(node), "<module>"), name, template))
    return tuple(sites)


# ----------------------------------------------------------------------------------------------------
# The page

_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
_RULE = re.compile(r"\s*\|?(\s*:?-+:?\s*\|)+\s*(:?-+:?\s*)?")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def code_spans(text: str) -> list[str]:
    return [match.group(2).strip() for match in _CODE_SPAN.finditer(text)]


def quoted_messages(text: str) -> list[tuple[int, str]]:
    """(line, message) for every backticked message in the first column of the message tables."""
    lines = text.splitlines()
    found, in_table = [], False
    for number, line in enumerate(lines, 1):
        if not line.lstrip().startswith("|"):
            in_table = False
        elif _RULE.fullmatch(line):
            continue
        elif number < len(lines) and _RULE.fullmatch(lines[number]):  # a header row
            in_table = _cells(line)[0].lower() in MESSAGE_TABLE_HEADERS
        elif in_table:
            found += [(number, span) for span in code_spans(_cells(line)[0])]
    return found


@functools.lru_cache(maxsize=None)
def page_text() -> str:
    """Every code span of the page, placeholders as SEP, as one searchable text."""
    return _joined(doc_template(span) for span in code_spans(PAGE.read_text(encoding="utf-8")))


# ----------------------------------------------------------------------------------------------------
# The checks, as functions of their inputs (so that they can be shown to fail)


def unfounded_quotes(quoted: list[tuple[int, str]], strings: str) -> list[str]:
    """Quoted messages with a fragment (of MIN_FRAGMENT or more) no string of the package contains."""
    problems = []
    for line, message in quoted:
        if message in QUOTED_NOT_LITERALLY:
            continue
        missing = [f for f in fragments(doc_template(message)) if len(f) >= MIN_FRAGMENT and f not in strings]
        if missing:
            problems.append(f"  {PAGE.relative_to(ROOT)}:{line}: `{message}`\n"
                            f"      not in any string of omlx_mtp/: {', '.join(map(repr, missing))}")
    return problems


def undocumented(sites, text: str) -> list[str]:
    """Sites whose message's longest literal fragment is in no code span of the page."""
    return [f"  {site.where} ({site.function}): {site.cls}(\"{site.shown}\")\n      missing: {site.fragment!r}"
            for site in sites if site.fragment is not None and site.fragment not in text]


# ----------------------------------------------------------------------------------------------------
# Tests


def test_the_package_and_the_page_are_read():
    """Guards the parsing: classes, raises and quoted messages are found at all."""
    classes = error_classes()
    assert {"CheckpointError", "DrafterMismatchError"} <= classes, sorted(classes)
    assert len(error_sites()) > 50
    assert len(quoted_messages(PAGE.read_text(encoding="utf-8"))) > 50


def test_every_quoted_message_is_in_the_code():
    quoted = quoted_messages(PAGE.read_text(encoding="utf-8"))
    stale = set(QUOTED_NOT_LITERALLY) - {message for _, message in quoted}
    assert not stale, f"QUOTED_NOT_LITERALLY names messages the page no longer quotes: {sorted(stale)}"
    problems = unfounded_quotes(quoted, package_strings())
    assert not problems, ("docs/troubleshooting.md quotes messages the code does not print (parts that vary must "
                          "be <placeholders>); fix or remove these rows:\n" + "\n".join(problems))


def test_every_raised_message_is_on_the_page():
    problems = undocumented(error_sites(), page_text())
    assert not problems, (
        "these MTPError messages are not quoted in docs/troubleshooting.md: add a row under the section "
        "of their command (`message with <placeholders>` | meaning and fix), quoting at least the part "
        "shown as missing:\n" + "\n".join(problems))


def test_non_literal_messages_are_the_known_ones():
    skipped = {site.key for site in error_sites() if site.fragment is None}
    shown = "\n".join(f"  {s.where} ({s.key}): {s.cls}({s.shown})" for s in error_sites() if s.fragment is None)
    assert skipped == NON_LITERAL_SITES, (
        "MTPErrors whose message is not a literal changed; give the message a literal text, or check "
        "that the page covers it and update NON_LITERAL_SITES:\n" + shown)


def test_the_checks_can_fail():
    strings = _joined([SEP + ": no such checkpoint directory", "cannot read" + SEP + " the file"])
    assert not unfounded_quotes([(1, "<dir>: no such checkpoint directory")], strings)
    assert not unfounded_quotes([(1, "cannot read <path> the file")], strings)
    assert unfounded_quotes([(1, "<dir>: no such checkpoint folder")], strings)
    assert unfounded_quotes([(1, "cannot read the file")], strings)  # across a placeholder
    assert unfounded_quotes([(1, "no such checkpoint directory cannot read")], strings)  # across two strings
    site = Site("omlx_mtp/x.py", 1, "f", "MTPError", SEP + ": not a directory omlx-mtp wrote")
    assert not undocumented([site], _joined([doc_template("<out>: not a directory omlx-mtp wrote")]))
    assert undocumented([site], _joined([doc_template("<out>: not a directory <x> omlx-mtp wrote")]))


def test_messages_are_read_from_the_ast():
    def first_call(source: str) -> list[str]:
        tree = ast.parse(source)
        call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "E")
        return templates(call.args[0], _module_constants(tree))

    assert first_call("raise E(f'{p}: ' + 'bad ' f'{p!r} thing')") == [SEP + ": bad " + SEP + " thing"]
    assert first_call("K = 'kind'\nraise E(f'{K} {K!r}: %s' % x)") == ["kind 'kind': " + SEP]
    assert first_call("raise E(f\"{p}: {'head' if a else 'layer'}\")") == [SEP + ": head", SEP + ": layer"]
    assert first_call("raise E(message)") is None
    assert fragments(SEP + ": no MTP tensors (mtp.*, ...) to add " + SEP + "'") == [": no MTP tensors (mtp.*,", "to add"]


# --- install commands ------------------------------------------------------------------------------


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_pip_extras_exist_and_install_something():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    problems = []
    for path in _doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "pip install" not in line:
                continue
            for match in re.finditer(r"(?:omlx-mtp|(?<![\w./-])\.)\[([^\]]*)\]", line):
                for extra in filter(None, (e.strip() for e in match.group(1).split(","))):
                    if not declared.get(extra):
                        problems.append(f"  {path.relative_to(ROOT)}:{number}: [{extra}] "
                                        + ("installs nothing" if extra in declared else "is not an extra"))
    assert not problems, ("install commands name extras pyproject.toml does not fill "
                          f"(declared: {', '.join(k for k, v in declared.items() if v)}):\n" + "\n".join(problems))


# --- bench options ---------------------------------------------------------------------------------


def _bench_action(option: str):
    import argparse

    from omlx_mtp.tools.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices["bench"]._actions if option in a.option_strings)


def offered(option: str) -> set[str]:
    """What ``omlx-mtp bench`` offers for an option: its choices; else, for an integer option, the
    numbers its help names; else the names its help lists after its last colon (asides in brackets
    left out), "a, b or c"."""
    action = _bench_action(option)
    if action.choices:
        return {str(c) for c in action.choices}
    text = action.help or ""
    if action.type is int:
        return set(re.findall(r"(?<![\w.-])\d+(?![\w.])", text))
    listed = re.sub(r"\([^)]*\)", "", text).rpartition(":")[2]
    return {name.strip() for name in re.split(r",|\bor\b", listed) if name.strip()}


@pytest.mark.parametrize("option", ["--synthetic", "--target-bits"])
def test_bench_values_in_the_docs_are_the_parsers(option):
    values = offered(option)
    assert values, f"omlx-mtp bench {option}: no choices, and its help lists none"
    # A value has a digit, a dot or a hyphen in it (shape names and bit widths do; "--synthetic and
    # --model" in prose does not); "a|b|c" lists them all.
    value = r"[\w.-]*[\d.-][\w.-]*"
    pattern = re.compile(re.escape(option) + rf"(?![\w-])[ =]({value}(?:\|{value})*)(?![\w.-])")
    problems = []
    for path in _doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                given = match.group(1).split("|")
                if all(v.isupper() for v in given):  # a metavar: --synthetic NAME
                    continue
                where = f"  {path.relative_to(ROOT)}:{number}: {match.group(0)}"
                if set(given) - values:
                    problems.append(f"{where}: {', '.join(sorted(set(given) - values))} not offered")
                elif len(given) > 1 and set(given) != values:
                    problems.append(f"{where}: lists {len(given)} of {len(values)}")
    assert not problems, (f"docs list omlx-mtp bench {option} values its parser does not give "
                          f"({', '.join(sorted(values))}):\n" + "\n".join(problems))


def _shapes_in_code() -> set[str]:
    tree = dict(_modules())["omlx_mtp/fixtures/synthetic.py"]
    shapes = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "SHAPES" for t in node.targets))
    return {key.value for key in shapes.keys}


def test_bench_help_lists_the_synthetic_shapes():
    assert offered("--synthetic") == _shapes_in_code()
