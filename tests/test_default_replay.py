"""A failure that any hook would get is a skip, never a red; a hook whose difference is its own still fails.

Three layers: the rules of ``conformance.controller.default_replay`` on findings; the
runner's decisions on scripted rank outcomes (no process starts); and the suite
run as a user would, once on a contrived PyTorch whose FSDP1 ``clip_grad_norm_``
moves the total norm by one ULP whenever a comm hook is registered (patched into
every process of the run through ``sitecustomize``), once on torch as it is.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from packaging.version import Version

from conformance.controller import default_replay
from conformance.controller.across_ranks import findings_of
from conformance.apis.registry import HOOK_APIS
from conformance.shared.compare import compare_bitwise
from conformance.protocol import REFERENCE_DIGEST, CaseResult, CheckResult, Finding, RankOutcome
from conformance.controller.failures import ConformanceFailure
from conformance.controller.runner import Runner
from conformance.controller.settings import resolve
from conformance.spec import HookSpec
from conformance.shared.spec_loading import LoadedSpec, load_target
from tests.meta_helpers import run_suite

NORM = "total norm (norm_type=2.0)"


def norm_finding(rank: int, got: float, want: float = 15.549349, *, step: int = 0) -> Finding:
    mismatch = compare_bitwise(torch.tensor([got]), torch.tensor([want]))
    return Finding(rank, "total gradient norm differs from the native path", step=step, fqn=NORM, mismatch=mismatch)


def after_return(rank: int, step: int = 0) -> Finding:
    return Finding(rank, "the hook's own result equals native's arithmetic bit for bit in every call; what "
                         "differs arose after the hook returned", step=step, kind="native_result")


def below(x: float) -> float:
    """The float32 just below ``x``."""
    return float(torch.nextafter(torch.tensor(x), torch.tensor(0.0)))


ONE_ULP = below(15.549349)
#: A failure as torch 2.4.1 showed it: the total norm one ULP off, the hook's own result exact.
AFTER_RETURN = [norm_finding(0, ONE_ULP), norm_finding(1, ONE_ULP), after_return(0), after_return(1)]


# -- the rules ----------------------------------------------------------------------------------


def test_only_a_failure_that_names_no_cause_of_the_hooks_own_could_be_pytorchs():
    assert default_replay.could_be_pytorchs(AFTER_RETURN)
    assert default_replay.after_the_hook_returned(AFTER_RETURN)
    named = AFTER_RETURN[:2] + [Finding(0, "explained by: SUM without averaging", step=0, kind="diagnosis")]
    assert not default_replay.could_be_pytorchs(named)
    assert not default_replay.could_be_pytorchs([])
    no_diagnosis = AFTER_RETURN[:2]
    assert default_replay.could_be_pytorchs(no_diagnosis) and not default_replay.after_the_hook_returned(no_diagnosis)


def test_the_same_difference_means_the_same_place_and_the_same_values():
    assert default_replay.same_difference(AFTER_RETURN, list(reversed(AFTER_RETURN)))
    other_values = [norm_finding(0, below(ONE_ULP)), norm_finding(1, ONE_ULP)]
    assert not default_replay.same_difference(AFTER_RETURN, other_values)
    other_step = [norm_finding(0, ONE_ULP, step=1), norm_finding(1, ONE_ULP)]
    assert not default_replay.same_difference(AFTER_RETURN, other_step)
    one_more = AFTER_RETURN + [Finding(0, "gradient differs from the native path", step=0, fqn="fc.weight")]
    assert not default_replay.same_difference(one_more, AFTER_RETURN)
    assert not default_replay.same_difference(AFTER_RETURN, [])


@pytest.mark.parametrize("torch_version, strategy, found, covered", [
    ("2.4.1+cu121", "FULL_SHARD", AFTER_RETURN, True),
    ("2.4.1", "SHARD_GRAD_OP", AFTER_RETURN, True),
    ("2.5.0+cu124", "FULL_SHARD", AFTER_RETURN, False),  # fixed there: the failure is real
    ("2.4.1", "NO_SHARD", AFTER_RETURN, False),  # torch.nn.utils.clip_grad_norm_: a list, in order
    ("2.4.1", "FULL_SHARD", AFTER_RETURN[:2], False),  # no diagnosis: the hook's result may be wrong
    ("2.4.1", "FULL_SHARD", [norm_finding(0, 16.0), after_return(0)], False),  # far beyond a summation order
])
def test_the_set_order_caveat_covers_only_fsdp1_sharded_clipping_before_2_5(torch_version, strategy, found, covered):
    caveat = default_replay.caveat_for("fsdp.clip_grad_norm", {"strategy": strategy, "model": "nested_wrapped"},
                                       found, torch_version)
    assert (caveat is not None) == covered
    assert default_replay.caveat_for("fsdp.parity", {"strategy": strategy}, found, torch_version) is None


@pytest.mark.parametrize("api, reduce_dtype, params, world_size, name", [
    ("fsdp", None, {"strategy": "NO_SHARD"}, 3, "allreduce_hook"),
    ("fsdp", None, {"strategy": "FULL_SHARD"}, 3, "reduce_scatter_hook"),
    ("fsdp", torch.float16, {"strategy": "FULL_SHARD"}, 2, "fp16_compress_hook"),
    ("fsdp", torch.bfloat16, {"strategy": "FULL_SHARD", "low_precision_grads": True}, 2, "reduce_scatter_hook"),
    ("ddp", None, {"config": "default"}, 2, "ddp_allreduce_hook"),
    ("ddp", None, {"config": "default"}, 4, "ddp_allreduce_hook"),
    ("ddp", None, {"config": "default"}, 3, None),  # x / 3 is not native's x * (1/3)
    ("ddp", torch.float16, {"config": "default"}, 3, "ddp_fp16_compress_hook"),
    ("fsdp2", None, {"config": "default"}, 2, "plain_reduce_scatter"),
    ("fsdp2", torch.bfloat16, {"config": "default"}, 2, "plain_reduce_scatter_bf16"),
    ("fsdp2_all_reduce", None, {"config": "hsdp"}, 4, None),
])
def test_each_api_names_pytorchs_own_default_hook_among_its_builtins(api, reduce_dtype, params, world_size, name):
    adapter = HOOK_APIS[api]
    spec = HookSpec(name="mine", api=api, hook=lambda *a: None, reduce_dtype=reduce_dtype,
                    state=(lambda pg: pg) if adapter.stateful else None)
    assert default_replay.default_hook_name(adapter, spec, params, world_size) == name
    if name is not None:
        assert name in {s.name for s in load_target(adapter.builtin_hooks)}


# -- the runner's decisions, on scripted outcomes -------------------------------------------------


class ScriptedPool:
    """Answers each run with the next scripted findings per rank, and records the cases it was sent."""

    def __init__(self, *runs):
        self.runs, self.cases = list(runs), []
        self.references = []  # the reference-only replays (native trained twice), answered with the same bits
        self.specs, self.served = None, []  # the hook the pool's ranks loaded; (specs, case index) per switch

    def serve(self, specs):
        if specs != self.specs:
            self.specs = specs
            self.served.append((specs, len(self.cases)))

    def reap(self):
        pass

    def run(self, case):
        if case.params.get("reference_only"):
            self.references.append(case)
            return CaseResult(case=case, world_size=2, outcomes=tuple(
                RankOutcome(rank=r, ok=True, value=CheckResult(figures={REFERENCE_DIGEST: f"bits{r}"}))
                for r in range(2)))
        self.cases.append(case)
        per_rank = self.runs.pop(0)
        outcomes = tuple(RankOutcome(rank=r, ok=True, value=CheckResult(findings=[f for f in per_rank if f.rank == r]))
                         for r in range(2))
        return CaseResult(case=case, world_size=2, outcomes=outcomes)


class Node:
    def __init__(self, name, xfail=False):
        self.name, self.user_properties, self.xfail = name, [], xfail

    def get_closest_marker(self, name):
        return object() if name == "xfail" and self.xfail else None


class Request:
    def __init__(self, name, xfail=False):
        self.node = Node(name, xfail)


@pytest.fixture
def torch_2_13(monkeypatch):
    """The runner's decisions on a torch version no reference caveat covers (this file also runs on 2.4)."""
    monkeypatch.setattr(torch, "__version__", "2.13.0")


