"""When any hook would fail a case: PyTorch's own default hook as the evidence, and known reference caveats.

A check compares a hook against PyTorch's native path. On some torch versions
that reference does not hold: the native path differs from itself, or from any
hook, after the hook has returned. A failure there would be a red that every
hook gets, so the case's attribution (:func:`conformance.controller.attribution.attribute`)
reads this module's rules, for a failed case whose findings name no cause of the hook's own
(:func:`could_be_pytorchs`), to tell whether the difference is PyTorch's:

1. A :class:`ReferenceCaveat` of this torch version covers the case (a known
   PyTorch behaviour that makes the reference unreliable here, named with its
   fix): the case is skipped with the caveat's reason.
2. Else the hook under test is PyTorch's own default hook for the case
   (``ControllerSide.default_hook``) and its result equals native's arithmetic in
   every call (a finding of kind ``"native_result"``): its failure is the
   evidence, and the case is skipped.
3. Else the attribution asks for a replay of the case with that default hook in the hook's place.
   If the default hook fails it with the **same** findings (rank, step, FQN,
   first differing index and both values: :func:`same_difference`), the case is
   skipped; otherwise the failure stands, with a note saying what the default
   hook did.

A skip is never a pass: the per-hook verdict counts it as skipped, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conformance.apis.controller_side import controller_side
from conformance.protocol import Finding, FindingKind

if TYPE_CHECKING:  # pragma: no cover
    from conformance.apis import HookApi
    from conformance.spec import HookSpec


def could_be_pytorchs(found: Sequence[Finding]) -> bool:
    """Whether a failure with findings ``found`` could be PyTorch's rather than the hook's: no finding
    names a cause of the hook's own (a diagnosed rounding order, dtype or shard, an unexplained result, a
    reduction that never reached the gradients)."""
    return bool(found) and not any(f.kind.hooks_own for f in found)


def after_the_hook_returned(found: Sequence[Finding]) -> bool:
    """Whether the diagnosis found the hook's own result equal to native's arithmetic in every call (kind
    ``"native_result"``) and nothing of the hook's own: what differs arose after it returned."""
    return could_be_pytorchs(found) and any(f.kind == FindingKind.NATIVE_RESULT for f in found)


def observed(found: Sequence[Finding]) -> List[Finding]:
    """The findings that say what differs (not the diagnosis), in report order."""
    return sorted((f for f in found if not f.kind.explains),
                  key=lambda f: (f.step if f.step is not None else -1, f.rank, f.fqn or ""))


def _key(f: Finding) -> Tuple[Any, ...]:
    m = f.mismatch
    values = None if m is None else (m.reason, m.first_index, m.actual_bits, m.expected_bits, m.num_different)
    return (f.rank, f.step, f.fqn, f.kind, f.message, values)


def same_difference(hook_found: Sequence[Finding], default_found: Sequence[Finding]) -> bool:
    """Whether two runs of one case failed the same way: the same observed findings, each with the same
    rank, step, FQN, message, first differing index, both values' bits and count of differing elements.

    A hook whose difference is its own differs somewhere in that (another FQN, other values), so the
    default hook's failure never excuses it."""
    mine = [_key(f) for f in observed(hook_found)]
    return bool(mine) and sorted(mine, key=repr) == sorted((_key(f) for f in observed(default_found)), key=repr)


def first_difference(found: Sequence[Finding]) -> str:
    """The first observed finding, one line, for a skip reason."""
    shown = observed(found)
    return shown[0].describe() if shown else "no finding"


@dataclasses.dataclass(frozen=True)
class ReferenceCaveat:
    """A torch version on which a check's reference does not hold, and why.

    Attributes:
        checks: the rank checks it covers.
        torch: the torch versions, a PEP 440 specifier on the release (``"<2.5"``).
        applies: ``applies(params)``: whether the case's rank-check parameters are affected.
        max_ulp: the largest difference, in ULPs, the caveat can explain: a finding beyond it (or that
            is not a difference of values) is the hook's, and the failure stands.
        reason: what PyTorch does there, and the change that fixed it.
    """

    checks: FrozenSet[str]
    torch: str
    applies: Callable[[Dict[str, Any]], bool]
    max_ulp: float
    reason: str

    def covers(self, check: str, params: Dict[str, Any], found: Sequence[Finding], torch_version: str) -> bool:
        """Whether this caveat explains a failure of ``check`` with ``found`` on ``torch_version``: the
        hook's own result was native's in every call and every difference is within :attr:`max_ulp`."""
        if check not in self.checks or not self.applies(params) or not after_the_hook_returned(found):
            return False
        if not SpecifierSet(self.torch).contains(Version(Version(torch_version).base_version), prereleases=True):
            return False
        shown = observed(found)
        return bool(shown) and all(f.mismatch is not None and f.mismatch.reason == "values"
                                   and f.mismatch.max_ulp_diff <= self.max_ulp for f in shown)


