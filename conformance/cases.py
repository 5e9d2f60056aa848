"""What a case is and what it is called, for every hook API.

Every suite test of every hook API is parametrized with one :class:`CaseParams`:
the hook, its **variant** (what the API varies: a sharding strategy, a training
config), the world size, and a model or a registration rule; and what the plan
that made it set: its API, its check and the variant's field name
(:meth:`conformance.apis.SuiteTest.case`). A case id is the pytest parameter id, fields joined
by ``-``: ``{hook}-{variant}-{model}-ws{world_size}`` for training checks
(``{hook}-{variant}-{model}-{nodes}nodes-ws{world_size}`` for a case that simulates
several nodes; ``...-{steps}steps-...`` for a case that trains a number of steps of its own), ``{hook}-{variant}-{rule}`` for registration rules; a case that trains in a claimed
parameter dtype (``HookSpec.param_dtype``) carries ``params_<dtype>`` after its model
(``{hook}-{variant}-{model}-params_bfloat16-ws{world_size}``). The hook name comes first so
that ``-k my_hook`` and known-failure patterns such as
``test_parity[fp16_compress_hook-*]`` select one hook's cases.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class CaseParams:
    """One parametrization of a suite test, for any hook API; made by its API's plan
    (:meth:`conformance.apis.SuiteTest.case`).

    Attributes:
        hook: the spec's name.
        variant: what the API varies (a ``ShardingStrategy`` member name or ``"HYBRID"``, a training
            config), named by :attr:`variant_field`.
        world_size: ranks in the pool that runs it.
        model: a reference model name, or ``None``.
        rule: a registration rule, or ``None``.
        api: the hook API (``spec.api``).
        check: the check's name in reports (the JUnit property ``check``, the failure header).
        variant_field: the variant's name in reports and in the rank check's parameters
            (:attr:`conformance.apis.HookApi.variant_field`: ``"strategy"``, ``"config"``).
        skip: why the case cannot run here, or ``None``; set by the API's case
            plan (:attr:`conformance.apis.HookApi.plans`), not part of the id.
        nodes: the number of nodes the case's ranks are laid out as (torchrun's layout variables,
            :mod:`conformance.ranks.topology`): 1, or several of ``world_size // nodes`` ranks each.
        param_dtype: the parameter dtype the case trains in, by name (``"bfloat16"``), where its spec claims
            one (``HookSpec.param_dtype``; set by :meth:`conformance.apis.SuiteTest.__call__`); ``None``: the
            models' own.
        steps: the training steps of a case that sets its own (a combined case, trained past a hook's step
            switch: :func:`conformance.apis.switch_plan`), a parameter of its rank check and part of its id
            (``...-80steps-ws2``); ``None``: its suite test's.

    Raises:
        ValueError: ``api``, ``check`` or ``variant_field`` is missing (a case is made by its API's plan).
    """

    hook: str
    variant: str
    world_size: int
    model: Optional[str] = None
    rule: Optional[str] = None
    api: str = ""
    check: str = ""
    variant_field: str = ""
    skip: Optional[str] = dataclasses.field(default=None, compare=False)
    nodes: int = 1
    param_dtype: Optional[str] = None
    steps: Optional[int] = None

    def __post_init__(self) -> None:
        missing = [name for name in ("api", "check", "variant_field") if not getattr(self, name)]
        if missing:
            raise ValueError(f"case {self.id} has no {' and no '.join(missing)}: a case is made by its API's plan, "
                             "SuiteTest.case(...), which sets the API, the check and the variant's field")
        if self.nodes < 1 or self.world_size % self.nodes:
            raise ValueError(f"case {self.id}: {self.world_size} ranks cannot be laid out as {self.nodes} nodes of "
                             "equal size")

    @property
    def id(self) -> str:
        return case_id(self.hook, self.variant, model=self.model, world_size=self.world_size, rule=self.rule,
                       nodes=self.nodes, param_dtype=self.param_dtype, steps=self.steps)

    def check_params(self) -> Dict[str, Any]:
        """The rank check's parameters the case gives: its variant under :attr:`variant_field`, then its model
        or rule (``{"strategy": "FULL_SHARD", "model": "nested_wrapped"}``)."""
        out: Dict[str, Any] = {self.variant_field: self.variant}
        if self.model:
            out["model"] = self.model
        if self.rule:
            out["rule"] = self.rule
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    def describe(self, check: Optional[str] = None) -> Dict[str, Any]:
        """What the case is, for the failure's header: check (the case's own by default), API, variant, then
        model or rule."""
        out: Dict[str, Any] = {"check": check or self.check, "api": self.api, self.variant_field: self.variant}
        if self.model:
            out["model"] = self.model
        if self.rule:
            out["rule"] = self.rule
        if self.nodes > 1:
            out["nodes"] = self.nodes
        if self.param_dtype:
            out["params"] = self.param_dtype
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    def junit_properties(self, check: Optional[str] = None) -> List[Tuple[str, Any]]:
        """The JUnit properties of the case (the per-hook summary reads them too).

        Every case carries ``hook``, ``api``, ``check`` (the case's own by default), ``variant``, its
        variant under its own field name (``strategy`` or ``config``), ``world_size``, and ``model`` or
        ``rule`` where it has one, and ``nodes`` (the layout's node count).
        """
        props: List[Tuple[str, Any]] = [("hook", self.hook), ("api", self.api), ("check", check or self.check),
                                        ("variant", self.variant), (self.variant_field, self.variant),
                                        ("world_size", self.world_size), ("nodes", self.nodes)]
        if self.model:
            props.append(("model", self.model))
        if self.rule:
            props.append(("rule", self.rule))
        if self.param_dtype:
            props.append(("param_dtype", self.param_dtype))
        return props


def case_id(hook: str, variant: str, *, model: Optional[str] = None, world_size: Optional[int] = None,
            rule: Optional[str] = None, nodes: int = 1, param_dtype: Optional[str] = None,
            steps: Optional[int] = None) -> str:
    """The test parameter id of a case; see the module docstring for the shape."""
    parts = [hook, variant]
    if model:
        parts.append(model)
    if rule:
        parts.append(rule)
    if param_dtype:
        parts.append(f"params_{param_dtype}")
    if steps is not None:
        parts.append(f"{steps}steps")
    if nodes > 1:
        parts.append(f"{nodes}nodes")
    if world_size is not None and rule is None:
        parts.append(f"ws{world_size}")
    return "-".join(parts)


def parse_case_id(text: str) -> Dict[str, Any]:
    """Split a test name or case id back into its fields (inverse of :func:`case_id`).

    Raises:
        ValueError: the text is not a case id.
    """
    if "[" in text:
        text = text[text.index("[") + 1: text.rindex("]")]
    parts = text.split("-")
    if len(parts) < 2:
        raise ValueError(f"{text!r} is not a case id of the form hook-VARIANT[-model][-wsN]")
    out: Dict[str, Any] = {"hook": parts[0], "variant": parts[1]}
    rest = parts[2:]
    if rest and rest[-1].startswith("ws") and rest[-1][2:].isdigit():
        out["world_size"] = int(rest.pop()[2:])
    if rest and rest[-1].endswith("nodes") and rest[-1][:-len("nodes")].isdigit():
        out["nodes"] = int(rest.pop()[:-len("nodes")])
    if rest and rest[-1].endswith("steps") and rest[-1][:-len("steps")].isdigit():
        out["steps"] = int(rest.pop()[:-len("steps")])
    if rest:
        out["detail"] = "-".join(rest)
    return out
