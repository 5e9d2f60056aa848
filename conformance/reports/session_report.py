"""What the terminal says about the run as a whole: its header, what its counts mean, a -k that matched nothing.

A newcomer's first run ends with pytest's own line, ``233 passed, 7 skipped, 8
deselected, 301 xfailed``: more known failures than passes, and cases
deselected with no ``-k``. :func:`counts_lines` says what each count is, and
every world size the cases ran at; :func:`header_lines` names every world size
the run plans (the main and extra ones, and 4 for the cases that need four
ranks); :func:`no_case_lines` answers a ``-k`` or ``-m`` that selected no case
with the hook names and check names there are. The pytest plugin's summary
(:class:`conformance.reports.summary.Summary`) gathers the figures; everything
here is plain text from them. Nothing here plans a case: the world sizes come
from the controller, which plans every case once
(:func:`conformance.controller.pytest_plugin.plan_every_case`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from conformance.apis.registry import api_of_test
from conformance.shared.remote_link import format_address

if TYPE_CHECKING:  # pragma: no cover
    from conformance.controller.pytest_plugin import SessionState
    from conformance.spec import HookSpec

__all__ = ["counts_lines", "crash_rerun_lines", "crash_rerun_verdict_note", "header_lines", "no_case_lines",
           "notset_cause", "split_counts"]

#: Names listed in one line before "and N more".
MAX_NAMES = 8


def _join(items: Sequence[Any]) -> str:
    items = [str(i) for i in items]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _names(items: Iterable[str]) -> str:
    names = sorted(set(items))
    more = f" and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else ""
    return ", ".join(names[:MAX_NAMES]) + more


def _sizes_text(sizes: Mapping[int, Set[str]], usual: Sequence[int]) -> str:
    """``2, 3 and 4 (4 for test_ddp_parity, ...)``: every size, then the tests of each size the settings did not
    ask for (``usual``: the main, extra and one-GPU sizes), which only some cases need."""
    text = _join(sorted(sizes))
    others = [f"{ws} for {_names(sizes[ws])}" for ws in sorted(sizes) if ws not in usual and sizes[ws]]
    return f"{text} ({'; '.join(others)})" if others else text


def crash_rerun_lines(reruns: Sequence[Any]) -> List[str]:
    """What the summary says of the cases in which a rank died and that the suite ran once more in fresh ranks
    (:class:`conformance.controller.replays.CrashRerun`): each case, how its second run went, and how the first
    run's rank died (the results file keeps all that the first run's ranks did). Empty when none."""
    if not reruns:
        return []
    lines = [f"{len(reruns)} case(s) lost a rank and ran once more in fresh ranks (once per hook); the outcome above "
             "is the second run's. A death that does not recur may have come from the machine, from what an "
             "earlier case left in the ranks, or from a hook that crashes now and then: the suite cannot tell which"]
    for r in reruns:
        lines.append(f"  {r.case}: the second run {r.second_run}; the first run: {r.death}")
    return lines


def crash_rerun_verdict_note(reruns: Sequence[Any], hook: str) -> Optional[str]:
    """The line under ``hook``'s verdict where one of its cases lost a rank and ran again (``None`` if none)."""
    mine = [r for r in reruns if r.hook == hook]
    if not mine:
        return None
    r = mine[0]
    return (f"a rank died once, in {r.case} ({r.dead_rank}); the second run, in fresh "
            f"ranks, {r.second_run}: see the summary below")


