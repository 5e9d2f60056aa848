"""The suite's options, each declared once: flag, environment variable, default, help.

:data:`OPTIONS` is read by the pytest plugin (``pytest_addoption``), by
:func:`conformance.controller.settings.resolve` (the command line, then the environment
variable, then the default) and by ``conform --help``
(:func:`conformance.controller.cli.conformance_help`), which shows each option's variable
and default. README's "Options" table holds the same defaults
(``tests/test_cli_help.py`` keeps them equal).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

__all__ = ["DEFAULT_CASE_TIMEOUT_S", "DEFAULT_HYPOTHESIS_EXAMPLES", "DEFAULT_LISTEN_TIMEOUT_S",
           "DEFAULT_RANK_LOG_LIMIT_MIB", "DEFAULT_RANK_MEMORY_GROWTH_MIB", "DEPTHS", "HYPOTHESIS_SEED_DEST",
           "NIGHTLY_HYPOTHESIS_EXAMPLES", "OPTIONS", "Option", "SettingsError"]

#: Seconds a case may run before it is declared hung.
DEFAULT_CASE_TIMEOUT_S = 60.0
#: Generated hard-input examples per case (on top of the named explicit ones).
DEFAULT_HYPOTHESIS_EXAMPLES = 3
#: Generated hard-input examples per case at ``--depth nightly`` (where ``--hypothesis-examples`` is not given).
NIGHTLY_HYPOTHESIS_EXAMPLES = 200
#: ``--depth`` values: ``default`` (what fits the default run's minute on 2 CPU cores) and ``nightly``.
DEPTHS = ("default", "nightly")
#: The dest of hypothesis's own ``--hypothesis-seed`` option (its pytest plugin).
HYPOTHESIS_SEED_DEST = "hypothesis_seed"
#: Output of one rank kept per case, in MiB (the first half and the last half; the rest is
#: counted and dropped). A failure shows a few thousand characters of it, and a hook that
#: prints 10 MB per call filled 1.2 GB of logs in 7 cases before there was a limit; 4 MiB per
#: rank keeps any traceback or stack whole and bounds the controller's memory to 4 MiB a rank.
DEFAULT_RANK_LOG_LIMIT_MIB = 4.0
#: Growth of a rank's resident memory (RSS) during one case, in MiB, beyond which the pool is
#: restarted after the case and the case is named. A CPU rank holds about 333 MB after the
#: default run (capacity.CPU_RANK_MEMORY_BYTES) and grows by tens of MB in its first cases, as
#: models are built; 1 GiB in one case is a leak (a hook that keeps 2 GB per call was seen).
DEFAULT_RANK_MEMORY_GROWTH_MIB = 1024.0
#: Seconds to wait for torchrun's ranks to connect (``--listen``), at the start and after each
#: restart: long enough to start torchrun on every node by hand, and for a restarted worker
#: group to import torch and meet again; past it, torchrun's restarts count as exhausted.
DEFAULT_LISTEN_TIMEOUT_S = 300.0


class SettingsError(ValueError):
    """A setting has an invalid value; the message names its source and a fix."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of the suite.

    Attributes:
        flag: the command-line flag (``--world-size``).
        env: the environment variable read where the flag is not given, or ``None``.
        help: what the option does.
        dest: pytest's name for it (``config.getoption(dest)``).
        metavar: the value's name in ``--help`` (``N``, ``PATH``); ``""`` for a flag without a value.
        default: the default, in words, as ``--help`` and README's "Options" table give it.
        env_note: how the environment variable is written, where the flag's form does not say
            (``"space-separated"``, ``"1 or 0"``), or ``""``.
    """

    flag: str
    env: Optional[str]
    help: str
    dest: str
    metavar: str = "VALUE"
    default: str = "none"
    env_note: str = ""

    def full_help(self) -> str:
        """The help with where else the value comes from and its default: ``... [CONFORM_X; default: 3]``."""
        where = f"{self.env_text()}; " if self.env else ""
        return f"{self.help} [{where}default: {self.default}]"

    def env_text(self) -> str:
        """The environment variable as ``--help`` names it, with how it separates values; ``""`` for none."""
        if not self.env:
            return ""
        return f"{self.env} ({self.env_note})" if self.env_note else self.env


OPTIONS: Tuple[Option, ...] = (
    Option("--hook", "CONFORM_HOOKS", "hook spec to test, as module:ATTR (repeatable)", "conform_hooks",
           "MODULE:ATTR", "PyTorch's built-ins and entry points", env_note="space-separated"),
    Option("--with-builtins", None, "also test PyTorch's built-in hooks when --hook is given",
           "conform_with_builtins", "", "off (on when no --hook is given)"),
    Option("--no-entry-points", None, "ignore specs offered through the 'conformance.hooks' entry points",
           "conform_no_entry_points", "", "off"),
    Option("--world-size", "CONFORM_WORLD_SIZE", "ranks in the main pool", "conform_world_size", "N",
           "GPU count with CUDA (plus CPU pools of 2 and 3 on one GPU), else 2"),
    Option("--extra-world-size", "CONFORM_EXTRA_WORLD_SIZE",
           "a second world size checked too, 0 for none (3 is not a power of two: see docs/checks.md "
           "'What runs at 3 ranks, and why')", "conform_extra_world_size", "N", "3 (0 with --listen)"),
    Option("--backend", "CONFORM_BACKEND", "process group backend: gloo or nccl", "conform_backend",
           "gloo|nccl", "nccl with CUDA, else gloo"),
    Option("--device", "CONFORM_DEVICE", "device of each rank: cpu or cuda", "conform_device", "cpu|cuda",
           "cuda if available"),
    Option("--case-timeout", "CONFORM_CASE_TIMEOUT",
           "seconds without progress (no rank starting a new step or phase) before a case is declared hung",
           "conform_case_timeout", "SECONDS", f"{DEFAULT_CASE_TIMEOUT_S:g}"),
    Option("--depth", "CONFORM_DEPTH",
           "default: the cases that fit about a minute on 2 CPU cores; nightly: those, the cases the default "
           "leaves out for time, and 3 replicas x 2 shards for fsdp2_replica (6 ranks), with "
           f"{NIGHTLY_HYPOTHESIS_EXAMPLES} hard-input examples a case (docs/options.md 'Depth')", "conform_depth",
           "default|nightly", "default"),
    Option("--hypothesis-examples", "CONFORM_HYPOTHESIS_EXAMPLES",
           "generated hard-input examples per case before shrinking", "conform_hypothesis_examples", "N",
           f"{DEFAULT_HYPOTHESIS_EXAMPLES} ({NIGHTLY_HYPOTHESIS_EXAMPLES} with --depth nightly)"),
    Option("--with-compiled-ddp", "CONFORM_WITH_COMPILED_DDP",
           "also check DDP hooks under compiled autograd (torch.compile, optimize_ddp='python_reducer'); its "
           "first step compiles for seconds, so only when asked", "conform_with_compiled_ddp", "", "off",
           env_note="1 or 0"),
    Option("--hook-coverage", "CONFORM_HOOK_COVERAGE",
           "measure which lines and branches of each hook's own Python code its cases ran (coverage.py, traced "
           "only while the hook's code runs; docs/hooks.md 'Which of your hook's code ran'); off: nothing is "
           "measured and each verdict says so", "conform_hook_coverage", "on|off", "on"),
    Option("--strict-known-failures", "CONFORM_STRICT_KNOWN_FAILURES",
           "for CI gates: fail the run when a known failure passes (XPASS) or a known-failures entry that "
           "could apply to this run matches no test", "conform_strict_known_failures", "", "off", env_note="1 or 0"),
    Option("--rank-log-limit", "CONFORM_RANK_LOG_LIMIT",
           "MiB of each rank's output kept per case: the first and last halves; a failure says how many bytes "
           "were cut", "conform_rank_log_limit", "MIB", f"{DEFAULT_RANK_LOG_LIMIT_MIB:g} (MiB of each rank's "
           "output kept per case)"),
    Option("--rank-memory-growth", "CONFORM_RANK_MEMORY_GROWTH",
           "MiB a rank's resident memory may grow over one hook's cases; the case that crosses it fails "
           "(memory growth) and the ranks are rebuilt; 0 for no check", "conform_rank_memory_growth", "MIB",
           f"{DEFAULT_RANK_MEMORY_GROWTH_MIB:g} (MiB a rank may grow over one hook's cases)"),
    Option("--known-failures", "CONFORM_KNOWN_FAILURES",
           "a known-failures TOML file of your own, added to the packaged fixtures/known_failures.toml "
           "(repeatable)", "conform_known_failures", "FILE", "only fixtures/known_failures.toml",
           env_note=f"separated by {os.pathsep!r}"),
    Option("--json", "CONFORM_JSON",
           "write the results (environment, every case, per-hook verdicts) as JSON to this path, atomically "
           "(schema: docs/results.md)", "conform_json", "PATH",
           "none (make conform: reports/conformance.json)"),
    Option("--markdown", "CONFORM_MARKDOWN",
           "write a Markdown summary to this path (it is also appended to $GITHUB_STEP_SUMMARY when that is "
           "set)", "conform_markdown", "PATH", "none (make conform: reports/conformance.md)"),
    Option("--write-reproducers", "CONFORM_WRITE_REPRODUCERS",
           "write a standalone reproducer (torch and the hook's module only; run it with python FILE) for every "
           "failed case of a hook under test into this directory, one <case id>.py each", "conform_write_reproducers",
           "DIR", "none"),
    Option("--baseline", "CONFORM_BASELINE",
           "the --json results of an earlier run: report new failures, fixed cases, cases that appeared or "
           "disappeared, changed figures", "conform_baseline", "PREVIOUS.json", "none"),
    Option("--fail-on", "CONFORM_FAIL_ON",
           "failures (any failure fails the run), regressions (only new failures, and branches of a hook's code no "
           "case took where the baseline's did, against --baseline) or uncovered (failures, and any branch of a "
           "hook's own code that no case took)", "conform_fail_on", "failures|regressions|uncovered",
           "failures; regressions needs a baseline"),
    Option("--max-cost", "CONFORM_MAX_COST",
           "fail the run for a hook whose collectives or bytes per training step exceed native's, on the same cases, "
           "by more than this ratio (1.0: no more than native); the cost is reported either way",
           "conform_max_cost", "RATIO", "none: cost reported, not gated"),
    Option("--listen", "CONFORM_LISTEN",
           "start no ranks here; accept the ranks that 'torchrun ... -m conformance.worker --controller "
           "HOST:PORT' starts on every node (secret: CONFORM_AUTHKEY_FILE or CONFORM_AUTHKEY); needs "
           "--world-size", "conform_listen", "HOST:PORT", "off: local pools"),
    Option("--listen-timeout", "CONFORM_LISTEN_TIMEOUT",
           "with --listen: seconds to wait for torchrun's ranks to connect, at the start and after each restart",
           "conform_listen_timeout", "SECONDS", f"{DEFAULT_LISTEN_TIMEOUT_S:g}"),
)
