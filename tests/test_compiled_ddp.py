"""DDP under compiled autograd (``--with-compiled-ddp``): the ``compiled_autograd`` config of ``test_ddp_parity``.

Without a run: the default run plans no such case; with the option, every exact DDP hook gets one
at each world size, run only where its spec says ``compiled_ddp=True`` and otherwise skipped with the
reason (PyTorch's own hooks take a ``GradBucket``, or run in the C++ Reducer that compiled DDP
bypasses), and the texts the rank side builds.

With a run (``COMPILED_RUN``, in the zoo runs' background threads): the zoo
``tests/zoo/ddp_compiled_hooks.py`` under ``--with-compiled-ddp -k compiled``. Each case compiles
(``torch.compile``, backend ``aot_eager``) a reference and a hooked model, seconds each on a CPU, so
the run takes a few minutes on 2 cores: the good hooks pass at 2 and 3 ranks, each bad one fails
where ``EXPECTED`` says with the text it names, and the hooks not declared for it are skipped.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Tuple

import pytest
import torch
import torch.distributed as dist  # noqa: F401 - named in an annotation below

from conformance import HookSpec
from conformance.apis.ddp import plan as ddp_plan
from conformance.apis.ddp.builtin_hooks import DDP_HOOKS
from conformance.apis.ddp.compiled import convention_error, registration_refused
from conformance.apis.ddp.plan import GRADBUCKET_NOTE
from conformance.apis.ddp.plan import COMPILED_NOT_DECLARED
from conformance.signatures import SpecError
from conformance.apis.registry import planned_cases
from tests.meta_helpers import BackgroundJob, SuiteRun, plan_settings, run_suite
from tests.zoo import ddp_compiled_hooks as zoo

CONFIG = "compiled_autograd"


def _compiled_cases(specs, *, flag: bool):
    settings = dataclasses.replace(plan_settings(), with_compiled_ddp=flag)
    return [c for c in planned_cases("test_ddp_parity", specs, settings) if c.variant == CONFIG]


# -- the plan, without a run ---------------------------------------------------------------------------------

def test_without_the_option_no_compiled_case_is_planned():
    assert _compiled_cases(DDP_HOOKS + zoo.ALL, flag=False) == []


def test_with_the_option_every_exact_hook_gets_one_case_per_world_size():
    cases = _compiled_cases(zoo.ALL, flag=True)
    assert sorted((c.hook, c.world_size) for c in cases) == sorted((s.name, ws) for s in zoo.ALL for ws in (2, 3))
    assert {c.model for c in cases} == {"nested_wrapped"} and {c.check for c in cases} == {"parity"}
    skipped = {c.hook: c.skip for c in cases if c.skip}
    assert skipped == {"annotated_gradbucket_hook": GRADBUCKET_NOTE, "eager_unannotated_mean": COMPILED_NOT_DECLARED}


def test_only_a_spec_that_says_compiled_ddp_runs_there_whatever_its_annotations():
    """Issue 31: README's DDP example, a right GradBucket hook with no annotation, failed compiled parity with
    'tuple' object has no attribute 'buffer'. A hook runs under compiled DDP only where its spec says it takes
    that convention; README's example is skipped with the reason, which names the field."""
    from conformance.examples.my_specs import DDP_SPEC

    cases = _compiled_cases([DDP_SPEC], flag=True)
    assert len(cases) == 2 and all(c.skip == COMPILED_NOT_DECLARED for c in cases)
    assert "compiled_ddp=True" in COMPILED_NOT_DECLARED
    declared = HookSpec(name="declared", api="ddp", hook=DDP_SPEC.hook, state=DDP_SPEC.state, compiled_ddp=True)
    assert [c.skip for c in _compiled_cases([declared], flag=True)] == [None, None]


def test_compiled_ddp_is_for_ddp_specs_only():
    with pytest.raises(SpecError, match="True only with api='ddp' \\(this spec's api is 'fsdp'\\)"):
        HookSpec(name="x", api="fsdp", hook=lambda state, grad: None, state=lambda pg: pg, compiled_ddp=True)