def header_lines(state: SessionState, torch_version: str) -> List[str]:
    """The report header: torch and its build, backend, device, every world size the run plans, the case
    timeout; torchrun's or the one-GPU pools where they apply; then each hook under test with its claim."""
    s = state.settings
    build = "CUDA build" if state.book.env.cuda_build else "CPU build"
    sizes = _sizes_text(state.world_sizes or {ws: set() for ws in s.world_sizes}, s.world_sizes)
    lines = [f"conformance: torch {torch_version} ({build}), backend {s.backend}, device {s.device}, "
             f"world sizes {sizes}, case timeout {s.case_timeout_s:g} s"]
    if s.listen is not None:
        lines.append(f"  ranks: torchrun's, connecting to --listen {format_address(s.listen)} (waiting up to "
                     f"{s.listen_timeout_s:g} s): on every node, torchrun ... -m conformance.worker --controller "
                     f"{format_address(s.listen)}")
    if s.cpu_pools:
        lines.append(f"  one GPU: world size {s.world_size} alone proves nothing about averaging, so world sizes "
                     f"{_join(s.cpu_pools)} (and any larger one a case needs) run as gloo pools on the CPU")
    for item in state.specs:
        lines.append(f"  hook {item.spec.name} [{'; '.join(spec_fields(item.spec))}] from {item.target}")
    return lines


def spec_fields(spec: HookSpec) -> List[str]:
    """What the header says of a hook: its api, its claim, its sharding strategies (FSDP1's) and ``compiled DDP``
    where it says it takes compiled DDP's convention; a field a spec has nothing for is left out, never empty."""
    claim = "full-precision averaging" if spec.reduce_dtype is None else f"reduce_dtype={spec.reduce_dtype_name}"
    if getattr(spec, "param_dtype", None) is not None:  # the API reduces in the parameter dtype by default
        claim = "averaging in the parameter dtype" if spec.reduce_dtype is None else claim
        claim += f", param_dtype={spec.param_dtype_name}"
    fields = [spec.api, claim]
    if spec.strategies:
        fields.append(", ".join(spec.strategies))
    if getattr(spec, "compiled_ddp", False):
        fields.append("compiled DDP")
    return fields


def counts_lines(counts: Mapping[str, int], xfailed_builtin: int, empty_tests: Mapping[str, Tuple[str, bool]],
                 deselected: int, ran_at: Mapping[int, Set[str]], usual_sizes: Sequence[int],
                 environment: str) -> List[str]:
    """What each count of pytest's closing line means for this run.

    Args:
        counts: outcome -> cases (``passed``, ``failed``, ``xfailed``, ``xpassed``, ``skipped``).
        xfailed_builtin: how many of the ``xfailed`` cases are PyTorch's built-in hooks'.
        empty_tests: suite test -> :func:`notset_cause` for a test with no case for the hooks
            under test (pytest's ``[NOTSET]`` placeholder, which the plugin deselects).
        deselected: cases that ``-k`` or ``-m`` deselected.
        ran_at: world size -> the suite tests whose cases ran there (skipped cases excluded).
        usual_sizes: the world sizes of the settings (main, extra, one-GPU pools).
        environment: torch, its build, backend and device, in words.
    """
    lines = []
    if counts.get("passed"):
        lines.append(f"{counts['passed']} passed: cases where the hook gave PyTorch's own results, bit for bit "
                     "(or kept the registration rule)")
    if counts.get("failed"):
        lines.append(f"{counts['failed']} failed: cases where a hook does not conform; each failure above "
                     "ends with the command that re-runs it")
    xfailed = counts.get("xfailed", 0)
    if xfailed_builtin:
        lines.append(f"{xfailed_builtin} xfailed: known failures of PyTorch's own built-in hooks on this build "
                     f"({environment}), listed with their reasons under each hook above; they do not fail the run")
    if xfailed - xfailed_builtin > 0:
        lines.append(f"{xfailed - xfailed_builtin} xfailed: known failures of your hooks, from your "
                     "--known-failures file, listed with their reasons above; they do not fail the run")
    if counts.get("xpassed"):
        lines.append(f"{counts['xpassed']} xpassed: known failures that now pass (listed above): narrow or remove "
                     "their entries")
    if counts.get("skipped"):
        lines.append(f"{counts['skipped']} skipped: cases that cannot run here, or that ran and matched where the "
                     "API never calls the hook (it does nothing there); pytest's short summary (-rs) gives each "
                     "reason")
    if empty_tests or deselected:
        why = [f"{deselected} case(s) by -k or -m"] if deselected else []
        if empty_tests:
            apis_without = sorted({api for api, has_hooks in empty_tests.values() if not has_hooks})
            not_taken: Dict[str, List[str]] = {}
            for test, (api, has_hooks) in empty_tests.items():
                if has_hooks:
                    not_taken.setdefault(api, []).append(test)
            parts = [f"every test of api {_join(apis_without)} (no hook under test has that api)"] \
                if apis_without else []
            parts += [f"{_names(tests)} (its plan takes none of the {api} hooks under test)"
                      for api, tests in sorted(not_taken.items())]
            why.append(f"{len(empty_tests)} suite test(s) with no case for the hooks under test, not a -k: "
                       + "; ".join(parts))
        lines.append(f"{len(empty_tests) + deselected} deselected: " + "; and ".join(why))
    if ran_at:
        lines.append(f"world sizes: the cases ran at {_sizes_text(ran_at, usual_sizes)}")
    return lines


