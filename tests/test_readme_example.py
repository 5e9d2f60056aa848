"""The README's plug-in example is real: it is examples/my_hooks.py, my_ddp_hook.py and my_specs.py (the FSDP1 hook
and its spec in README.md, the DDP hook and its spec in docs/api-ddp.md), installed as conformance.examples, and it
conforms, run from a directory that is not the suite's checkout (README: "runs from any directory"). Its layout keeps
hooks (torch only) and specs apart, so a reproducer needs only torch and the hook."""

from __future__ import annotations

import os
import re
import sys
from typing import Dict

from conformance.reproducers import writer
from tests.meta_zoos import NOT_REACH
from tests.meta_helpers import REPO, BackgroundJob, SuiteRun, run_suite


def _block(readme: str, heading: str) -> str:
    """The Python code block of the manual that opens with the comment line ``# heading``: exactly one."""
    found = re.findall(rf"```python\n# {re.escape(heading)}\n(.*?)```", readme, re.S)
    assert len(found) == 1, (heading, len(found))
    return found[0]


def _manual() -> str:
    """README.md, then every page of docs/: where the example's blocks are shown."""
    docs = os.path.join(REPO, "docs")
    pages = [os.path.join(REPO, "README.md")] + [os.path.join(docs, n) for n in sorted(os.listdir(docs))
                                                 if n.endswith(".md")]
    return "\n".join(open(p, encoding="utf-8").read() for p in pages)


def test_readme_shows_the_example_modules_verbatim():
    readme = _manual()
    assert _block(open(os.path.join(REPO, "README.md")).read(), "examples/my_hooks.py")  # on the README itself
    for heading, name in (("examples/my_hooks.py", "my_hooks.py"), ("examples/my_specs.py", "my_specs.py"),
                          ("examples/my_ddp_hook.py", "my_ddp_hook.py"), ("examples/my_specs.py, below SPEC",
                                                                          "my_specs.py")):
        assert _block(readme, heading) in open(os.path.join(REPO, "examples", name)).read(), heading


def test_readme_keeps_hooks_apart_from_their_specs_so_a_reproducer_needs_only_torch(tmp_path, monkeypatch):
    """Issue 31: README's layout, copied into a package of one's own, gives specs whose reproducer imports only torch
    and the hook's module: the hook modules import nothing of the suite, the spec module imports them."""
    readme = _manual()
    package = tmp_path / "readme_layout_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for heading, name in (("examples/my_hooks.py", "my_hooks.py"), ("examples/my_ddp_hook.py", "my_ddp_hook.py")):
        (package / name).write_text(_block(readme, heading))
        assert not writer.imports_the_suite(f"readme_layout_pkg.{name[:-3]}"), heading
    (package / "my_specs.py").write_text(_block(readme, "examples/my_specs.py")
                                         + _block(readme, "examples/my_specs.py, below SPEC"))
    monkeypatch.syspath_prepend(str(tmp_path))
    from readme_layout_pkg import my_specs

    for spec in my_specs.SPECS:
        assert writer.needs_the_suite(spec, "readme_layout_pkg.my_specs:SPECS") is None, spec.name
        assert "from readme_layout_pkg.my_" in writer.reproducer_source(
            spec, "readme_layout_pkg.my_specs:SPECS", f"{spec.api}.parity", {"model": "net_flat"}, 2, "case", [],
            "header", "rerun", "/tmp/x.py")
    for name in ("my_hooks", "my_ddp_hook", "my_specs"):
        sys.modules.pop(f"readme_layout_pkg.{name}", None)
    sys.modules.pop("readme_layout_pkg", None)


def _example_run(runs: object, directory: str, env: Dict[str, str]) -> SuiteRun:
    return run_suite(["--hook", "conformance.examples.my_specs:SPEC", "--hypothesis-examples", "2", "-q",
                      "-k", f"not transformer_shared and not always_wrap_nested and not registration and {NOT_REACH}"],
                     os.path.join(directory, "example.xml"), cwd=directory, env=env)


def _ddp_example_run(runs: object, directory: str, env: Dict[str, str]) -> SuiteRun:
    return run_suite(["--hook", "conformance.examples.my_specs:DDP_SPEC", "-q", "-k", "test_ddp"],
                     os.path.join(directory, "ddp.xml"), cwd=directory, env=env)


#: Both runs start from a directory that is not the checkout, in the zoo runs' background threads.
EXAMPLE_RUN = BackgroundJob("readme_example", _example_run)
DDP_EXAMPLE_RUN = BackgroundJob("readme_ddp_example", _ddp_example_run)


def test_readme_example_conforms(zoo_runs):
    run = zoo_runs(EXAMPLE_RUN)
    assert run.returncode == 0, run.output[-4000:]
    assert run.cases and all(c.outcome == "passed" for c in run.cases)
    assert {c.check for c in run.cases} == {"averaging", "parity", "accumulation", "rank_consistency", "hard_inputs",
                                            "subgroup_parity", "clip_grad_norm", "clip_grad_norm_low_precision",
                                            "second_model"}


def test_readme_ddp_example_conforms(zoo_runs):
    run = zoo_runs(DDP_EXAMPLE_RUN)
    assert run.returncode == 0, run.output[-4000:]
    # the example names no native: DDP's default; its batched_grad_copy cases say how to be checked there
    batched = [c for c in run.cases if "-batched_grad_copy-" in c.name]
    assert len(batched) == 2 and all(c.outcome == "skipped" and "native_modes=" in c.message for c in batched)
    assert run.cases and all(c.outcome == "passed" for c in run.cases if c not in batched)
    assert {"averaging", "parity", "rank_consistency", "future_contract"} <= {c.check for c in run.cases}


def test_readme_first_screen_is_purpose_commands_summary_then_your_own_hook():
    """Issue 19: what the suite is for, the two commands, what the first summary means, how to check one's own
    hook, in that order, on the first screen; the summary's figures are those docs/speed.md measured."""
    readme = open(os.path.join(REPO, "README.md")).read()
    first_screen = "\n".join(readme.splitlines()[:60])
    headings = re.findall(r"^## (.+)$", first_screen, re.M)
    assert headings[:3] == ["The two commands", "What the first summary means", "Check your own hook"], headings
    intro = first_screen.split("\n## ", 1)[0]
    assert "gradient communication hooks" in intro and "bit for bit" in intro
    assert "make conform" in first_screen and "make test" in first_screen
    summary = first_screen.split("## What the first summary means", 1)[1].split("\n## ", 1)[0]
    for word in ("**passed**", "**xfailed**: known failures of PyTorch's own built-in hooks", "**skipped**"):
        assert word in summary, word
    counts = re.search(r"`(\d+) passed, (\d+) skipped, \d+ deselected, (\d+) xfailed`", summary).groups()
    speed = open(os.path.join(REPO, "docs", "speed.md")).read()
    assert f"({counts[0]} passed, {counts[1]} skipped, {counts[2]} xfailed)" in speed  # docs/speed.md's default run
    own = first_screen.split("## Check your own hook", 1)[1]
    assert "conform --hook conformance.examples.my_specs:SPEC" in own
