"""FSDP2's registration rules (``apis/fsdp2_common/registration_rules.py``): planned, kept, and broken on purpose.

The plan gives each FSDP2 hook API its rules once per hook at one world size, and skips them with the torch
version where torch lacks what a rule needs. Three runs in the background:

* PyTorch's built-in FSDP2 hooks and the FSDP2 zoo's good ones keep every rule (``GOOD_RUN``);
* a run whose ranks see a changed PyTorch and a wrong registration (``BROKEN_RUN``, a ``sitecustomize``
  module): ``set_custom_reduce_scatter`` that recurses into child FSDP modules and accepts a module of several
  parameter groups (the comm's failures must say "PyTorch changed"), and the suite's registration of
  ``set_all_reduce_hook`` on the root alone, the classic misuse (the hooks' failures must name it, and the
  suite's registration, never the hook);
* one rank builds a module of several parameter groups and prints the suite's refusal (``REFUSAL``): it names
  the module's FQN, the setter, PyTorch's message and the fix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conformance.apis.fsdp2_common.plan import HSDP_STREAM_RULE, HSDP_WORLD_SIZE, REGISTRATION_RULES
from conformance.apis.registry import planned_cases
from conformance.spec import HookSpec
from tests.meta_helpers import REPO, BackgroundJob, plan_settings, run_suite
from tests.zoo import fsdp2_comms as zoo

#: Each FSDP2 API's registration test, its variant and its rules.
TESTS = {
    "test_fsdp2_registration": ("fsdp2", "default", REGISTRATION_RULES),
    "test_fsdp2_all_reduce_registration": ("fsdp2_all_reduce", "hsdp", REGISTRATION_RULES + (HSDP_STREAM_RULE,)),
    "test_fsdp2_replica_registration": ("fsdp2_replica", "replica", REGISTRATION_RULES),
}


def _specs():
    """One good spec per FSDP2 API, from the zoo."""
    return [next(s for s in zoo.KNOWN_GOOD if s.api == api) for api, _, _ in TESTS.values()]


# -- the plan ------------------------------------------------------------------------------------------------


def test_each_fsdp2_api_plans_every_rule_once_per_hook_at_one_world_size():
    settings = plan_settings(2, 3)
    for test, (api, variant, rules) in TESTS.items():
        cases = planned_cases(test, _specs(), settings)
        spec = next(s for s in _specs() if s.api == api)
        assert [c.rule for c in cases] == list(rules), test
        assert {(c.hook, c.variant, c.api) for c in cases} == {(spec.name, variant, api)}, test
        assert {c.world_size for c in cases} == {2 if api == "fsdp2" else HSDP_WORLD_SIZE}, test
        assert all(c.skip is None for c in cases), [c.skip for c in cases]
        assert [c.id for c in cases] == [f"{spec.name}-{variant}-{rule}" for rule in rules]


def test_a_lossy_comm_keeps_the_registration_rules():
    lossy = next(s for s in zoo.LOSSY if s.api == "fsdp2")
    assert len(planned_cases("test_fsdp2_registration", [lossy], plan_settings(2, 3))) == len(REGISTRATION_RULES)


def test_a_torch_without_per_parameter_meshes_skips_that_rule_saying_so(monkeypatch):
    """Older torch (no ``ShardPlacementResult``) cannot give a module several parameter groups."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    monkeypatch.delattr(_fsdp_common, "ShardPlacementResult")
    for test in TESTS:
        cases = planned_cases(test, _specs(), plan_settings(2, 3))
        skipped = {c.rule: c.skip for c in cases if c.skip}
        assert list(skipped) == ["multiple_param_groups_raise"], test
        assert skipped["multiple_param_groups_raise"].startswith(f"torch {torch.__version__} has no "
                                                                  "ShardPlacementResult"), skipped


def test_a_torch_without_the_setter_skips_every_rule_saying_so(monkeypatch):
    import torch
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    cases = planned_cases("test_fsdp2_registration", _specs(), plan_settings(2, 3))
    assert cases and all(c.skip == f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter "
                                   "(FSDP2 API added in a later torch)" for c in cases), [c.skip for c in cases]
    assert all(c.skip is None for c in planned_cases("test_fsdp2_all_reduce_registration", _specs(),
                                                     plan_settings(2, 3)))


# -- the runs -----------------------------------------------------------------------------------------------

REGISTRATION = "registration and fsdp2"


def _good_run(runs, directory, env):
    return run_suite(["--hook", "tests.zoo.fsdp2_comms:KNOWN_GOOD", "--with-builtins", "--extra-world-size", "4",
                      "-q", "-k", REGISTRATION], os.path.join(directory, "good.xml"), timeout=600, env=env)