def check(pool, hook="mine", target="pkg.mod:SPEC", rank_check="fsdp.clip_grad_norm", xfail=False):
    """One FULL_SHARD clip case of ``hook`` through ``Runner.run`` on ``pool``, as ``Runner.run_case`` runs a plain
    plan (``rank_check`` may name another check, to see what the runner does with it)."""
    settings = resolve(lambda dest: [] if dest in ("conform_hooks", "conform_known_failures") else None,
                       env={}, gpu_count=0)
    spec = HookSpec(name=hook, api="fsdp", hook=lambda state, grad, output=None: None, state=lambda pg: pg)
    runner = Runner(settings, [LoadedSpec(target, spec, "--hook")])
    runner.pools[2] = pool
    pool.serve(((target, hook),))
    runner.serving = hook
    case = HOOK_APIS["fsdp"].suite_test("clip_grad_norm").case(hook, "FULL_SHARD", 2, model="nested_wrapped")
    request = Request(f"test_clip_grad_norm[{case.id}]", xfail)
    runner.run(request.node.name, check=rank_check, hook=hook, world_size=2,
               params={"strategy": "FULL_SHARD", "model": "nested_wrapped"}, describe=case.describe("clip_grad_norm"),
               known_failure=xfail, judge=lambda result: findings_of(result, across_ranks=False))


