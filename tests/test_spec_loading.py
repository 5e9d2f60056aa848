"""Tests for conformance.shared.spec_loading: ``module:ATTR`` targets, entry points, and the CLI's usage errors.

Spec modules are written to ``tmp_path`` (put on ``sys.path``) or come from
``tests/data/``. Entry points are real: a ``*.dist-info`` directory on ``sys.path``
that ``importlib.metadata`` discovers the way it discovers an installed package.
The CLI tests only give inputs that fail before any rank process is spawned.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import expecttest
import pytest

from conformance.apis.fsdp import builtin_hooks as builtin_fsdp
from conformance.shared.spec_loading import BUILTIN_TARGETS, ENTRY_POINT_GROUP, entry_point_targets, load_specs, load_target
from conformance.spec import HookSpec
from conformance.signatures import SpecError
from tests.data import hooks as data_hooks

REPO = Path(__file__).resolve().parents[1]

SPEC_MODULE = """
from conformance.spec import HookSpec

def hook(state, grad):
    pass

SPEC = HookSpec(name={name!r}, api="fsdp", hook=hook, state=lambda pg: pg)
"""


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def write_module(module_dir, request):
    """Write a uniquely named module into a directory on sys.path; return its name."""

    def write(source: str) -> str:
        name = f"specmod_{uuid.uuid4().hex[:10]}"
        (module_dir / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        request.addfinalizer(lambda: sys.modules.pop(name, None))
        return name

    return write


def load_error(target: str) -> str:
    with pytest.raises(SpecError) as info:
        load_target(target)
    return str(info.value)


# -- load_target: what works -----------------------------------------------------------


def test_attr_naming_one_spec_gives_that_spec():
    assert load_target("tests.data.hooks:SPEC") == [data_hooks.SPEC]
    assert load_target("tests.data.hooks:SPEC")[0] is data_hooks.SPEC


def test_attr_naming_a_list_gives_its_specs_in_order():
    assert load_target("tests.data.hooks:SPECS") == data_hooks.SPECS
    assert load_target("tests.data.hooks:SPEC_TUPLE") == [data_hooks.SPEC]


def test_dotted_attr_is_followed(write_module):
    name = write_module(SPEC_MODULE.format(name="nested_hook") + "\nclass Holder:\n    INNER = SPEC\n")
    assert [s.name for s in load_target(f"{name}:Holder.INNER")] == ["nested_hook"]


# -- load_target: every way a target can be wrong ----------------------------------------


@pytest.mark.parametrize("target", ["tests.data.hooks", "tests.data.hooks:", ":SPEC", ""])
def test_malformed_target_shows_the_expected_form(target):
    message = load_error(target)
    assert repr(target) in message
    assert "package.module:ATTR" in message


def test_missing_module_says_to_install_it_or_use_pythonpath():
    message = load_error("no_such_hook_module_3f9c:SPEC")
    assert "'no_such_hook_module_3f9c:SPEC'" in message
    assert "No module named 'no_such_hook_module_3f9c'" in message
    assert "Install" in message and "PYTHONPATH" in message


def test_module_raising_on_import_reports_the_exception(write_module):
    name = write_module("raise RuntimeError('database not configured')\n")
    message = load_error(f"{name}:SPEC")
    assert f"'{name}:SPEC'" in message
    assert "RuntimeError: database not configured" in message


def test_module_with_a_broken_dependency_is_an_import_problem(write_module):
    name = write_module("import no_such_dependency_91ab\n")
    message = load_error(f"{name}:SPEC")
    assert "no_such_dependency_91ab" in message
    assert "PYTHONPATH" in message


def test_missing_attribute_lists_the_specs_the_module_does_define():
    message = load_error("tests.data.hooks:SPECZ")
    assert "'SPECZ'" in message
    defined = [n for n, v in vars(data_hooks).items()
               if isinstance(v, HookSpec) or (isinstance(v, (list, tuple)) and v
                                              and all(isinstance(x, HookSpec) for x in v))]
    assert sorted(defined) == ["SPEC", "SPECS", "SPEC_TUPLE"]
    for attr in defined:
        assert attr in message
    # Attributes that are not specs are not offered as alternatives.
    for not_spec in ("NOT_A_SPEC", "MIXED", "EMPTY", "NUMBER", "make_state"):
        assert not_spec not in message


def test_missing_attribute_in_a_module_without_specs_offers_nothing(write_module):
    name = write_module("VALUE = 1\n")
    message = load_error(f"{name}:SPEC")
    assert "has no attribute 'SPEC'" in message
    assert "defines HookSpecs" not in message


@pytest.mark.parametrize("attr, described", [
    ("NOT_A_SPEC", "the callable two_arg_hook"),
    ("MIXED", "list holding str"),
])
def test_object_that_is_not_a_spec_is_refused_with_what_it_is(attr, described):
    message = load_error(f"tests.data.hooks:{attr}")
    assert described in message
    assert "HookSpec(name=" in message  # shows how to wrap the hook


def test_spec_error_raised_while_importing_names_the_target(write_module):
    name = write_module(SPEC_MODULE.format(name="ok").replace('api="fsdp"', 'api="horovod"'))
    message = load_error(f"{name}:SPEC")
    assert f"'{name}:SPEC'" in message
    assert "unknown api 'horovod'" in message  # the HookSpec's own message is kept


def test_empty_spec_list_offers_no_hooks_but_a_run_needs_some():
    """A package may offer no specs on some torch versions; a run with none at all is an error."""
    assert load_target("tests.data.hooks:EMPTY") == []
    with pytest.raises(SpecError, match="no hooks to test"):
        load_specs(["tests.data.hooks:EMPTY"], builtins=False, entry_points=False)


class TestMessageShapes(expecttest.TestCase):
    """The exact text users see for the commonest mistakes."""

    def test_bare_hook_function_given_as_target(self):
        with self.assertRaises(SpecError) as ctx:
            load_target("tests.data.hooks:NOT_A_SPEC")
        self.assertExpectedInline(str(ctx.exception), """\
