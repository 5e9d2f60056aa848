"""A diagnosis cause has an identity: a :class:`conformance.protocol.Cause` (a code, parameters, words, a fix).

Every source of causes builds one (the shared candidates' words, the diagnosis's own causes, an API's hand-built
ones); it crosses from the ranks to the controller inside a :class:`~conformance.protocol.Finding`, pickled, and
nothing recognises a cause by its words. Where several causes give the hook's bits, the diagnosis names them all,
and says so where the call is too small to tell them apart: one gloo rank in this process (``tests/conftest.py``'s
``gloo_group``), where a float32 gradient rounded to bfloat16 is both "reduced in bfloat16" and "the input rounded
to bfloat16" bit for bit.
"""

from __future__ import annotations

import ast
import os
import pickle
import types
from typing import List

import torch

from conformance.apis.ddp.arithmetic import DdpArithmetic
from conformance.protocol import UNNAMED_CAUSE, Cause, CheckResult, Finding, FindingKind, RankOutcome
from conformance.ranks.diagnosis import SMALL_CALL, diagnose, too_small
from conformance.ranks.hook_call import CallLog, HookCall
from conformance.reports.report import findings_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_cause_pickles_inside_a_finding_and_keeps_its_identity():
    cause = Cause("wrong_divisor", (("divides_as", 4), ("group_size", 3)), "divided as for 4 ranks", "divide by 3")
    outcome = RankOutcome(0, ok=True, value=CheckResult(findings=[Finding(0, "m", kind="diagnosis", causes=(cause,))]))
    back = pickle.loads(pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)).value.findings[0]
    assert back.causes == (cause,) and back.fixes == ("divide by 3",)
    assert back.causes[0].family == "wrong_divisor(divides_as, group_size)" and back.causes[0].param("divides_as") == 4
    # The family leaves the numbers out (each rank its own shard), keeps what is not a number (a dtype, an order).
    assert Cause("other_rank_shard", (("shard_of", 2), ("rank", 0))).family == \
        Cause("other_rank_shard", (("shard_of", 0), ("rank", 1))).family
    assert Cause("other_dtype", (("dtype", "bfloat16"),)).family != Cause("other_dtype", (("dtype", "float16"),)).family
    assert Cause("partial", (("tail", True), ("first", 3))).family == "partial(tail=True, first)"


def test_a_cause_given_in_words_is_coerced_with_its_fix():
    f = Finding(0, "m", kind="diagnosis", causes=("A", "B"), fixes=("do a",))
    assert [c.code for c in f.causes] == [UNNAMED_CAUSE] * 2 and [c.words for c in f.causes] == ["A", "B"]
    assert f.fixes == ("do a", "") and f.fix_of(f.causes[0]) == "do a"
    assert f.causes[0].family != f.causes[1].family  # nothing known of them but their words: each its own


def _words_compared(path: str) -> List[str]:
    """Where ``path`` compares a cause's words, or tests how they start: ``x.words == ...``,
    ``x.words.startswith(...)``, ``... in x.words``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left] + list(node.comparators)
            if any(isinstance(o, ast.Attribute) and o.attr == "words" for o in operands):
                out.append(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith") and isinstance(node.func.value, ast.Attribute) and \
                node.func.value.attr == "words":
            out.append(f"{path}:{node.lineno}")
    return out


def test_no_module_recognises_a_cause_by_its_words():
    found = []
    for root, dirs, files in os.walk(os.path.join(REPO, "conformance")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [hit for f in files if f.endswith(".py") for hit in _words_compared(os.path.join(root, f))]
    assert found == []


def _diagnosed(group, n: int) -> List[Finding]:
    """The diagnosis of one DDP call of ``n`` float32 elements whose result is the gradient rounded to bfloat16."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    log = CallLog()
    log.add(HookCall(step=0, index=0, where="bucket 0", input=x.clone(), output=x.bfloat16().float()))
    ctx = types.SimpleNamespace(group=group, device=torch.device("cpu"), rank=0)
    return diagnose(ctx, DdpArithmetic(1, None), log, 0)


def test_an_ambiguous_call_names_every_matching_cause_and_says_it_is_too_small(gloo_group):
    """Review of issue 46: a 3-element call where several causes give the hook's bits was named by one of them. Every
    cause that gives the bits is named, each with its code and fix, and one line says the call is too small to tell
    them apart; a larger call of the same kind names them all too, without that line."""
    found = _diagnosed(gloo_group, 3)
    named = [f for f in found if f.kind in (FindingKind.DIAGNOSIS, FindingKind.DIAGNOSIS_WIDER_DTYPE)]
    assert len(named) == 1, found
    assert [c.code for c in named[0].causes] == ["other_dtype", "rounded_input"], named
    assert all(c.words in named[0].message and c.fix for c in named[0].causes), named
    notes = [f.message for f in found if f.kind is FindingKind.DIAGNOSIS_NOTE]
    assert notes == ["this call has only 3 elements: these causes give the same bits here; a larger buffer tells them "
                     "apart"], found
    assert notes[0] in findings_text(found)
    large = _diagnosed(gloo_group, 4 * SMALL_CALL)
    assert [c.code for f in large for c in f.causes] == ["other_dtype", "rounded_input"], large
    assert not [f for f in large if f.kind is FindingKind.DIAGNOSIS_NOTE], large


def test_the_too_small_line_counts_the_small_calls_and_words_a_single_cause():
    small = HookCall(step=0, index=0, where="a", input=torch.zeros(1), output=torch.zeros(1))
    big = HookCall(step=0, index=1, where="b", input=torch.zeros(9 * SMALL_CALL), output=torch.zeros(3 * SMALL_CALL),
                   sharded=True)  # a reduce-scatter: its buffer, not this rank's shard, tells the causes apart
    one, two = (Cause("stale", words="x"),), (Cause("stale", words="x"), Cause("partial", words="y"))
    assert too_small([small], one) == ("this call has only 1 element: other causes may give the same bits here; a "
                                       "larger buffer tells them apart")
    assert too_small([small, big], two).startswith("1 of these 2 calls have only 1 element: these causes give")
    assert too_small([big], two) is None
    assert too_small([big], two, indistinct=True).startswith("every cause tried gives the same bits")


def test_a_job_across_nodes_adds_the_layouts_sizes_as_divisors(gloo_group, monkeypatch):
    """The candidates of a call on 4 ranks laid out as 2 nodes of 2 include native's arithmetic dividing as for 2
    ranks (``LOCAL_WORLD_SIZE``, the node count); on one node they do not."""
    from conformance.apis.fsdp.arithmetic import FsdpArithmetic
    from conformance.ranks.reduction import HOOK_GROUP
    from conformance.ranks.topology import torchrun_env

    call = HookCall(step=0, index=0, where="", input=torch.zeros(8), output=torch.zeros(2), sharded=True)

    def divisors(nodes: int) -> List[int]:
        for key, value in torchrun_env(0, 4, nodes).items():
            monkeypatch.setenv(key, value)
        return [c.divides_as for c in FsdpArithmetic(4, None).changes(call) if c.group == HOOK_GROUP and c.divides_as]

    assert 2 not in divisors(1)
    assert 2 in divisors(2)