def test_a_difference_the_default_hook_shows_too_is_a_skip_naming_it_and_the_torch_version(torch_2_13):
    pool = ScriptedPool(AFTER_RETURN, AFTER_RETURN)
    with pytest.raises(pytest.skip.Exception) as info:
        check(pool)
    reason = str(info.value)
    assert ("the reference does not hold on torch 2.13.0: PyTorch's own default hook (reduce_scatter_hook), "
            "replayed on this case, shows the same") in reason
    assert "no hook can pass this case here" in reason and "0x4178ca21" in reason
    replay = pool.cases[1]
    assert replay.hook.name == "reduce_scatter_hook" and replay.hook.target == HOOK_APIS["fsdp"].builtin_hooks
    assert replay.params == pool.cases[0].params and replay.check == "fsdp.clip_grad_norm"
    assert pool.served[-1] == ((), 1), "the default hook is replayed in ranks that never ran the hook under test"
    assert [c.params for c in pool.references] == [{**pool.cases[0].params, "reference_only": True}] * 2, \
        "native is trained alone twice, and keeps its bits, before the default hook is replayed"


def test_a_difference_of_the_hooks_own_fails_and_says_what_the_default_hook_did(torch_2_13):
    with pytest.raises(ConformanceFailure) as info:
        check(ScriptedPool(AFTER_RETURN, []))
    assert "PyTorch's own default hook, reduce_scatter_hook, replayed on this case, conforms" in str(info.value)
    other = [norm_finding(0, 15.0), norm_finding(1, 15.0)]
    with pytest.raises(ConformanceFailure) as info:
        check(ScriptedPool(AFTER_RETURN, other))
    assert "replayed on this case, fails it too, but differently" in str(info.value)


def test_no_replay_where_the_diagnosis_names_the_hooks_own_cause_or_the_failure_is_known(torch_2_13):
    named = AFTER_RETURN[:2] + [Finding(0, "explained by: SUM without averaging", step=0, kind="diagnosis")]
    pool = ScriptedPool(named)
    with pytest.raises(ConformanceFailure):
        check(pool)
    assert len(pool.cases) == 1
    pool = ScriptedPool(AFTER_RETURN)
    with pytest.raises(ConformanceFailure):
        check(pool, xfail=True)
    assert len(pool.cases) == 1
    pool = ScriptedPool(AFTER_RETURN)
    with pytest.raises(ConformanceFailure):
        check(pool, rank_check="fsdp.hard_inputs")  # not a check the default hook replays
    assert len(pool.cases) == 1


def test_the_default_hook_itself_is_its_own_evidence(torch_2_13):
    pool = ScriptedPool(AFTER_RETURN)
    with pytest.raises(pytest.skip.Exception) as info:
        check(pool, hook="reduce_scatter_hook", target=HOOK_APIS["fsdp"].builtin_hooks)
    assert "reduce_scatter_hook is PyTorch's own default hook for this case" in str(info.value)
    assert len(pool.cases) == 1


