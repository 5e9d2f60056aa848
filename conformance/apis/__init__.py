"""Hook APIs: what the suite knows about each way of installing a hook, one folder per API.

An API's folder (``conformance/apis/<api>/``) holds everything the suite knows
about it:

* ``plan.py``: its :class:`HookApi`: how a spec's hook is validated against
  the API's calling convention, what its cases vary (the *variant*: a sharding
  strategy, a DDP config, an FSDP2 config), and its suite tests
  (:class:`SuiteTest`): per suite test function, the check, the rank check it
  runs, how the controller runs a case, and the **case plan**, with the reason
  a case cannot run here;
* ``models.py``: the rank side, its
  :class:`~conformance.ranks.checks.models.ApiModels`: how the reference model
  and the hooked model (with a recorder around the hook) are built, trained
  and read, over which the shared rank checks are written once;
* ``arithmetic.py``: its native arithmetic, which the diagnosis recomputes;
* ``builtin_hooks.py`` (PyTorch's own hooks as specs, and the default hook) and ``standalone.py`` (its
  torch-only build, which reproducers hold): its controller side, which
  :mod:`conformance.apis.controller_side` imports;
* its extras (FSDP1's registration rules, DDP's future contract and
  reference, FSDP2's meshes and recorders).

``conformance.apis.registry`` lists the API plan modules and builds the
registry :data:`conformance.apis.registry.HOOK_APIS` from their ``APIS``; spec
validation, the built-in hook sets, the rank checks and the suite's
parametrization (:func:`conformance.controller.pytest_plugin.pytest_generate_tests`)
all read it. docs/architecture.md's "Adding a hook API" lists the files a new API touches.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from conformance.catalogue import CASE_KINDS, CheckEntry, catalogued
from conformance.cases import CaseParams
from conformance.signatures import SpecError, binds_signature, qualname, signature_text

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.settings import Settings  # typing only: the controller imports the APIs
    from conformance.spec import HookSpec  # typing only: spec.py validates specs against this registry

__all__ = ["CataloguePlan", "LONG_RUN_STEPS", "REACH_MODELS", "SUBGROUP_WORLD_SIZE", "TWO_NODES",
           "is_reach_case", "simulated_layout_skip",
           "two_node_world_sizes", "CasePlan", "HookApi", "SuiteTest", "called_as", "no_strategies",
           "subgroup_world_size"]

#: ``plan(test, specs, settings)``: the cases of one suite test for the API's specs, each made by
#: ``test.case(...)`` and with its ``skip`` reason set where it cannot run here (the world size's
#: availability is checked by the caller, first).
CasePlan = Callable[["SuiteTest", Sequence["HookSpec"], "Settings"], List[CaseParams]]
#: ``plan_of(entry)``: an API's :data:`CasePlan` of a check the catalogue plans
#: (:class:`~conformance.catalogue.CheckEntry` with ``catalogued=True``): its specs of the entry's claims (:meth:`~conformance.catalogue.CheckEntry.for_spec`),
#: at the entry's world sizes, on the entry's model in the API's default variant, each case with its skip reason.
CataloguePlan = Callable[[CheckEntry], CasePlan]


@dataclasses.dataclass(frozen=True)
class SuiteTest:
    """One suite test function of a hook API: what its cases check, how each runs, and its case plan.

    Attributes:
        api: the API's name (:attr:`HookApi.name`).
        variant_field: what the API's cases vary, by name (:attr:`HookApi.variant_field`).
        check: the check's name in reports: the JUnit property ``check``, the failure header
            (``"parity"``, ``"fsdp2_parity"``, ``"subgroup_parity"``).
        rank_check: the rank check every rank runs, registered as ``<api>.<rank_check>``
            (:attr:`rank_check_name`): a shared check (``"parity"``) or one of the API's own.
        plan: the :data:`CasePlan`.
        kind: how the controller runs a case, one of :data:`CASE_KINDS`.
        params: the rank check's parameters besides the case's own (:meth:`CaseParams.check_params`),
            e.g. ``{"subgroup": True}``.
        depth_params: more of them per depth (``--depth``: ``"default"``, ``"nightly"``), e.g. the long run's
            ``{"default": {"steps": 256}, "nightly": {"steps": 2000}}`` (:data:`LONG_RUN_STEPS`): at the run's
            main world size (``--world-size``); a case at another world size takes the default depth's
            (:meth:`params_at`).
        entry: the catalogue's entry where the catalogue planned this suite test (:meth:`HookApi.__post_init__`),
            ``None`` where the API's plan module did.

    Raises:
        ValueError: ``kind`` is not one of :data:`CASE_KINDS`.
    """

    api: str
    variant_field: str
    check: str
    rank_check: str
    plan: CasePlan
    kind: str = "plain"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    depth_params: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    entry: Optional[CheckEntry] = None

    def params_at(self, depth: str, main_world_size: bool = True) -> Dict[str, Any]:
        """The rank check's parameters besides the case's own at ``depth``: :attr:`params`, then
        :attr:`depth_params` of that depth for a case at the run's main world size (``main_world_size``), of
        the default depth for one at another world size. The nightly's long run trains 2,000 steps at the main
        world size and 256 at the others, where each step costs up to twice as much on a 2-core machine: the
        horizon is reached once per spec, the other world sizes' paths over the default run's horizon."""
        return {**self.params, **self.depth_params.get(depth if main_world_size else "default", {})}

    def __post_init__(self) -> None:
        if self.kind not in CASE_KINDS:
            raise ValueError(f"suite test {self.check!r} of api {self.api!r}: kind {self.kind!r} is not one of "
                             f"{', '.join(CASE_KINDS)}")

    @property
    def rank_check_name(self) -> str:
        """The registered rank check: ``<api>.<rank_check>``."""
        return f"{self.api}.{self.rank_check}"

    def case(self, hook: str, variant: str, world_size: int, *, model: Optional[str] = None,
             rule: Optional[str] = None, skip: Optional[str] = None, nodes: int = 1,
             steps: Optional[int] = None) -> CaseParams:
        """A case of this suite test: its API, check and variant field set (``nodes``: the node layout it
        simulates, :attr:`CaseParams.nodes`; ``steps``: the steps it trains, where it sets its own)."""
        return CaseParams(hook, variant, world_size, model=model, rule=rule, api=self.api, check=self.check,
                          variant_field=self.variant_field, skip=skip, nodes=nodes, steps=steps)

    def __call__(self, specs: Sequence["HookSpec"], settings: "Settings") -> List[CaseParams]:
        """The plan's cases for ``specs`` (the API's specs among the run's); a case of a spec that claims a
        parameter dtype carries it (:attr:`CaseParams.param_dtype`), and a spec with ``sample_checks`` keeps
        its sample only (:func:`sampled`)."""
        specs = [s for s in specs if getattr(s, "sample_checks", None) is None or self.check in s.sample_checks]
        cases = self.plan(self, specs, settings)
        claims = {s.name: s.param_dtype_name for s in specs if getattr(s, "param_dtype", None) is not None}
        if claims:
            cases = [dataclasses.replace(c, param_dtype=claims[c.hook]) if c.hook in claims else c for c in cases]
        return sampled(cases, {s.name for s in specs if getattr(s, "sample_checks", None) is not None}, settings)


def sampled(cases: List[CaseParams], names: Collection[str], settings: Settings) -> List[CaseParams]:
    """``cases`` with those of the hooks ``names`` cut to a sample (``HookSpec.sample_checks``): per hook, the
    first variant and model at the run's first world size of at least 2 ranks
    (:func:`first_cross_rank_world_size`: the main one on a CPU machine, not a one-GPU machine's 1) on one
    node; where the plan has no such case for the hook (an API planned on a simulated layout alone, as the
    replica all-reduce's 2 nodes), its first case of at least 2 ranks, with that case's layout."""
    if not names:
        return cases
    ws = first_cross_rank_world_size(settings.world_sizes)
    chosen: Dict[str, Tuple[str, Optional[str], int, int]] = {}
    for case in cases:
        if case.hook in names and case.world_size == ws and case.nodes == 1:
            chosen.setdefault(case.hook, (case.variant, case.model, case.world_size, case.nodes))
    for case in cases:
        if case.hook in names and case.world_size >= 2:
            chosen.setdefault(case.hook, (case.variant, case.model, case.world_size, case.nodes))
    return [case for case in cases if case.hook not in names
            or chosen.get(case.hook) == (case.variant, case.model, case.world_size, case.nodes)]


@dataclasses.dataclass(frozen=True)
class HookApi:
    """What the suite knows about one hook API.

    Attributes:
        name: the value of ``HookSpec.api``.
        installed_with: how a hook is installed, the PyTorch call (for messages and docs).
        variant_field: what the API's cases vary, by name: ``"strategy"`` (a
            ``ShardingStrategy``) or ``"config"``.
        stateful: the hook takes a state built on each rank by ``spec.state(process_group)``.
        validate: ``validate(spec)`` checks the spec's hook against the API's
            calling convention and returns the spec's strategies (``fsdp``) or
            ``()``; raises :class:`~conformance.signatures.SpecError`.
        builtin_hooks: the hook target (``module:ATTR``, as ``--hook`` takes one) of PyTorch's own hooks for
            the API as specs, or ``None``. Its module is the API's ``builtin_hooks.py``, which
            :mod:`conformance.apis.controller_side` imports (with the API's default hook and standalone part,
            :class:`~conformance.apis.controller_side.ControllerSide`), so import-linter sees it.
        plans: suite test function name -> :class:`SuiteTest`; the suite tests of
            this API are exactly these, and each one's ``check`` is its own.
        models: ``module:ATTR`` of the API's rank side, its
            :class:`~conformance.ranks.checks.models.ApiModels` subclass, called as
            ``models(ctx, spec, model=..., **variant)``; every shared rank check its suite tests
            run is bound to it (:func:`conformance.ranks.checks.get_rank_check`).
        checks: the API's own rank checks (not written over its models), ``{name: "module:ATTR"}``
            of ``check(ctx, spec, **params)``; registered as ``<api>.<name>``.
        compiled_convention: the API has a compiled path that calls hooks another way (DDP under compiled
            autograd: ``hook(state, (grad, param))``), so a spec may say its hook takes it
            (``HookSpec.compiled_ddp``); elsewhere that is a :class:`~conformance.signatures.SpecError`.
        native_modes: the API's natives a spec may say its hook is meant for (``HookSpec.native_modes``), the
            first the default: DDP's ``("default", "batched_grad_copy")``; ``()``: one native only.
        catalogue_plan: how the API plans a check the catalogue plans (:data:`CataloguePlan`); with it, every
            such entry of :data:`conformance.catalogue.CATALOGUE` that runs on this API becomes one more of
            :attr:`plans`, ``<test_prefix><name>`` of check ``<check_prefix><name>`` (an ``exact`` entry runs as
            ``plain`` on an API that takes no lossy contract: no failure there ends with how to declare one).
        test_prefix, check_prefix: the start of a catalogued suite test's function name and check name
            (``None``: ``test_<api>_`` and ``<api>_``; FSDP1's are ``test_`` and ``""``, DDP's ``test_ddp_`` and
            ``""``, as their other suite tests).
    """

    name: str
    installed_with: str
    variant_field: str
    stateful: bool
    validate: Callable[[Any], Tuple[str, ...]]
    builtin_hooks: Optional[str]
    plans: Mapping[str, SuiteTest]
    models: str
    checks: Mapping[str, str] = dataclasses.field(default_factory=dict)
    compiled_convention: bool = False
    native_modes: Tuple[str, ...] = ()
    catalogue_plan: Optional[CataloguePlan] = None
    test_prefix: Optional[str] = None
    check_prefix: Optional[str] = None

    def __post_init__(self) -> None:
        own = {name: test for name, test in self.plans.items() if test.entry is None}
        if self.catalogue_plan is not None:
            lossy = any(test.kind == "lossy_error" for test in own.values())
            tests = self.test_prefix if self.test_prefix is not None else f"test_{self.name}_"
            checks = self.check_prefix if self.check_prefix is not None else f"{self.name}_"
            for entry in catalogued(self.name):
                kind = "plain" if entry.kind == "exact" and not lossy else entry.kind
                own[tests + entry.name] = SuiteTest(self.name, self.variant_field, checks + entry.name, entry.name,
                                                    self.catalogue_plan(entry), kind=kind, entry=entry)
        object.__setattr__(self, "plans", own)  # frozen: the plans are fixed once made
        checks = [test.check for test in self.plans.values()]
        for name, test in self.plans.items():
            if (test.api, test.variant_field) != (self.name, self.variant_field):
                raise ValueError(f"api {self.name!r} (variant field {self.variant_field!r}): its suite test {name} makes "
                                 f"cases of api {test.api!r} (variant field {test.variant_field!r})")
            if checks.count(test.check) > 1:
                raise ValueError(f"api {self.name!r}: check {test.check!r} names more than one suite test")

    def suite_test(self, check: str) -> SuiteTest:
        """The suite test whose cases have ``check``; ``KeyError`` names the API's checks."""
        for test in self.plans.values():
            if test.check == check:
                return test
        raise KeyError(f"api {self.name!r} has no suite test of check {check!r}; its checks: "
                       f"{', '.join(t.check for t in self.plans.values())}")


#: Training steps of every API's long run (``long_run``, :mod:`conformance.ranks.checks.long_run`), by depth:
#: warm-ups, periodic work and counters that wrap take another path only after so many steps.
LONG_RUN_STEPS: Mapping[str, Mapping[str, Any]] = {"default": {"steps": 256}, "nightly": {"steps": 2000}}


#: The node layouts the plans simulate with torchrun's variables (:mod:`conformance.ranks.topology`): a hook that
#: reads ``LOCAL_WORLD_SIZE``, ``LOCAL_RANK`` or ``GROUP_RANK`` takes another path once a job spans two nodes.
#: Each API's topology cases: 2 ranks as 2 nodes of 1 and 4 as 2 nodes of 2; at nightly depth also 8 as 2 nodes
#: of 4. Its HSDP, subgroup and replica cases run as the nodes their mesh suggests too (the replicas across
#: nodes, each node one shard group).
TWO_NODES = 2


def two_node_world_sizes(settings: Settings) -> Tuple[int, ...]:
    """The world sizes of the topology cases: 2 and 4, and 8 at nightly depth."""
    return (2, 4, 8) if settings.nightly else (2, 4)


#: The reference models of production size (``models/large.py``).
REACH_MODELS = ("large_probe",)


def is_reach_case(case: CaseParams) -> bool:
    """Whether ``case`` is one of the reach's: a production-sized model, a long run, a simulated layout of several
    nodes, or a combined case. Such a case costs seconds; where a known failure also marks cases of the same hook
    that are not, those run, and say whether the failure still holds
    (:func:`conformance.controller.pytest_plugin.pytest_collection_modifyitems`)."""
    return (case.model in REACH_MODELS or case.nodes > 1 or case.check.endswith("long_run")
            or case.check.endswith("switches"))


def simulated_layout_skip(settings: Settings) -> Optional[str]:
    """Why a case that simulates several nodes cannot run here (``None``: it runs): under ``--listen`` the
    ranks' layout is torchrun's own, the real one the run reports."""
    if getattr(settings, "listen", None) is not None:
        return ("the ranks are torchrun's (--listen): their node layout is the real one, which the run reports; a "
                "simulated layout would contradict it")
    return None


#: The smallest pool the subgroup cases run on (two data-parallel groups of two,
#: :mod:`conformance.ranks.checks.groups`).
SUBGROUP_WORLD_SIZE = 4


def subgroup_world_size(world_sizes: Sequence[int]) -> int:
    """The pool the subgroup cases run on: the smallest even world size of the run of at least
    :data:`SUBGROUP_WORLD_SIZE`, else :data:`SUBGROUP_WORLD_SIZE` (the extra pool FSDP2's HSDP starts)."""
    fits = [ws for ws in world_sizes if ws >= SUBGROUP_WORLD_SIZE and ws % 2 == 0]
    return min(fits) if fits else SUBGROUP_WORLD_SIZE


def first_cross_rank_world_size(world_sizes: Sequence[int]) -> int:
    """Where the run's one-world-size cases (a lossy contract's training loss, its determinism) run: the
    first world size of the run with at least 2 ranks, else the first. On a one-GPU machine the run's first
    world size is 1, where a mean over one rank is the local gradient and a contract calibrated across ranks
    says nothing; its cross-rank pools are the ones a CPU machine runs these cases on."""
    return next((ws for ws in world_sizes if ws >= 2), world_sizes[0])


def no_strategies(spec: HookSpec) -> None:
    """Raise :class:`SpecError` if ``spec.strategies`` is set: only ``api="fsdp"`` takes strategies."""
    if spec.strategies is not None:
        raise SpecError(f"HookSpec {spec.name!r}: strategies apply to api='fsdp' only, not {spec.api!r}")


def called_as(nargs: int, convention: str) -> Callable[[Any], Tuple[str, ...]]:
    """A validator for an API that calls ``hook`` with ``nargs`` positional arguments, as ``convention`` says."""
    count = {1: "one argument", 2: "two arguments"}[nargs]

    def validate(spec: HookSpec) -> Tuple[str, ...]:
        no_strategies(spec)
        if not binds_signature(spec.hook, nargs):
            raise SpecError(f"HookSpec {spec.name!r}: {convention}, but {qualname(spec.hook)}"
                            f"{signature_text(spec.hook)} cannot take {count}")
        return ()

    return validate