#: In every process of the run: FSDP2's comm setter recurses into child FSDP modules and takes a module of several
#: parameter groups (a PyTorch that changed), and the suite's registration of an all-reduce hook is the root's alone.
BROKEN = textwrap.dedent("""
    import conformance.apis.fsdp2_common.registration as registration
    from torch.distributed.fsdp import FSDPModule


    def _recursing(self, comm):
        for module in self.modules():
            if isinstance(module, FSDPModule):
                for group in registration.param_groups(module):
                    group._reduce_scatter_comm = comm


    FSDPModule.set_custom_reduce_scatter = _recursing
    _suites = registration.register_on_every_module


    def _root_only(model, setter, hook):
        if setter != "set_all_reduce_hook":
            return _suites(model, setter, hook)
        getattr(model, setter)(hook)
        return 1


    registration.register_on_every_module = _root_only
""")
BROKEN_HOOKS = ("plain_reduce_scatter", "good_observer_hook", "replica_avg_all_reduce")


def _broken_run(runs, directory, env):
    with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
        f.write(BROKEN)
    pick = " or ".join(f"{hook}-" for hook in BROKEN_HOOKS)
    return run_suite(["--hook", "tests.zoo.fsdp2_comms:KNOWN_GOOD", "--with-builtins", "--extra-world-size", "4",
                      "-q", "-k", f"{REGISTRATION} and ({pick})"], os.path.join(directory, "broken.xml"),
                     timeout=600, pythonpath=[directory], env=env)