#: How far FSDP1's set-ordered norm sum moves a float32 total norm, and what follows from it (the clip
#: coefficient, the clipped gradients): summing n positive terms in another order moves the sum by at
#: most (n - 1) rounding errors, about 10 ULPs for the suite's models, and the square root halves that.
#: 1 ULP was seen in every failure (torch 2.4.1, gloo); 16 leaves room and still fails any real bug.
SET_ORDER_MAX_ULP = 16

REFERENCE_CAVEATS: Tuple[ReferenceCaveat, ...] = (
    ReferenceCaveat(
        checks=frozenset({"fsdp.clip_grad_norm"}),
        torch="<2.5",
        applies=lambda params: params.get("strategy") != "NO_SHARD",
        max_ulp=SET_ORDER_MAX_ULP,
        reason="torch < 2.5: FullyShardedDataParallel.clip_grad_norm_ keeps the parameters of sharded "
               "strategies in a Python set and sums their per-parameter norms in its iteration order, "
               "which follows the parameter objects' addresses, so two identical models, with no hook "
               "at all, get total norms (and clipped gradients) that differ in the last bits from model "
               "to model and from run to run (pytorch/pytorch#134393; torch 2.5 keeps them in a list, "
               "pytorch/pytorch#134673)"),
)


def caveat_for(check: str, params: Dict[str, Any], found: Sequence[Finding], torch_version: str
               ) -> Optional[ReferenceCaveat]:
    """The :data:`REFERENCE_CAVEATS` entry that explains this failure, or ``None``."""
    return next((c for c in REFERENCE_CAVEATS if c.covers(check, params, found, torch_version)), None)


def default_hook_name(api: HookApi, spec: HookSpec, params: Dict[str, Any], world_size: int) -> Optional[str]:
    """The name, among ``api.builtin_hooks``, of PyTorch's own default hook for a case of ``spec`` at
    ``world_size`` with the rank check's ``params``, or ``None`` where the API has none or none equals native
    there: the API's :attr:`~conformance.apis.controller_side.ControllerSide.default_hook`, reached through
    :mod:`conformance.apis.controller_side`, whose imports import-linter sees.

    Raises:
        KeyError: ``api`` declares no controller side (:func:`~conformance.apis.controller_side.controller_side`).
    """
    side = controller_side(api.name)
    if side.default_hook is None or not api.builtin_hooks:
        return None
    return side.default_hook(spec, params, world_size)


def caveat_reason(caveat: ReferenceCaveat, found: Sequence[Finding], torch_version: str) -> str:
    return (f"the reference does not hold on torch {torch_version}: {caveat.reason}. Here the hook's own "
            f"result equals native's arithmetic in every call, and what differs arose after it returned: "
            f"{first_difference(found)}")


def default_hook_reason(name: str, found: Sequence[Finding], torch_version: str, *, itself: bool) -> str:
    if itself:
        how = (f"{name} is PyTorch's own default hook for this case, its result equals native's arithmetic "
               f"in every call, and it still differs after it returned")
    else:
        how = f"PyTorch's own default hook ({name}), replayed on this case, shows the same difference"
    return (f"the reference does not hold on torch {torch_version}: {how} ({first_difference(found)}); "
            f"no hook can pass this case here")


def default_hook_note(name: str, default_found: Sequence[Finding], all_ok: bool) -> str:
    """The failure's closing note after a replay with the default hook that did not show the same difference."""
    if not all_ok:
        return f"(PyTorch's own default hook, {name}, could not run this case here, so it proves nothing)"
    if not observed(default_found):
        return (f"(PyTorch's own default hook, {name}, replayed on this case, conforms: the difference is "
                f"this hook's, e.g. a buffer it changes after returning)")
    return (f"(PyTorch's own default hook, {name}, replayed on this case, fails it too, but differently: "
            f"{first_difference(default_found)})")
