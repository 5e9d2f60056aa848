"""Messages between the controller (the pytest process) and the rank processes.

Everything here is small and picklable: a case travels from the controller to
every rank, and each rank sends back one :class:`RankOutcome`. Tensors that a
check must compare across ranks travel on CPU inside ``RankOutcome.value``.

Every message is a ``(kind, payload)`` pair sent with :func:`send`; ``kind`` is
a :class:`Msg` (which equals its string value, so a peer's plain string still
compares equal).
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Sequence, Tuple


@enum.unique
class Msg(str, enum.Enum):
    """The kind of a ``(kind, payload)`` message: who sends it, when, and its payload.

    Controller and rank (local ranks over a socketpair, :mod:`conformance.controller.local_pool`;
    torchrun's ranks over the authenticated link, :mod:`conformance.controller.remote`):
    """

    # -- controller -> rank ---------------------------------------------------------------------
    HELLO = "hello"  # controller, once a rank is connected: the pool's settings and specs (a dict)
    CASE = "case"  # controller, to every rank of the pool, for each case: a Case
    PING = "ping"  # controller, after every case: a sequence number every rank all-reduces
    SHUTDOWN = "shutdown"  # controller, when it closes the pool or the run ends: None (the rank says BYE, exits 0)
    REHOST = "rehost"  # controller, to torchrun's ranks when it moves on to another hook: None (the rank execs afresh)
    STACKS = "stacks"  # controller, to a torchrun rank that did not finish a case: None (its watchdog answers STACK)
    OUTPUT = "output"  # controller asks a torchrun rank that failed a case for its recent output: None; the rank
    #                    answers with the same kind and the excerpt (a str)
    REFUSED = "refused"  # controller, to a torchrun rank whose join it refuses: why (a str); the rank exits
    # -- rank -> controller ---------------------------------------------------------------------
    JOIN = "join"  # a torchrun rank, first thing after authenticating: who it is (torchrun's environment, a dict)
    READY = "ready"  # a rank, once it joined its process group: its rank, pid, torch version, resident bytes (a dict)
    FAILED = "failed"  # a rank that could not start or join its process group: the traceback (a str)
    SPEC_FAILED = "spec_failed"  # a rank that could not load a hook spec at start-up: why (a str; a usage error)
    # a torchrun rank, while it runs a case, at each phase the check announces: the phase (a str); a local pool's
    # rank writes it on its phase board instead (conformance.shared.phase_board)
    PHASE = "phase"
    OUTCOME = "outcome"  # a rank, when it finished a case (or raised in it): its RankOutcome
    PONG = "pong"  # a rank, answering PING: the all-reduced sum (an int), or why the all-reduce failed (a str)
    BYE = "bye"  # a rank, answering SHUTDOWN or REHOST, just before it exits or execs: None
    STACK = "stack"  # a torchrun rank's watchdog, answering STACKS: its threads' stacks (a str)
    # -- controller <-> zygote (:mod:`conformance.ranks.zygote`) ----------------------------------
    SPAWN = "spawn"  # controller, for each local rank: {"env": ...}, then the rank's socket and output pipe
    PID = "pid"  # zygote, answering SPAWN: the forked rank's pid
    STATUS = "status"  # controller asks for [pid, ...]; the zygote answers with the same kind, {pid: exit code or None}


#: The exit status of a rank that ended itself because its controller was gone
#: (:func:`conformance.ranks.lifeline.exit_when_closed`): the suite's own exit, never a hook's.
LOST_CONTROLLER_EXIT_CODE = 75

#: The zygote's exit status when, after its imports, it cannot fork ranks safely (threads running, CUDA
#: initialised: :func:`conformance.ranks.zygote.fork_unsafe`); the controller then starts every rank as a
#: fresh interpreter for the rest of the session (:func:`conformance.controller.zygote_client.zygote`).
ZYGOTE_FORK_UNSAFE_EXIT = 3


def send(conn: Connection, message: object) -> None:
    """Send ``message`` with plain pickle.

    ``Connection.send`` uses multiprocessing's pickler, where torch registers
    reducers that pass tensor storage as file descriptors between
    ``multiprocessing`` processes; the pool's ranks are plain subprocesses, so
    tensors travel by value instead.
    """
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def send_all(conns: Sequence[Connection], message: object) -> None:
    """:func:`send` the same ``message`` on each of ``conns``, pickled once (a case goes to every rank)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    for conn in conns:
        conn.send_bytes(data)


def recv(conn: Connection) -> Any:
    """Receive one message sent with :func:`send`; ``EOFError`` when the peer is gone."""
    return pickle.loads(conn.recv_bytes())


@dataclasses.dataclass(frozen=True)
class HookRef:
    """How a rank process re-loads a spec: ``module:ATTR`` plus the spec's name."""

    target: str
    name: str


@dataclasses.dataclass(frozen=True)
class Case:
    """One unit of work, run by every rank of a pool.

    Attributes:
        check: name of a rank-side check registered with
            :func:`conformance.ranks.checks.rank_check`, e.g. ``"fsdp.parity"``.
        hook: the spec under test, or ``None`` for checks that need no hook.
        params: check parameters (strategy, model, steps, input values, ...).
        case_id: the pytest test name, for messages.
        nodes: the number of nodes the case simulates: each rank sets torchrun's layout variables for
            ``nodes`` nodes of equal size while the case runs (:mod:`conformance.ranks.topology`); 1 is the
            pool's own layout, one node (torchrun's ranks keep their real ones).
        diagnose: explain a difference (:func:`conformance.ranks.diagnosis.diagnose`); ``False`` for a known
            failure, whose failure text is never shown.
        hook_code: measure which of the hook's own code runs (:mod:`conformance.ranks.hook_code`); ``False``
            under ``--no-hook-coverage``.
    """

    check: str
    hook: Optional[HookRef]
    params: Dict[str, Any]
    case_id: str = ""
    nodes: int = 1
    diagnose: bool = True
    hook_code: bool = True


#: The figure (:attr:`CheckResult.figures`) of a reference-only run (``reference_only=True``): a digest of the
#: trained reference's bits on that rank (``conformance.ranks.checks.common.reference_result``). Two runs whose
#: digests differ on a rank gave native's own path other bits from the same seed and inputs.
REFERENCE_DIGEST = "reference_digest"


@dataclasses.dataclass
class CheckResult:
    """What a rank check returns, the one shape every check's result takes on the controller.

    A check may return a plain list of findings; the worker wraps it
    (:func:`as_check_result`).

    Attributes:
        findings: how the hook failed on this rank (empty when it conforms).
        figures: measured numbers a check reports even when it passes (a lossy
            hook's ``max_rel_error``, ``rel_diff``, ...), by name.
        grads: per step, ``{fqn: CPU tensor or None}`` of the hooked model, for
            checks the controller judges across ranks; ``None`` otherwise.
    """

    findings: List["Finding"] = dataclasses.field(default_factory=list)
    figures: Dict[str, Any] = dataclasses.field(default_factory=dict)
    grads: Optional[List[Dict[str, Any]]] = None


def as_check_result(value: object) -> CheckResult:
    """A check's return value as a :class:`CheckResult` (a list is its findings).

    Raises:
        TypeError: the check returned something else (a bug in the check).
    """
    if isinstance(value, CheckResult):
        return value
    if value is None or isinstance(value, list):
        return CheckResult(findings=list(value or []))
    raise TypeError(f"a rank check returned {type(value).__name__}; expected a CheckResult or a list of Findings")


@dataclasses.dataclass
class RankOutcome:
    """What one rank reports for one case.

    Attributes:
        rank: the rank in the pool's process group.
        ok: the check function returned (its findings may still be failures).
        value: the check's :class:`CheckResult` (findings, figures, CPU tensors).
        error: formatted traceback when the check raised.
        error_type: the exception's class name when it raised.
        compute_s: seconds spent inside the check function on this rank.
        phase: the last phase the rank announced (what it was doing).
        exit_code: the process exit code when the rank died during the case.
        stack: the Python stack dumped by faulthandler when the rank hung.
        output: what the rank printed during the case, kept when it did not finish.
        lost: why the controller lost this rank's connection during the case, when
            its exit code cannot be known (a rank that torchrun started on another node).
        findings_before_error: when the check raised, what it had found on this
            rank by then (:meth:`conformance.ranks.worker.RankContext.report_on_error`,
            e.g. the wrong allocation a recorder saw before the collective
            failed); shown above the traceback.
        leaks: what differs in the rank's process-global state from before the hook's
            module was imported, after the case (:func:`conformance.ranks.process_state.changes`),
            one phrase each; the case fails with them and the pool is rebuilt.
        rss: the rank's resident memory in bytes after the case, where known.
        reach: how far the case reached on this rank (:func:`conformance.ranks.reach.read`): ``steps`` the
            hooked model trained, ``buffer_bytes`` of the largest buffer the hook was handed, ``calls``.
        hook_code: which of the hook's own code ran on this rank (:func:`conformance.ranks.hook_code.read`: the
            arcs run per file, the hook's own definitions), ``{}`` where not measured.
        cost: what a training step of the hooked model and of native cost on this rank
            (:func:`conformance.ranks.cost.read`: collectives by kind, bytes by dtype), ``{}`` where not measured.
    """

    rank: int
    ok: bool = False
    value: Any = None
    error: Optional[str] = None
    error_type: Optional[str] = None
    compute_s: float = 0.0
    phase: str = ""
    exit_code: Optional[int] = None
    stack: Optional[str] = None
    output: str = ""
    lost: str = ""
    findings_before_error: List["Finding"] = dataclasses.field(default_factory=list)
    leaks: List[str] = dataclasses.field(default_factory=list)
    rss: Optional[int] = None
    reach: Dict[str, int] = dataclasses.field(default_factory=dict)
    hook_code: Dict[str, Any] = dataclasses.field(default_factory=dict)
    cost: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def hung(self) -> bool:
        return self.stack is not None

    def summary(self) -> str:
        if self.ok:
            return f"rank {self.rank}: finished"
        if self.exit_code is not None:
            return f"rank {self.rank}: died with exit code {self.exit_code} during {self.phase or 'start-up'!r}"
        if self.lost:
            return f"rank {self.rank}: {self.lost} during {self.phase or 'start-up'!r}"
        if self.error is not None:
            return f"rank {self.rank}: raised {self.error_type} during {self.phase!r}"
        return f"rank {self.rank}: did not finish; last phase {self.phase or 'none'!r}"


@dataclasses.dataclass
class CaseResult:
    """The outcomes of one case on every rank, as gathered by the controller.

    ``memory_grown`` holds ``(rank, bytes grown, resident bytes after)`` for each rank
    whose resident memory grew beyond the pool's bound since the pool started for this
    hook (over all the hook's cases so far); the pool was then restarted after the case
    (:class:`~conformance.controller.pools.PoolConfig`). ``group_broken`` says why the ranks' process
    groups (the default one, or another they hold) no longer ran a collective in step after a case that
    every rank finished, if they did not.
    Both, and every rank's :attr:`RankOutcome.leaks`, fail the case: :meth:`leak_findings`.
    """

    case: Case
    world_size: int
    outcomes: Tuple[RankOutcome, ...]
    timed_out: bool = False
    wall_s: float = 0.0
    pool_rebuilt: bool = False
    memory_grown: Tuple[Tuple[int, int, int], ...] = ()
    memory_bound: int = 0
    cases_on_pool: int = 0
    group_broken: str = ""

    @property
    def all_ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    @property
    def max_compute_s(self) -> float:
        return max((o.compute_s for o in self.outcomes), default=0.0)

    def leak_findings(self) -> List["Finding"]:
        """What the hook left changed in its rank processes, as findings of kind ``"process_state"`` (one
        per rank and change; a change every rank shows is one finding for rank 0 that says so) and
        ``"memory"``."""
        found: List[Finding] = []
        by_change: Dict[str, List[int]] = {}
        for o in self.outcomes:
            for what in o.leaks:
                by_change.setdefault(what, []).append(o.rank)
        for what, ranks in by_change.items():
            where = " on every rank" if len(ranks) == self.world_size > 1 else ""
            found.append(Finding(ranks[0], f"the hook left{where}: {what}. A later case in the same process would "
                                 "run under it, so the ranks were rebuilt before the next case",
                                 kind=FindingKind.PROCESS_STATE))
        if self.group_broken and not by_change:
            found.append(Finding(0, f"after this case the ranks' process groups no longer run a collective in step "
                                 f"({self.group_broken}): a group destroyed or replaced, or a collective that not "
                                 "every rank of a group joined (an async one issued on some ranks only), whose "
                                 "stale half the next collective there would pair with; the ranks were rebuilt "
                                 "before the next case", kind=FindingKind.PROCESS_STATE))
        for rank, grew, now in self.memory_grown:
            found.append(Finding(rank, f"resident memory grew by {grew / 2**20:.0f} MiB (to {now / 2**20:.0f} MiB) "
                                 f"over this hook's {self.cases_on_pool} case(s) on this rank, beyond "
                                 f"--rank-memory-growth {self.memory_bound / 2**20:g} MiB: the hook keeps memory from "
                                 "call to call (a cache or a list that only grows?). The ranks were rebuilt before "
                                 "the next case; this case re-run alone may stay under the bound",
                                 kind=FindingKind.MEMORY))
        return found


@dataclasses.dataclass(frozen=True)
class Cause:
    """One named cause of a hook's result: what the diagnosis found the hook did, by a stable identity.

    The rank side builds it (:mod:`conformance.ranks.cause_words` from the fields a candidate changes in
    native's reduction, :mod:`conformance.ranks.diagnosis` for what any API's hook may do, an API's own
    arithmetic for its own causes) and it travels to the controller inside :attr:`Finding.causes`, pickled:
    every value is a plain ``str``, ``int``, ``float``, ``bool`` or ``None``.

    Attributes:
        code: what the hook did, stable whatever the numbers and the words: ``"sum_not_averaged"``,
            ``"divided_twice"``, ``"wrong_divisor"``, ``"rounding_order"``, ``"other_dtype"``,
            ``"rounded_input"``, ``"other_rank_shard"``, ``"stale"``, ``"local_gradient"``,
            ``"nonfinite_replaced"``, ``"partial"``, ``"native"`` (the hook's result is native's), ...
        params: what the cause depends on, ``(name, value)`` pairs in a fixed order: ``(("divisor", 3),)``,
            ``(("dtype", "bfloat16"),)``.
        words: the cause as users read it (the diagnosis joins several with "; or ").
        fix: the change to the hook it implies, one instruction worded for the API; ``""`` where none follows.

    Two causes are the same cause (:attr:`family`) by their code and parameters, whatever the numbers: each
    rank names its own rank and shard, each world size its own divisor, each case its own index range.
    """

    code: str
    params: Tuple[Tuple[str, Any], ...] = ()
    words: str = ""
    fix: str = ""

    def param(self, name: str, default: object = None) -> Any:
        """The value of parameter ``name``, or ``default``."""
        return next((v for n, v in self.params if n == name), default)

    @property
    def family(self) -> str:
        """The code and the parameters, each number by its name alone: ``"wrong_divisor(divides_as, group_size)"``,
        ``"other_dtype(dtype=bfloat16)"``. Causes of one family differ only in their numbers: the ranks agree on
        it (:func:`conformance.ranks.diagnosis.agreed`), and the per-hook summary tells it as one story. A cause
        given in words alone (code :data:`UNNAMED_CAUSE`) is a family of its own."""
        if self.code == UNNAMED_CAUSE:
            return f"{UNNAMED_CAUSE}: {self.words}"
        if not self.params:
            return self.code
        shown = [n if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{n}={v}" for n, v in self.params]
        return f"{self.code}({', '.join(shown)})"

    def __str__(self) -> str:
        return self.words


#: The code of a cause given as plain words (:class:`Finding` coerces such a cause): nothing known of it but them.
UNNAMED_CAUSE = "unnamed"


@enum.unique
class FindingKind(str, enum.Enum):
    """What sort of finding a :class:`Finding` is, for code that reacts to it (never by its message).

    A ``str`` enum, as :class:`Msg`: each kind equals its string value, so ``Finding(..., kind="contract")``
    still works (:class:`Finding` coerces it), a kind pickles and JSON-serialises as that string, and code
    that compares ``f.kind == "contract"`` still matches. What a kind means to the report and to blame is declared
    here, once, as its properties (:attr:`explains`, :attr:`hooks_own`, :attr:`names_a_bug`,
    :attr:`rules_out_a_lossy_design`, :attr:`left_behind`); :mod:`conformance.controller.attribution` reads them,
    and the kinds that say it is not the hook (the last three).
    """

    # -- what differs ------------------------------------------------------------------------------
    MISMATCH = "mismatch"  # differs from the reference or expected value
    EXACT = "exact"  # an exactness check's observed difference (lockstep, analytic)
    HARD_INPUTS = "hard_inputs"  # a hard input (NaN, Inf, a cancelling sum) the hook reduced otherwise
    ACROSS_RANKS = "across_ranks"  # a rank's gradient differs from rank 0's where every rank must hold the same
    LOSSY_ERROR = "lossy_error"  # a lossy hook's error past its declared bound
    LOSSY_LOSS = "lossy_loss"  # a lossy hook's loss past its declared margin
    LOSSY_DETERMINISM = "lossy_determinism"  # two runs of a lossy hook from one seed differ
    # -- the diagnosis (:mod:`conformance.ranks.diagnosis`) ----------------------------------------
    DIAGNOSIS = "diagnosis"  # a named cause that reproduces the hook's result
    DIAGNOSIS_WIDER_DTYPE = "diagnosis_wider_dtype"  # only a reduction in a wider dtype than claimed explains it
    DIAGNOSIS_NOTE = "diagnosis_note"  # a line the diagnosis adds (what it tried)
    NO_KNOWN_CAUSE = "no_known_cause"  # a difference no named cause explains
    NATIVE_RESULT = "native_result"  # the hook's own result equals native's arithmetic in every call
    # -- the hook's own doing, whatever the values ---------------------------------------------------
    LOCAL_GRADIENT = "local_gradient"  # every rank kept its own gradient: the hook never communicated
    CONTRACT = "contract"  # the hook broke its API's calling contract
    PROCESS_STATE = "process_state"  # the hook left the rank process changed
    MEMORY = "memory"  # the rank's memory grew past the bound over the hook's cases
    # -- facts about the case, not the hook's doing (the attribution decides what they mean) -----------
    HOOK_NOT_CALLED = "hook_not_called"  # the API never called the hook in this case, by design
    TORCH_RULE_BROKEN = "torch_rule_broken"  # a rule that holds whatever the hook is, that this torch does not keep
    SUITE_RULE_BROKEN = "suite_rule_broken"  # a rule the suite's own machinery relies on fails (its registration)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def explains(self) -> bool:
        """A finding of the diagnosis, which explains the others (the report lists it after them, once per line)."""
        return self in _EXPLAINING

    @property
    def hooks_own(self) -> bool:
        """A finding that names a cause of the hook's own: its failure is the hook's whatever PyTorch does, so
        nothing is replayed to weigh PyTorch's part (:func:`conformance.controller.attribution.attribute`)."""
        return self in _HOOKS_OWN

    @property
    def names_a_bug(self) -> bool:
        """A cause that reproduces the hook's result bit for bit, or the hook's own result found exact: a bug, not
        a lossy design (a wider dtype than claimed, more accurate than native, may be one)."""
        return self in (FindingKind.DIAGNOSIS, FindingKind.NATIVE_RESULT)

    @property
    def rules_out_a_lossy_design(self) -> bool:
        """The hook never communicated, or broke its API's calling contract: a bug whatever the design."""
        return self in (FindingKind.LOCAL_GRADIENT, FindingKind.CONTRACT)

    @property
    def left_behind(self) -> bool:
        """What the hook left in its rank's process (changed state, grown memory), not what it computed."""
        return self in (FindingKind.PROCESS_STATE, FindingKind.MEMORY)


#: The kinds of the diagnosis (:attr:`FindingKind.explains`).
_EXPLAINING = frozenset({FindingKind.DIAGNOSIS, FindingKind.DIAGNOSIS_WIDER_DTYPE, FindingKind.NO_KNOWN_CAUSE,
                         FindingKind.DIAGNOSIS_NOTE, FindingKind.NATIVE_RESULT})
#: The kinds that name a cause of the hook's own (:attr:`FindingKind.hooks_own`).
_HOOKS_OWN = frozenset({FindingKind.DIAGNOSIS, FindingKind.DIAGNOSIS_WIDER_DTYPE, FindingKind.NO_KNOWN_CAUSE,
                        FindingKind.LOCAL_GRADIENT, FindingKind.CONTRACT, FindingKind.PROCESS_STATE,
                        FindingKind.MEMORY})


@dataclasses.dataclass(frozen=True)
class Finding:
    """One way a hook failed a check on one rank.

    Attributes:
        rank: the rank that saw it.
        message: what was observed and what it should be, one sentence.
        step: the training step (0-based), when the check trains.
        fqn: the parameter's fully qualified name, when it concerns one.
        mismatch: bitwise diagnostics (:class:`conformance.shared.compare.Mismatch`).
        kind: what sort of finding (a :class:`FindingKind`; a plain string is coerced to one, and an
            unknown one raises ``ValueError``), for code that reacts to it (never by its
            message): ``"mismatch"`` (differs from the reference or expected
            value), ``"local_gradient"`` (every rank kept its own gradient: the
            hook never communicated), ``"diagnosis"`` (a named cause that
            reproduces the hook's result, :mod:`conformance.ranks.diagnosis`),
            ``"no_known_cause"`` (a difference that no named cause explains),
            ``"native_result"`` (the hook's own result equals native's arithmetic
            in every call: what differs arose after it returned),
            ``"contract"`` (the hook broke its API's calling contract: what it
            returned, the dtype it left, a buffer it allocated, a registration
            the API refused, a step in which it was never called),
            ``"process_state"`` (the hook left the rank process changed,
            :mod:`conformance.ranks.process_state`), ``"memory"`` (the rank's memory grew
            past the bound over the hook's cases), ``"hook_not_called"`` (the case ran and
            matched, but the API never called the hook in it, by design), ``"torch_rule_broken"``
            (a rule that holds whatever the hook is does not hold on this torch),
            ``"suite_rule_broken"`` (a rule the suite's own machinery relies on, its registration
            say, fails). The last three are facts a rank check reports about the case, not blame:
            :func:`conformance.controller.attribution.attribute` decides what they mean (every
            finding of the first: a skip naming it; of the last two: PyTorch's skip, or ``NOT RUN``
            where the suite's rule fails; neither blames the hook).
        causes: of a diagnosis (kinds ``"diagnosis"``, ``"diagnosis_wider_dtype"``): each named cause
            alone (a :class:`Cause`; the message joins their words with "; or "), for the per-hook summary
            of causes. A cause given as plain words is coerced to a :class:`Cause` of code
            :data:`UNNAMED_CAUSE`, with the fix ``fixes`` gives it.
        fixes: the fix each of :attr:`causes` implies, in the same order (each cause's :attr:`Cause.fix`,
            one instruction worded for the API: ``"pass group=state.process_group to dist.get_world_size
            ..."``); ``""`` for a cause none follows from. Set from :attr:`causes`; given only with causes in
            plain words. The failure text shows them under the diagnosis
            (:func:`conformance.reports.report.diagnosis_lines`).
    """

    rank: int
    message: str
    step: Optional[int] = None
    fqn: Optional[str] = None
    mismatch: Any = None
    kind: FindingKind = FindingKind.MISMATCH
    causes: Tuple[Cause, ...] = ()
    fixes: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FindingKind):
            object.__setattr__(self, "kind", FindingKind(self.kind))
        given = tuple(self.fixes) + ("",) * (len(self.causes) - len(self.fixes))
        causes = tuple(c if isinstance(c, Cause) else Cause(UNNAMED_CAUSE, words=str(c), fix=fix)
                       for c, fix in zip(self.causes, given))
        object.__setattr__(self, "causes", causes)
        object.__setattr__(self, "fixes", tuple(c.fix for c in causes))

    def fix_of(self, cause: Cause) -> str:
        """The fix of ``cause`` (one of :attr:`causes`), or ``""``."""
        return next((c.fix for c in self.causes if c == cause), "")

    def describe(self) -> str:
        where = [f"rank {self.rank}"]
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.fqn is not None:
            where.append(f"parameter {self.fqn!r}")
        text = f"[{', '.join(where)}] {self.message}"
        if self.mismatch is not None:
            text += f": {self.mismatch.describe()}"
        return text