def test_on_torch_2_4_the_set_order_caveat_skips_without_a_replay(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    pool = ScriptedPool(AFTER_RETURN)
    with pytest.raises(pytest.skip.Exception) as info:
        check(pool)
    reason = str(info.value)
    assert reason.startswith("the reference does not hold on torch 2.4.1+cu121: torch < 2.5:")
    assert "pytorch/pytorch#134673" in reason and len(pool.cases) == 1


# -- the suite run as a user would -----------------------------------------------------------------

#: Emulates a torch whose FSDP1 clip_grad_norm_ computes the total norm differently whenever a comm hook is
#: registered (what the issue first suspected of 2.4.1): one ULP up, after every hook has returned.
CONTRIVED_TORCH = '''
import math
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

_original = FSDP.clip_grad_norm_


def clip_grad_norm_(self, max_norm, norm_type=2.0):
    total = _original(self, max_norm, norm_type)
    if any(m._comm_hook is not None for m in FSDP.fsdp_modules(self)):
        total = torch.nextafter(total, torch.full_like(total, math.inf))
    return total


FSDP.clip_grad_norm_ = clip_grad_norm_
'''

HOOKS = ["--hook", "tests.zoo.after_return:ALL", "--hook", "conformance.apis.fsdp.builtin_hooks:FSDP_HOOKS",
         "--hook", "tests.zoo.fsdp_hooks:KNOWN_BAD", "--world-size", "2", "--extra-world-size", "0",
         "-k", "(test_clip_grad_norm or test_parity) and FULL_SHARD-nested_wrapped-ws2 and not low_precision "
               "and (good_native_copy or bad_scales_previous_output or reduce_scatter_hook or bad_sum_no_average)"]


def outcomes(run):
    return {(case.hook, case.check): case for case in run.cases}


def test_on_a_torch_that_breaks_the_reference_every_correct_hook_skips_and_bad_ones_fail(tmp_path):
    patched = tmp_path / "contrived"
    patched.mkdir()
    (patched / "sitecustomize.py").write_text(textwrap.dedent(CONTRIVED_TORCH))
    run = run_suite(HOOKS, str(tmp_path / "junit.xml"), pythonpath=[str(patched)])
    by = outcomes(run)
    assert set(by) == {(h, c) for h in ("good_native_copy", "bad_scales_previous_output", "reduce_scatter_hook",
                                        "bad_sum_no_average") for c in ("clip_grad_norm", "parity")}, run.output[-3000:]
    evidence = {"good_native_copy": "PyTorch's own default hook (reduce_scatter_hook), replayed on this case, "
                                    "shows the same difference",
                "reduce_scatter_hook": "reduce_scatter_hook is PyTorch's own default hook for this case"}
    if Version(Version(torch.__version__).base_version) < Version("2.5"):  # the set-order caveat comes first
        evidence = dict.fromkeys(evidence, "torch < 2.5: FullyShardedDataParallel.clip_grad_norm_ keeps")
    for hook, how in evidence.items():
        case = by[hook, "clip_grad_norm"]
        assert case.outcome == "skipped", case.message[-2000:]
        assert f"the reference does not hold on torch {torch.__version__}: {how}" in case.message
        assert by[hook, "parity"].outcome == "passed"
    own = by["bad_scales_previous_output", "clip_grad_norm"]
    assert own.outcome == "failed", own.message[-2000:]
    assert "what differs arose after the hook returned" in own.message
    assert "reduce_scatter_hook, replayed on this case, fails it too, but differently" in own.message
    assert by["bad_sum_no_average", "clip_grad_norm"].outcome == "failed"
    assert "replayed" not in by["bad_sum_no_average", "clip_grad_norm"].message
    assert run.returncode == 1


def test_on_torch_as_it_is_a_hook_that_changes_its_output_after_returning_still_fails(tmp_path):
    run = run_suite(HOOKS[:-2] + ["-k", "test_parity and FULL_SHARD-nested_wrapped-ws2 and bad_scales_previous"],
                    str(tmp_path / "junit.xml"))
    [case] = run.cases
    assert case.outcome == "failed", run.output[-3000:]
    assert "what differs arose after the hook returned" in case.message
    assert "PyTorch's own default hook, reduce_scatter_hook, replayed on this case, conforms" in case.message
