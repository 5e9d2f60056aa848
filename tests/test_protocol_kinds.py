"""Every message kind between the controller, the ranks and the zygote is a :class:`conformance.protocol.Msg`.

No module of the package sends ``("case", ...)`` or compares ``kind == "ping"``: a
message kind spelt as a bare string in one place and as another string in the
other would be a message nobody answers. The kinds travel by value (``Msg`` is a
``str`` enum), so a peer that sent a plain string still matches.
"""

from __future__ import annotations

import ast
import os
import pickle
from typing import List

from conformance.protocol import Msg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {m.value for m in Msg}


def _package_modules() -> List[str]:
    out = []
    for root, dirs, files in os.walk(os.path.join(REPO, "conformance")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _bare_kinds(path: str) -> List[str]:
    """``line: source`` of each bare string message kind in ``path``: the first item of a tuple passed to
    ``send``, or a string compared with a name called ``kind``."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "send":
            for arg in node.args[1:2]:
                if (isinstance(arg, ast.Tuple) and arg.elts and isinstance(arg.elts[0], ast.Constant)
                        and isinstance(arg.elts[0].value, str)):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "kind":
            for right in node.comparators:
                strings = [right] if isinstance(right, ast.Constant) else getattr(right, "elts", [])
                if any(isinstance(s, ast.Constant) and s.value in KINDS for s in strings):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_bare_message_kind_in_the_package():
    bare = {os.path.relpath(p, REPO): found for p in _package_modules() if (found := _bare_kinds(p))}
    assert not bare, f"message kinds spelt as strings (use conformance.protocol.Msg): {bare}"


def test_the_scan_finds_a_bare_kind(tmp_path):
    """The scan above is no vacuous pass: it reports both forms it looks for."""
    path = tmp_path / "peer.py"
    path.write_text('send(conn, ("case", case))\nif kind == "pong":\n    pass\nsend(conn, (Msg.CASE, case))\n')
    assert [line.split(":")[0] for line in _bare_kinds(str(path))] == ["1", "2"]


def test_a_kind_equals_its_string_and_survives_pickle():
    """A peer's plain string matches, and a kind read back from the wire is the same member."""
    assert Msg.CASE == "case" and "pong" == Msg.PONG
    assert pickle.loads(pickle.dumps((Msg.JOIN, {}))) == (Msg.JOIN, {})
    assert pickle.loads(pickle.dumps(Msg.STATUS)) is Msg.STATUS