def selection_note(selected: int, deselected: int, keyword: str, markexpr: str) -> str:
    """Under a hook's verdict, where ``-k`` or ``-m`` left out some of its cases: that the verdict covers only the
    ``selected`` cases, of the ``selected + deselected`` planned for it; ``""`` where none was left out."""
    if not deselected:
        return ""
    asked = " and ".join(f"{flag} {expr!r}" for flag, expr in (("-k", keyword), ("-m", markexpr)) if expr)
    return (f"a verdict on the {selected} case(s) {asked or '-k or -m'} selected, not on all "
            f"{selected + deselected} planned for this hook")


def no_case_lines(keyword: str, markexpr: str, deselected: Sequence[str], hooks: Sequence[str],
                  empty_tests: int = 0) -> List[str]:
    """Why no case ran when ``-k`` or ``-m`` deselected every one: what was asked, and the hook and check
    names (suite test names) that a case id is made of, with one real id as an example. ``empty_tests``:
    suite tests deselected for having no case for these hooks, counted apart."""
    asked = " and ".join(x for x in (f"-k {keyword!r}" if keyword else "", f"-m {markexpr!r}" if markexpr else "")
                         if x) or "the selection"
    tests = sorted({name.split("[", 1)[0] for name in deselected})
    others = f"; the other {empty_tests} deselected are suite tests with no case for these hooks" \
        if empty_tests else ""
    lines = [f"no case matched {asked}: all {len(deselected)} cases were deselected, so none ran (exit status 5)"
             + others,
             f"  hooks: {', '.join(hooks)}",
             f"  checks (suite tests): {', '.join(tests)}"]
    if deselected:
        lines.append(f"  a case's name is test[hook-variant-model-wsN], e.g. {sorted(deselected)[0]}; -k matches "
                     "words of it, case-insensitively")
    return lines


def notset_cause(test: str, specs: Sequence[Any]) -> Tuple[str, bool]:
    """Why suite test ``test`` has no case for ``specs``: its API's name, and whether any spec has that API
    (then its case plan takes none of them: the lossy checks take only hooks with a ``LossyContract``)."""
    api = api_of_test(test)
    name = api.name if api is not None else "?"
    return name, any(spec.api == name for spec in specs)


def split_counts(per_hook: Mapping[str, Mapping[str, int]], builtin: Iterable[str]) -> Tuple[Dict[str, int], int]:
    """The outcome counts over every hook, and the ``xfailed`` count of the ``builtin`` hooks."""
    totals: Dict[str, int] = {}
    builtin = set(builtin)
    xfailed_builtin = 0
    for hook, counts in per_hook.items():
        for outcome, n in counts.items():
            totals[outcome] = totals.get(outcome, 0) + n
        if hook in builtin:
            xfailed_builtin += counts.get("xfailed", 0)
    return totals, xfailed_builtin
