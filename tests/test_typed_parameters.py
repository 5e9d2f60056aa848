"""Parameters typed ``Any`` are few and each says why (issue 46): what a function takes is read from its signature.

A parameter of a function in ``conformance/`` annotated ``Any`` (or ``Optional[Any]``) carries, on its own line,
a comment ``# Any: <reason>``: the user's hook object (a function, a ``functools.partial`` or a comm object),
a value read from JSON or TOML or unpickled from a rank's message, a literal of any type. Everything else is
typed: the project's classes, torch's, or a Protocol where a layer must not import another (docs/layers.md).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "conformance"

#: The most parameters typed ``Any`` the package may have, each with its reason: a ceiling, lowered as they go.
MAX_ANY_PARAMETERS = 9
#: The annotations that count as ``Any``.
ANY = {"Any", "Optional[Any]", "typing.Any"}


def any_parameters(package: Path = PACKAGE) -> Iterator[Tuple[str, int, str, str, str]]:
    """``(module, line, function, parameter, source line)`` of each parameter of ``package`` typed ``Any``."""
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]:
                if arg.annotation is not None and ast.unparse(arg.annotation).strip("'\"") in ANY:
                    yield (str(path.relative_to(package.parent)), arg.lineno, node.name, arg.arg,
                           lines[arg.lineno - 1])


def unexplained(package: Path = PACKAGE) -> List[str]:
    """``module:line function(parameter)`` of each parameter typed ``Any`` whose line gives no reason."""
    return [f"{module}:{line} {function}({parameter})"
            for module, line, function, parameter, source in any_parameters(package) if "# Any:" not in source]


def test_every_parameter_typed_any_says_why():
    assert unexplained() == [], ("type these parameters, or say on the parameter's line why nothing narrower "
                                 "fits: `# Any: <reason>`")


def test_parameters_typed_any_are_few():
    found = [f"{m}:{line} {f}({p})" for m, line, f, p, _ in any_parameters()]
    assert len(found) <= MAX_ANY_PARAMETERS, "\n".join(found)


def test_an_unexplained_any_is_named_and_a_reason_clears_it(tmp_path):
    package = tmp_path / "conformance"
    package.mkdir()
    (package / "mod.py").write_text("from typing import Any, Optional\n\n\n"
                                    "def f(hook: Any,  # Any: the user's hook object\n"
                                    "      value: Optional[Any], n: int) -> None:\n    pass\n")
    assert unexplained(package) == ["conformance/mod.py:5 f(value)"]
    assert [p for _, _, _, p, _ in any_parameters(package)] == ["hook", "value"]
