"""One option's value, read and checked: where it came from (the command line, then the environment), and the
:class:`SettingsError` that names that source when the value is invalid.

:func:`conformance.controller.settings.resolve` reads every option through these and decides what depends on the
machine and on the other options; the results files' options (:func:`results_paths`) are checked here, before any
case runs.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Dict, Tuple, Union

from conformance.controller.options import DEFAULT_LISTEN_TIMEOUT_S, Option, SettingsError
from conformance.reports.results import unwritable_reason


def given_value(cli: object, option: Option, env: Dict[str, str]) -> Tuple[Any, str]:
    """``(value, source)`` of ``option``: ``cli`` (what pytest's ``getoption`` answered) with its flag where the command
    line gave it, else the non-blank value of its environment variable with the variable's name, else ``(None, "")``."""
    if cli not in (None, [], False):
        return cli, option.flag
    if option.env and env.get(option.env, "").strip():
        return env[option.env].strip(), option.env
    return None, ""


def integer(value: Union[str, int], source: str, *, minimum: int) -> int:
    """``value`` as an ``int`` of at least ``minimum``.

    Raises:
        SettingsError: not an integer, or below ``minimum``; the message names ``source``.
    """
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise SettingsError(f"invalid value {value!r} from {source}: expected an integer") from None
    if number < minimum:
        raise SettingsError(f"invalid value {value!r} from {source}: must be at least {minimum}")
    return number


def mib_in_bytes(value: Union[str, float, None], source: str, default: float, *, minimum: float) -> int:
    """``value`` MiB (``default`` when ``None``) in bytes; at least ``minimum`` MiB unless 0 is allowed.

    Raises:
        SettingsError: not a finite number, or below ``minimum``; the message names ``source``.
    """
    if value is None:
        return int(default * 2**20)
    try:
        mib = float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"invalid value {value!r} from {source}: expected a number of MiB") from None
    if not math.isfinite(mib) or mib < minimum:
        raise SettingsError(f"invalid value {value!r} from {source}: must be a finite number of MiB, "
                            f"at least {minimum:g}")
    return int(mib * 2**20)


def positive_ratio(value: Union[str, float], source: str) -> float:
    """``value`` as a ratio against native's (``--max-cost 1.5``): a finite number above 0.

    Raises:
        SettingsError: anything else; the message names ``source``.
    """
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"invalid value {value!r} from {source}: expected a ratio against native's, "
                            "e.g. 1.0 (no more than native) or 1.5") from None
    if not math.isfinite(ratio) or ratio <= 0:
        raise SettingsError(f"invalid value {value!r} from {source}: must be a finite ratio above 0, e.g. 1.0")
    return ratio


def flag(value: Union[bool, str, None], source: str) -> bool:
    """``value`` as a flag: a ``bool`` (or ``None``, false) as given, or the text 1/true/yes/on or 0/false/no/off.

    Raises:
        SettingsError: any other text; the message names ``source``.
    """
    if value is None or isinstance(value, bool):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"invalid value {value!r} from {source}: expected 1 or 0 (true/false)")


#: ``--fail-on`` values.
FAIL_ON = ("failures", "regressions", "uncovered")


def results_paths(pick: Callable[[str], Tuple[Any, str]]) -> Dict[str, Any]:
    """``json_path``, ``markdown_path``, ``reproducers_dir``, ``baseline_path`` and ``fail_on``, checked before any
    case runs.

    Raises:
        SettingsError: a report path that cannot be written (a directory, a directory
            that cannot be created or written), a reproducers' directory that cannot be made or written, a baseline that is not a file, an unknown
            ``--fail-on``, or ``--fail-on regressions`` without a baseline.
    """
    out: Dict[str, Any] = {}
    for dest, key in (("conform_json", "json_path"), ("conform_markdown", "markdown_path")):
        value, source = pick(dest)
        if value:
            reason = unwritable_reason(str(value))
            if reason:
                raise SettingsError(f"cannot write the report {value!r} from {source}: {reason}. Nothing was run.")
            out[key] = os.path.abspath(str(value))
    value, source = pick("conform_write_reproducers")
    if value:
        directory = os.path.abspath(str(value))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise SettingsError(f"cannot create the reproducers' directory {value!r} from {source}: {exc.strerror}. "
                                "Nothing was run.") from None
        if not os.access(directory, os.W_OK):
            raise SettingsError(f"cannot write into the reproducers' directory {value!r} from {source}: give a "
                                "writable directory. Nothing was run.")
        out["reproducers_dir"] = directory
    value, source = pick("conform_baseline")
    if value:
        if not os.path.isfile(str(value)):
            raise SettingsError(f"baseline {value!r} from {source} is not a file: give the --json results of an "
                                "earlier run")
        out["baseline_path"] = os.path.abspath(str(value))
    value, source = pick("conform_fail_on")
    fail_on = str(value).strip().lower() if value else "failures"
    if fail_on not in FAIL_ON:
        raise SettingsError(f"invalid value {value!r} from {source}: expected failures, regressions or uncovered")
    if fail_on == "regressions" and "baseline_path" not in out:
        raise SettingsError(f"--fail-on regressions (from {source}) needs a baseline to compare with: add "
                            "--baseline PREVIOUS.json (or CONFORM_BASELINE)")
    out["fail_on"] = fail_on
    return out


def listen_timeout(pick: Callable[[str], Tuple[Any, str]]) -> float:
    """``--listen-timeout`` in seconds (``DEFAULT_LISTEN_TIMEOUT_S`` when not given).

    Raises:
        SettingsError: not a positive, finite number of seconds.
    """
    value, source = pick("conform_listen_timeout")
    if value is None:
        return DEFAULT_LISTEN_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise SettingsError(f"invalid value {value!r} from {source}: expected a positive number of seconds")
    return seconds