def test_pytorchs_own_hooks_are_skipped_with_the_reason_not_failed():
    """PyTorch's hooks take a GradBucket (or run in the C++ Reducer): no compiled case of theirs runs; lossy ones
    get none, as they get no other exact case."""
    cases = _compiled_cases(DDP_HOOKS, flag=True)
    # A sampled spec (a parameter-dtype claim in the default run) runs its first config alone, not this one.
    exact = {s.name for s in DDP_HOOKS if s.lossy is None and s.sample_checks is None}
    assert {c.hook for c in cases} == exact and all(c.skip for c in cases)
    reasons = {c.hook: c.skip for c in cases}
    assert reasons["ddp_allreduce_hook"] == GRADBUCKET_NOTE
    assert reasons["ddp_fp16_compress_wrapper_allreduce"] == GRADBUCKET_NOTE
    assert "C++ Reducer, which compiled DDP's python reducer bypasses" in reasons["ddp_cpp_allreduce"]


def test_a_torch_without_the_python_reducer_skips_with_its_version(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    monkeypatch.delattr(DistributedDataParallel, "_register_accum_grad_hook")
    cases = _compiled_cases(zoo.KNOWN_GOOD, flag=True)
    assert cases and all("has no python reducer" in c.skip and "torch " in c.skip for c in cases)


def test_a_reduced_precision_claim_is_skipped_with_the_reason():
    spec = HookSpec(name="claims_fp16", api="ddp", hook=zoo.good_div_then_sum, state=zoo.process_group_state,
                    reduce_dtype=torch.float16, compiled_ddp=True)
    cases = _compiled_cases([spec], flag=True)
    assert len(cases) == 2 and all("no reduced-precision native" in c.skip for c in cases)


def test_gradbucket_annotations_count_as_classes_and_as_strings():
    def as_string(state, bucket: "dist.GradBucket"):
        pass

    def returns_future(state, bucket) -> "torch.futures.Future[torch.Tensor]":
        pass

    assert ddp_plan.takes_grad_bucket(zoo.annotated_gradbucket_hook)
    assert ddp_plan.takes_grad_bucket(as_string) and ddp_plan.takes_grad_bucket(returns_future)
    assert not ddp_plan.takes_grad_bucket(zoo.bad_gradbucket_unannotated)
    assert not ddp_plan.takes_grad_bucket(zoo.good_div_then_sum)


def test_the_calling_convention_is_read_off_the_hooks_exception():
    def raised(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return exc
        raise AssertionError("did not raise")

    bucket_call = raised(lambda: zoo.bad_gradbucket_unannotated(None, (1, 2)))
    assert convention_error(bucket_call).startswith(f"{GRADBUCKET_NOTE} once per parameter")
    assert "bucket.buffer()" in convention_error(bucket_call)
    as_tensor = raised(lambda: (1, 2).div_(2))
    assert "fits neither calling convention" in convention_error(as_tensor)
    assert convention_error(RuntimeError("NCCL timeout")) is None


def test_no_pytorch_hook_is_replayed_under_compiled_ddp():
    """PyTorch's own hooks take a GradBucket: none is a default hook to replay a compiled case with."""
    from conformance.apis.registry import HOOK_APIS
    from conformance.controller import default_replay

    api, spec = HOOK_APIS["ddp"], zoo.KNOWN_GOOD[0]
    assert default_replay.default_hook_name(api, spec, {"config": CONFIG}, 2) is None
    assert default_replay.default_hook_name(api, spec, {"config": "default"}, 2) == "ddp_allreduce_hook"


def test_a_refused_registration_names_the_bucket_parameter():
    text = registration_refused(zoo.bad_second_param_misnamed, KeyError("bucket"))
    assert "bad_second_param_misnamed(state, grad_and_param)" in text and "named bucket" in text


# -- the zoo run ---------------------------------------------------------------------------------------------

#: The world sizes the zoo run checks each hook at: both for the eager order, whose verdict depends on the world
#: size (at 3 ranks x 1/3 and / 3 round apart), 3 for the good hook beside it there (at 2 ranks
#: good_functional_like_native is the good hook that passes), 2 elsewhere (each compiled case costs seconds of CPU,
#: and the plan tests above show every hook gets both).
RUN_AT = {"good_div_then_sum": (3,), "bad_eager_order": (2, 3)}


def _sizes(hook: str) -> Tuple[int, ...]:
    return RUN_AT.get(hook, (2,))


def _compiled_run(runs: object, directory: str, env: Dict[str, str]) -> SuiteRun:
    at_two = " or ".join(f"{s.name}-" for s in zoo.ALL if _sizes(s.name) == (2,))
    at_three = " or ".join(f"{s.name}-" for s in zoo.ALL if _sizes(s.name) == (3,))
    return run_suite(["--hook", "tests.zoo.ddp_compiled_hooks:ALL", "--with-compiled-ddp", "-k",
                      f"compiled and not (ws3 and ({at_two})) and not (ws2 and ({at_three}))", "-q", "--durations=0"],
                     os.path.join(directory, "compiled.xml"), timeout=900, env=env)


#: The run over the zoo, in the zoo runs' background threads (``tests/conftest.py``).
COMPILED_RUN = BackgroundJob("compiled_ddp", _compiled_run)


@pytest.fixture
def run(zoo_runs):
    return zoo_runs(COMPILED_RUN)


def _cases(run, hook):
    """The cases of ``hook`` (by test id: a case skipped when planned carries no JUnit properties)."""
    return [c for c in run.cases if c.name.startswith(f"test_ddp_parity[{hook}-{CONFIG}-")]


def test_every_zoo_case_is_a_compiled_one_and_none_crashed(run):
    assert run.cases and all(f"-{CONFIG}-" in c.name for c in run.cases), run.output[-3000:]
    assert run.returncode == 1, run.output[-3000:]
    for case in run.cases:
        assert "did not finish the case" not in case.message, f"{case.name}:\n{case.message[:3000]}"


@pytest.mark.parametrize("hook", [s.name for s in zoo.KNOWN_GOOD])
def test_good_hooks_pass(run, hook):
    cases = _cases(run, hook)
    assert sorted(c.name[-4:] for c in cases) == [f"ws{ws}]" for ws in _sizes(hook)]
    assert all(c.outcome == "passed" for c in cases), [c.message[-2000:] for c in cases if c.outcome != "passed"]


@pytest.mark.parametrize("hook", sorted(zoo.EXPECTED))
def test_bad_hooks_fail_where_expected_with_the_text_that_says_why(run, hook):
    sizes, needle = zoo.EXPECTED[hook]
    cases = _cases(run, hook)
    failed = {int(c.properties["world_size"]) for c in cases if c.outcome == "failed"}
    assert failed == set(sizes) & set(_sizes(hook)), [(c.name, c.outcome) for c in cases]
    for case in cases:
        if case.outcome == "failed":
            assert needle in case.message, case.message[-3000:]
            assert "--with-compiled-ddp" in case.message  # the re-run command keeps the option
        else:
            assert case.outcome == "passed", case.message[-2000:]


def test_eager_ddps_order_is_named_as_such_and_passes_at_two_ranks(run):
    """x 1/N then SUM is eager DDP's native: at 3 ranks the failure names it and says to divide instead."""
    cases = {c.properties["world_size"]: c for c in _cases(run, "bad_eager_order")}
    assert cases["2"].outcome == "passed"
    assert "fix: divide (grad.div_(3)), not multiply by 1/3" in cases["3"].message


def test_a_hook_that_returns_its_result_is_told_it_must_write_in_place(run):
    for case in _cases(run, "bad_returns_value"):
        assert "keeps only what it leaves in grad (bucket[0], which is param.grad)" in case.message
        assert "never communicated" not in case.message and "equals native's arithmetic" not in case.message


@pytest.mark.parametrize("hook, reason", [("annotated_gradbucket_hook", GRADBUCKET_NOTE),
                                          ("eager_unannotated_mean", COMPILED_NOT_DECLARED)])
def test_a_hook_not_declared_for_compiled_ddp_is_skipped_with_the_reason(run, hook, reason):
    cases = _cases(run, hook)
    assert len(cases) == len(_sizes(hook)) and all(c.outcome == "skipped" and reason in c.message for c in cases)
