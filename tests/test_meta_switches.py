"""Meta-tests of where two switches meet (issue 44), on the switch zoo (``tests/zoo/switch_hooks/``) and the
identity zoo (``tests/zoo/identity_hooks.py``).

The shared meta-tests (``tests/test_meta.py``) hold the nightly run (``tests/meta_zoos/switches.py``): every bad
hook caught by its API's combined case alone, every good twin passing it. These hold the default depth, where
none of them takes its other path: every hook conforms, and its verdict names the line of its switch as never
taken, by file and line; the identity hooks run under every measurement the suite makes (the P2P exchange
taken); and the nightly's verdict says which branch its combined case took first.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any, Dict

import pytest

from tests.meta_helpers import BackgroundJob, run_suite
from tests.meta_zoos import SWITCH_DEFAULT_RUNS, SWITCHES
from tests.zoo import identity_hooks, switch_hooks

@pytest.fixture
def default(zoo_runs):
    """The default depth's run with the measurement on (``tests/meta_zoos/switches.py``): ``(run, document)``."""
    return zoo_runs(SWITCH_DEFAULT_RUNS)["on"]


def _hooks(doc):
    return {h["name"]: h for h in doc["hooks"]}


def switch_line(spec) -> tuple:
    """``(file name, line)`` of the ``# switch`` line of the spec's hook (its function, or its comm's class)."""
    lines, first = inspect.getsourcelines(spec.hook)
    offset = next(i for i, line in enumerate(lines) if line.rstrip().endswith("# switch"))
    return os.path.basename(inspect.getsourcefile(spec.hook)), first + offset


def test_at_the_default_depth_every_switch_hook_conforms(default):
    run, doc = default
    assert run.returncode == 1, run.output[-3000:]  # the run's sample of DDP's arithmetic zoo fails (the bits test)
    hooks = _hooks(doc)
    for spec in switch_hooks.ALL + identity_hooks.ALL:
        assert hooks[spec.name]["status"] == "conforms", (spec.name, hooks[spec.name]["verdict"])


@pytest.mark.parametrize("spec", switch_hooks.ALL, ids=lambda s: s.name)
def test_each_hooks_switch_is_named_never_taken_by_file_and_line(default, spec):
    """Issue 44: every bad hook gets CONFORMS at the default depth, where no case holds both of its switches; its
    verdict says which line of its code never ran, so its author is told."""
    run, doc = default
    name, line = switch_line(spec)
    code = _hooks(doc)[spec.name]["hook_code"]
    assert code["measured"] and code["branches"] > code["branches_taken"], code
    never = {(os.path.basename(b["file"]), b["line"]) for b in code["never_taken"]}
    assert (name, line) in never, (spec.name, sorted(never))
    taken = next(b for b in code["never_taken"] if (os.path.basename(b["file"]), b["line"]) == (name, line))
    assert taken["source"].endswith("# switch") and taken["how"] in ("never true", "the line never ran"), taken
    block = _block(run.output, spec.name)  # the terminal says it under the hook's verdict, with the source line
    how = r"\((never true|the line never ran)\)"
    assert re.search(rf"^ +never taken: \S*{re.escape(name)}:{line}  .*# switch  {how}$", block, re.M), block


def _block(output: str, hook: str) -> str:
    """The hook's lines of the verdict section: its verdict line and the indented lines under it."""
    match = re.search(rf"^{re.escape(hook)} .*?(?=^\S)", output, re.M | re.S)
    assert match, hook
    return match.group(0)


def test_the_identity_hooks_run_their_point_to_point_exchange_under_every_measurement(default):
    """A hook that builds dist.P2POp(dist.isend, ...) and refuses a patched torch.distributed conforms: nothing the
    suite measures while it runs (its code traced, its collectives counted, its works seen) changes what it sees.
    Its exchange ran (the 2-rank branch taken), its refusal never did."""
    _, doc = default
    source = inspect.getsource(identity_hooks)
    refusal = next(i for i, ln in enumerate(source.splitlines(), 1) if "is not getattr(distributed_c10d, name)" in ln)
    for spec in identity_hooks.ALL:
        code = _hooks(doc)[spec.name]["hook_code"]
        never = {(b["line"], b["how"]) for b in code["never_taken"]}
        assert (refusal, "never true") in never, never  # the suite never patched torch.distributed
        exchange = next(i for i, ln in enumerate(source.splitlines(), 1)
                        if ln.strip().startswith("if process_group.size() == 2" if spec.api == "ddp"
                                                 else "if replica_group.size() == 2"))
        assert (exchange, "never true") not in never and (exchange, "the line never ran") not in never


def test_the_nightly_verdict_says_which_branch_its_combined_case_took_first(zoo_runs):
    """At nightly depth the DDP warm-up twin ran its parity case first (its switch never taken), then the
    combined case, which took it: its hook code line says so."""
    run = zoo_runs(SWITCHES)
    spec = next(s for s in switch_hooks.KNOWN_GOOD if s.name == "good_ddp_warm_large_staged")
    name, line = switch_line(spec)
    block = _block(run.output, spec.name)
    assert re.search(rf"first taken by the combined cases: [^\n]*{re.escape(name)}:{line}\b", block), block
    assert not re.search(rf"never taken: \S*{re.escape(name)}:{line}\b", block), block


def _uncovered_run(runs: object, directory: str, env: Dict[str, str]) -> Any:
    return run_suite(["--hook", "tests.zoo.switch_hooks.ddp:KNOWN_GOOD", "-q", "--fail-on", "uncovered", "-k",
                      "test_ddp_parity and default-nested_wrapped-ws2"], os.path.join(directory, "uncovered.xml"),
                     timeout=600, env=env)


#: Two conforming DDP hooks whose switch never runs at 2 ranks, under ``--fail-on uncovered``.
UNCOVERED_RUN = BackgroundJob("switch_hooks_uncovered", _uncovered_run)


def test_fail_on_uncovered_fails_a_run_whose_hooks_conform_naming_each_branch(zoo_runs):
    run = zoo_runs(UNCOVERED_RUN)
    assert run.returncode == 1, run.output[-3000:]
    assert all(c.outcome == "passed" for c in run.cases) and len(run.cases) == 2
    section = run.output.split("branches no case took (--fail-on uncovered)", 1)[1]
    for spec in (s for s in switch_hooks.KNOWN_GOOD if s.api == "ddp"):
        name, line = switch_line(spec)
        assert f"{spec.name}: tests/zoo/switch_hooks/{name}:{line}" in section, section
    assert "--fail-on uncovered: exit status 1" in section