hook target 'tests.data.hooks:NOT_A_SPEC' is the callable two_arg_hook, not a HookSpec or a list of HookSpecs. \
Wrap your hook: SPEC = HookSpec(name='my_hook', api='fsdp', hook=my_hook, state=make_state, reduce_dtype=None)""")

    def test_misspelled_attribute(self):
        with self.assertRaises(SpecError) as ctx:
            load_target("tests.data.hooks:SPECZ")
        self.assertExpectedInline(str(ctx.exception), """\
hook target 'tests.data.hooks:SPECZ': module 'tests.data.hooks' has no attribute 'SPECZ'. \
It defines HookSpecs under: SPEC, SPECS, SPEC_TUPLE.""")


# -- load_specs ----------------------------------------------------------------------------


def test_duplicate_names_across_targets_name_both_targets(write_module):
    first = write_module(SPEC_MODULE.format(name="shared_name"))
    second = write_module(SPEC_MODULE.format(name="shared_name"))
    with pytest.raises(SpecError) as info:
        load_specs([f"{first}:SPEC", f"{second}:SPEC"], builtins=False, entry_points=False)
    message = str(info.value)
    assert "'shared_name'" in message
    assert f"'{first}:SPEC'" in message and f"'{second}:SPEC'" in message
    assert "rename" in message


def test_user_spec_named_like_a_builtin_clashes_only_with_builtins_on(write_module):
    name = write_module(SPEC_MODULE.format(name="allreduce_hook"))
    assert [s.spec.name for s in load_specs([f"{name}:SPEC"], builtins=False, entry_points=False)] == ["allreduce_hook"]
    with pytest.raises(SpecError) as info:
        load_specs([f"{name}:SPEC"], builtins=True, entry_points=False)
    assert "built-in" in str(info.value) and "--hook" in str(info.value)


def test_builtins_on_come_first_and_are_pytorchs_hooks():
    loaded = load_specs(["tests.data.hooks:SPEC"], builtins=True, entry_points=False)
    builtin_names = [s.name for target in BUILTIN_TARGETS for s in load_target(target)]
    assert set(s.name for s in builtin_fsdp.FSDP_HOOKS) <= set(builtin_names)
    assert [item.spec.name for item in loaded] == builtin_names + ["data_two"]
    assert {item.origin for item in loaded[:len(builtin_names)]} == {"built-in"}
    assert loaded[-1].origin == "--hook"
    assert loaded[-1].target == "tests.data.hooks:SPEC"


def test_builtins_off_loads_only_the_given_targets():
    loaded = load_specs(["tests.data.hooks:SPECS"], builtins=False, entry_points=False)
    assert [item.spec for item in loaded] == data_hooks.SPECS
    assert all(item.target == "tests.data.hooks:SPECS" for item in loaded)


def test_the_same_target_twice_is_loaded_once():
    loaded = load_specs(["tests.data.hooks:SPEC", "tests.data.hooks:SPEC"], builtins=False, entry_points=False)
    assert [item.spec.name for item in loaded] == ["data_two"]


def test_nothing_to_test_is_an_error():
    with pytest.raises(SpecError, match="no hooks to test"):
        load_specs([], builtins=False, entry_points=False)


def test_first_bad_target_stops_loading():
    with pytest.raises(SpecError, match="tests.data.hooks:MIXED"):
        load_specs(["tests.data.hooks:SPEC", "tests.data.hooks:MIXED"], builtins=False, entry_points=False)


# -- entry points ------------------------------------------------------------------------------


@pytest.fixture
def installed_plugin(module_dir, write_module):
    """A package 'installed' as a dist-info directory that offers one spec through the group."""
    module = write_module(SPEC_MODULE.format(name=f"ep_hook_{uuid.uuid4().hex[:6]}"))
    dist_name = f"conform_test_plugin_{module[-10:]}"
    dist_info = module_dir / f"{dist_name}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nmy_hooks = {module}:SPEC\n\n"
        f"[some.other.group]\nunrelated = {module}:OTHER\n")
    importlib.invalidate_caches()
    return module


def test_entry_point_targets_sees_the_group_and_only_it(installed_plugin):
    targets = entry_point_targets()
    assert f"{installed_plugin}:SPEC" in targets
    assert f"{installed_plugin}:OTHER" not in targets
    assert targets == sorted(targets)


def test_load_specs_with_entry_points_loads_the_installed_spec(installed_plugin):
    loaded = load_specs([], builtins=False, entry_points=True)
    mine = [item for item in loaded if item.target == f"{installed_plugin}:SPEC"]
    assert len(mine) == 1
    assert mine[0].spec.name.startswith("ep_hook_")
    assert ENTRY_POINT_GROUP in mine[0].origin


def test_load_specs_without_entry_points_ignores_the_installed_spec(installed_plugin):
    loaded = load_specs(["tests.data.hooks:SPEC"], builtins=False, entry_points=False)
    assert all(item.target != f"{installed_plugin}:SPEC" for item in loaded)


def test_target_given_with_hook_and_as_entry_point_is_loaded_once(installed_plugin):
    target = f"{installed_plugin}:SPEC"
    loaded = load_specs([target], builtins=False, entry_points=True)
    assert [item.origin for item in loaded if item.target == target] == ["--hook"]


# -- the conform command: bad hook input is a usage error (exit 4) ------------------------


def _conform_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_")}
    env.pop("PYTEST_ADDOPTS", None)
    return env


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Run the conform invocations below in parallel (each exits before spawning ranks)."""
    report = tmp_path_factory.mktemp("reports") / "conformance.xml"
    previous = b'<?xml version="1.0" encoding="utf-8"?>\n<testsuites><testsuite name="pytest" tests="212" ' \
               b'failures="0"/></testsuites>\n'
    report.write_bytes(previous)
    invocations = {
        # One run serves two tests: the usage error itself, and the report it must not touch.
        "missing_module": ["--hook", "no_such_hook_module_3f9c:SPEC", f"--junitxml={report}"],
        "duplicate": ["--hook", "tests.data.dup_names:SPECS"],
        "mismatched": ["--hook", "tests.data.mismatched_api:SPEC"],
    }
    procs = {key: subprocess.Popen([sys.executable, "-m", "conformance", *args], cwd=REPO, env=_conform_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for key, args in invocations.items()}
    results = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            results[key] = (proc.returncode, out + err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results["report"] = (report, previous)
    return results


@pytest.mark.cli
def test_cli_unknown_hook_module_exits_4_with_the_spec_error(cli):
    rc, output = cli["missing_module"]
    assert rc == 4, output
    assert load_error("no_such_hook_module_3f9c:SPEC") in output


@pytest.mark.cli
def test_cli_duplicate_hook_names_exit_4(cli):
    rc, output = cli["duplicate"]
    with pytest.raises(SpecError) as info:
        load_specs(["tests.data.dup_names:SPECS"], builtins=False, entry_points=False)
    assert rc == 4, output
    assert str(info.value) in output
    assert "'twin'" in output


@pytest.mark.cli
def test_cli_a_hook_that_does_not_fit_its_api_exits_4_naming_the_api_it_fits(cli):
    """Issue 48: a DDP hook given api='fsdp' ran 33.7 s and failed 27 cases on 'Tensor' object has no attribute
    'buffer'; it is refused at load, before any rank starts."""
    rc, output = cli["mismatched"]
    assert rc == 4, output
    assert "'ddp_hook_as_fsdp'" in output and "it fits api='ddp'" in output, output


@pytest.mark.cli
def test_cli_bad_hook_leaves_an_existing_junit_report_untouched(cli):
    rc, output = cli["missing_module"]
    report, previous = cli["report"]
    assert rc == 4, output
    assert report.read_bytes() == previous


def test_pythonpath_to_rerun_keeps_the_entries_modules_came_from(tmp_path):
    """The re-run command's PYTHONPATH: entries that provided a module, in PYTHONPATH order, made absolute;
    the working directory and entries that provided nothing are left out."""
    from types import SimpleNamespace

    from conformance.shared.spec_loading import pythonpath_to_rerun

    hooks, deps, unused, cwd = (str(tmp_path / d) for d in ("hooks", "deps", "unused", "cwd"))
    modules = {
        "my_hooks.ddp": SimpleNamespace(__file__=os.path.join(hooks, "my_hooks", "ddp.py")),
        "shared_utils": SimpleNamespace(__path__=[os.path.join(deps, "shared_utils")]),  # a namespace package
        "local_models": SimpleNamespace(__file__=os.path.join(cwd, "local_models.py")),
        "builtins_like": SimpleNamespace(),
        "prefix_trap": SimpleNamespace(__file__=hooks + "_other/x.py"),  # shares a prefix, not the directory
    }
    pythonpath = os.pathsep.join([deps, unused, cwd, hooks, deps, ""])
    assert pythonpath_to_rerun(cwd=cwd, pythonpath=pythonpath, modules=modules) == (deps, hooks)
    assert pythonpath_to_rerun(cwd=cwd, pythonpath="", modules=modules) == ()
    rel = os.path.relpath(hooks)
    assert pythonpath_to_rerun(cwd=cwd, pythonpath=rel, modules=modules) == (hooks,)