#: One rank (gloo), a module of several parameter groups, the suite's refusal for each setter, as JSON.
REFUSAL_SCRIPT = textwrap.dedent("""
    import json, os, sys, types
    import torch, torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.join(sys.argv[1], "store"), rank=0, world_size=1)
    from conformance.apis.fsdp2_common import registration
    from conformance.apis.fsdp2_common.build import mesh_for, several_groups_model

    ctx = types.SimpleNamespace(rank=0, world_size=1, group=dist.group.WORLD, device=torch.device("cpu"),
                                phase=lambda text: None)
    out = {}
    for setter in ("set_custom_reduce_scatter", "set_all_reduce_hook"):
        model = several_groups_model(ctx, mesh_for(ctx, (1,)), None)
        try:
            registration.register_on_every_module(model, setter, lambda *args, **kwargs: None)
        except registration.RegistrationRefused as exc:
            out[setter] = {"message": str(exc), "cause": type(exc.__cause__).__name__ + ": " + str(exc.__cause__),
                           "is_value_error": isinstance(exc, ValueError)}
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def _refusal(runs, directory, env):
    env = dict(env, PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", REFUSAL_SCRIPT, directory], env=env, cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc.returncode, proc.stdout


GOOD_RUN = BackgroundJob("fsdp2_registration_good", _good_run)
BROKEN_RUN = BackgroundJob("fsdp2_registration_broken", _broken_run)
REFUSAL = BackgroundJob("fsdp2_registration_refusal", _refusal)


def test_pytorchs_and_the_zoos_good_hooks_keep_every_rule(zoo_runs):
    run = zoo_runs(GOOD_RUN)
    assert run.returncode == 0, run.output[-3000:]
    by_test = {}
    for case in run.cases:
        assert case.outcome == "passed", (case.name, case.message[:2000])
        by_test.setdefault(case.name.split("[")[0], set()).add(case.properties["rule"])
    assert by_test == {test: set(rules) for test, (_, _, rules) in TESTS.items()}
    good = {s.name for s in zoo.KNOWN_GOOD} | {"plain_reduce_scatter", "plain_reduce_scatter_bf16",
                                               "plain_reduce_scatter_fp16", "replica_avg_all_reduce",
                                               "replica_avg_all_reduce_bf16"}
    assert set(run.by_hook()) == good


def _cases(run, hook):
    return {c.properties["rule"]: c for c in run.by_hook()[hook]}


def test_a_pytorch_change_skips_as_pytorchs_not_the_hooks(zoo_runs):
    """The comm setter that recurses and takes several parameter groups: the comm's rules say PyTorch changed, and
    the cases are skipped with that reason (as a reference that does not hold here is), not failed: the hook's
    verdict is never PyTorch's."""
    run = zoo_runs(BROKEN_RUN)
    cases = _cases(run, "plain_reduce_scatter")
    assert cases["unset_before_registration"].outcome == "passed"
    reaches, several = cases["reaches_every_param_group"], cases["multiple_param_groups_raise"]
    for case in (reaches, several):
        assert case.outcome == "skipped", case.name
        assert "not_run" not in case.properties, case.message[:2000]
        assert "PyTorch changed (torch " in case.message and "so this is not the hook's failure" in case.message
    assert not any(c.outcome == "failed" for c in run.cases), [c.name for c in run.cases if c.outcome == "failed"]
    assert re.search(r"plain_reduce_scatter +CONFORMS", run.output), run.output[-3000:]
    assert ("set_custom_reduce_scatter called on the root alone reached the children's parameter groups (group 0 of "
            "'module.1'") in reaches.message, reaches.message[:2000]
    assert ("FSDPModule.set_custom_reduce_scatter on FSDP module 'module', whose 2 parameter groups are on different "
            "meshes (shard_placement_fn), did not raise; torch 2.13 raises ValueError matching "
            "'^set_custom_reduce_scatter is not supported with multiple param groups'") in several.message, \
        several.message[:2000]


@pytest.mark.parametrize("hook", ["good_observer_hook", "replica_avg_all_reduce"])
def test_a_registration_on_the_root_alone_is_caught_as_the_classic_misuse(zoo_runs, hook):
    """The suite's registration of an all-reduce hook on the root alone: named, and blamed on the suite: the cases are
    NOT RUN (the run's failure, exit 10), never the hook's."""
    run = zoo_runs(BROKEN_RUN)
    cases = _cases(run, hook)
    assert {rule for rule, c in cases.items() if c.outcome == "passed"} == \
        {"unset_before_registration"} | ({HSDP_STREAM_RULE} if hook == "good_observer_hook" else set())
    assert run.returncode == 10, run.output[-3000:]
    assert re.search(rf"{hook} +NOT RUN \(a rule that holds whatever the hook is, and that the suite's other checks "
                     "rely on, fails here: after the suite's registration", run.output), run.output[-3000:]
    for rule in ("reaches_every_param_group", "multiple_param_groups_raise"):
        assert cases[rule].outcome == "skipped" and "not_run" in cases[rule].properties, cases[rule].message
    reaches, several = cases["reaches_every_param_group"].message, cases["multiple_param_groups_raise"].message
    assert "the parameter groups (group 0 of 'module.1', group 0 of 'module.1.0', group 0 of 'module.2') hold None, " \
           "not the all-reduce hook under test" in reaches, reaches[:2000]
    assert "Registering on the root alone is the classic misuse: FSDPModule.set_all_reduce_hook does not recurse" \
        in reaches
    assert "this is the suite's registration, or PyTorch changed, not the hook's failure" in reaches
    assert "whose FSDP module 'module' has 2 parameter groups did not raise, where it must raise RegistrationRefused" \
        in several, several[:2000]
    assert "PyTorch changed (torch" not in reaches + several


def test_the_suites_refusal_names_the_module_the_setter_pytorchs_message_and_the_fix(zoo_runs):
    code, output = zoo_runs(REFUSAL)
    assert code == 0, output[-3000:]
    refusals = json.loads(output.strip().splitlines()[-1])
    assert set(refusals) == {"set_custom_reduce_scatter", "set_all_reduce_hook"}
    for setter, refusal in refusals.items():
        message = refusal["message"]
        assert refusal["is_value_error"] and refusal["cause"].startswith(
            f"ValueError: {setter} is not supported with multiple param groups (from per-param mesh via "
            "shard_placement_fn)"), refusal
        assert message.startswith(f"FSDPModule.{setter} on FSDP module 'module' raised {refusal['cause']} The module "
                                  "has 2 parameter groups"), message
        assert "group 1: module.2.weight, module.2.bias (a shard group of 1 rank)" in message, message
        assert "Fix: give those parameters an FSDP module of their own, fully_shard(the submodule that holds them, " \
               "mesh=their mesh) before fully_shard on 'module'" in message, message


def test_an_unknown_rule_names_the_known_ones():
    from conformance.apis.fsdp2_common.registration import REDUCE_SCATTER
    from conformance.apis.fsdp2_common.registration_rules import check_rule

    spec = HookSpec(name="c", api="fsdp2", hook=zoo.KNOWN_GOOD[0].hook)
    ctx = type("Ctx", (), {"phase": lambda self, text: None})()
    with pytest.raises(ValueError, match="unknown registration rule 'x'; known: unset_before_registration, "
                                         "reaches_every_param_group, multiple_param_groups_raise, "
                                         "stream_under_hsdp_raises"):
        check_rule(ctx, spec, REDUCE_SCATTER, None, None, "x")
