"""The reproducer writer's shortcuts give the texts it gave without them.

:func:`~conformance.reproducers.specialise.segment` is :func:`ast.get_source_segment` with the source split once,
and :func:`~conformance.reproducers.specialise.specialised` remembers its result for a source and the entries of
``CASE`` that source's code reads: a second case that differs only where the code does not look gets the same text,
one that differs where it looks gets its own.
"""

from __future__ import annotations

import ast
import inspect

from conformance.reproducers import inline, specialise, writer
from conformance.reproducers.specialise import parents, segment, specialised, walk


def test_segment_is_ast_get_source_segment_on_every_node_and_odd_line_ends():
    """Every node of a few of the writer's functions (multi-line calls, strings, comprehensions) and of sources
    with ``\\r\\n``, ``\\r`` and non-ASCII text (columns are UTF-8 byte offsets)."""
    sources = [inspect.getsource(f) for f in (specialise.segment, specialise._case_keys, specialise._plain)]
    sources += ["a = 1\r\nb = 'é' + 'x'\rc = (1,\n 2)", "x = 'ü'; y = ('ä',\r\n  'ö')\n\n", "f(\n)"]
    nodes = 0
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            assert segment(source, node) == ast.get_source_segment(source, node), (source[:80], ast.dump(node)[:200])
            nodes += 1
    assert nodes > 500


def test_walk_and_parents_are_ast_walk_in_its_order():
    """:func:`~conformance.reproducers.specialise.walk` is ``ast.walk`` (the same nodes, breadth first, in the same
    order: the edits take the first match), on a whole module's tree and on a part of one; ``parents`` maps every
    child to the node ``ast.iter_child_nodes`` gives it under; a module's tree keeps its index, a second call is the
    same object."""
    for module in (specialise, inline, writer):
        tree = ast.parse(inspect.getsource(module))
        assert list(walk(tree)) == list(ast.walk(tree))
        assert walk(tree) is walk(tree)
        assert parents(tree) == {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        part = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
        assert list(walk(part)) == list(ast.walk(part)) and len(walk(part)) > 10


SOURCE = '''\
def build():
    if CASE["model"] == "net":
        return 1
    elif CASE.get("nodes") == 2:
        return 2
    return 3
'''


def test_a_remembered_text_depends_on_the_case_entries_the_code_reads_and_on_nothing_else():
    specialise._SPECIALISED.clear()
    net = specialised(SOURCE, {"model": "net", "hook": "a"}, {})
    assert "return 1" in net and "return 3" not in net
    assert len(specialise._SPECIALISED) == 1
    # another hook, the same entries read: remembered
    assert specialised(SOURCE, {"model": "net", "hook": "b"}, {}) == net
    assert len(specialise._SPECIALISED) == 1
    # an entry the code reads differs: its own text
    two_nodes = specialised(SOURCE, {"model": "mlp", "nodes": 2, "hook": "a"}, {})
    assert "return 2" in two_nodes and "return 1" not in two_nodes
    one_node = specialised(SOURCE, {"model": "mlp", "hook": "a"}, {})
    assert "return 3" in one_node and "return 2" not in one_node
    assert len(specialise._SPECIALISED) == 3


def test_a_case_read_any_other_way_keys_on_the_whole_case():
    source = SOURCE + "\ndef keys():\n    return sorted(CASE)\n"
    assert specialise._case_keys(source) is None
    assert specialise._case_keys(SOURCE) == ("model", "nodes")
    specialise._SPECIALISED.clear()
    specialised(source, {"model": "net", "hook": "a"}, {})
    specialised(source, {"model": "net", "hook": "b"}, {})
    assert len(specialise._SPECIALISED) == 2


def test_a_value_known_only_by_its_address_is_never_remembered():
    class Opaque:
        pass

    specialise._SPECIALISED.clear()
    known = {"layout": Opaque()}
    assert specialised(SOURCE, {"model": "net"}, {}, known) == specialised(SOURCE, {"model": "net"}, {})
    assert len(specialise._SPECIALISED) == 1  # the second call's, not the first's


def test_a_definition_left_out_without_a_parse_is_the_one_the_parse_leaves_out(monkeypatch):
    """:func:`~conformance.reproducers.source_edits.removed_after_inlining` leaves out an inlined helper's definition
    by the tree the file had before the call was written in, and gives the text :func:`~conformance.reproducers.
    source_edits.removed` gives from a parse of the new file: parity files of every API are the same with it turned
    off (every definition then found by a parse), and it was taken for most of their helpers."""
    from tests import test_reproducer_content as content

    every = content._cases()
    cases = [next(c for c in every if c[0] == api) for api in content.HOOKS] + every[3::12]  # every API, models
    real, taken = inline.removed_after_inlining, []

    def counted(*args):
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(inline, "removed_after_inlining", counted)
    fast = [content._source(api, params, world_size) for api, params, world_size in cases]
    monkeypatch.setattr(inline, "removed_after_inlining", lambda *args: None)
    assert [content._source(api, params, world_size) for api, params, world_size in cases] == fast
    assert sum(taken) > len(taken) / 2, taken
