"""What a case is and what it is called, for every hook API.

Every suite test of every hook API is parametrized with one :class:`CaseParams`:
the hook, its **variant** (what the API varies: a sharding strategy for
``fsdp``, a training config for ``ddp`` and ``fsdp2``), the world size, and a
model or a registration rule. A case id is the pytest parameter id, fields joined
by ``-``: ``{hook}-{variant}-{model}-ws{world_size}`` for training checks,
``{hook}-{variant}-{rule}`` for registration rules. The hook name comes first so
that ``-k my_hook`` and known-failure patterns such as
``test_parity[fp16_compress_hook-*]`` select one hook's cases.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class CaseParams:
    """One parametrization of a suite test, for any hook API.

    Attributes:
        hook: the spec's name.
        variant: what the API varies: a ``ShardingStrategy`` member name or
            ``"HYBRID"`` (``fsdp``), a DDP config (``ddp``), an FSDP2 config
            (``fsdp2``, ``fsdp2_all_reduce``); named by :attr:`variant_field`.
        world_size: ranks in the pool that runs it.
        model: a reference model name, or ``None``.
        rule: a registration rule, or ``None``.
        api: the hook API (``spec.api``).
        skip: why the case cannot run here, or ``None``; set by the API's case
            plan (:attr:`conformance.apis.HookApi.plans`), not part of the id.
    """

    hook: str
    variant: str
    world_size: int
    model: Optional[str] = None
    rule: Optional[str] = None
    api: str = "fsdp"
    skip: Optional[str] = dataclasses.field(default=None, compare=False)

    @property
    def id(self) -> str:
        return case_id(self.hook, self.variant, model=self.model, world_size=self.world_size, rule=self.rule)

    @property
    def variant_field(self) -> str:
        """``"strategy"`` (fsdp) or ``"config"`` (ddp, fsdp2): :attr:`HookApi.variant_field`."""
        from conformance.apis.registry import HOOK_APIS

        return HOOK_APIS[self.api].variant_field

    def describe(self, check: str) -> Dict[str, Any]:
        """What the case is, for the failure's header: check, API, variant, then model or rule."""
        out: Dict[str, Any] = {"check": check, "api": self.api, self.variant_field: self.variant}
        if self.model:
            out["model"] = self.model
        if self.rule:
            out["rule"] = self.rule
        return out

    def junit_properties(self, check: str) -> List[Tuple[str, Any]]:
        """The JUnit properties of the case (the per-hook summary reads them too).

        Every case carries ``hook``, ``api``, ``check``, ``variant``, its variant
        under its own field name (``strategy`` or ``config``), ``world_size``, and
        ``model`` or ``rule`` where it has one.
        """
        props: List[Tuple[str, Any]] = [("hook", self.hook), ("api", self.api), ("check", check),
                                        ("variant", self.variant), (self.variant_field, self.variant),
                                        ("world_size", self.world_size)]
        if self.model:
            props.append(("model", self.model))
        if self.rule:
            props.append(("rule", self.rule))
        return props


def case_id(hook: str, variant: str, *, model: Optional[str] = None, world_size: Optional[int] = None,
            rule: Optional[str] = None) -> str:
    """The test parameter id of a case; see the module docstring for the shape."""
    parts = [hook, variant]
    if model:
        parts.append(model)
    if rule:
        parts.append(rule)
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
    if rest:
        out["detail"] = "-".join(rest)
    return out
