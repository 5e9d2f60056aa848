"""Settings resolved as the tests of ``conformance.controller.settings`` resolve them (``tests/test_settings*.py``,
and the tests of the re-run command and the results file).

``resolve`` is fed a fake ``getoption`` that answers like pytest does for options
nobody gave (``[]`` for repeatable options, ``False`` for flags, ``None`` otherwise),
an explicit environment and an explicit GPU count, so no test depends on this machine.
"""

from __future__ import annotations

import pytest

from conformance.controller.settings import Settings, resolve
from conformance.controller.options import HYPOTHESIS_SEED_DEST, OPTIONS, SettingsError

DESTS = {o.dest for o in OPTIONS} | {HYPOTHESIS_SEED_DEST}
UNSET = {"conform_hooks": [], "conform_known_failures": [], "conform_with_builtins": False,
         "conform_no_entry_points": False, "conform_strict_known_failures": False, "conform_with_compiled_ddp": False}


def getoption(**given):
    """A fake of pytest's ``config.getoption`` that answers ``given`` (option dests), and for the rest what pytest
    answers for an option nobody gave; an undeclared dest is a test bug."""
    unknown = set(given) - DESTS
    assert not unknown, f"test bug: no such option dest {unknown}"

    def get(dest):
        assert dest in DESTS, f"resolve asked for undeclared option {dest!r}"
        return given.get(dest, UNSET.get(dest))

    return get


def settings(cli=None, env=None, gpus=0) -> Settings:
    """The settings ``resolve`` makes of command-line options ``cli`` (dest -> value), environment ``env`` and
    ``gpus`` GPUs."""
    return resolve(getoption(**(cli or {})), dict(env or {}), gpus)


def settings_error(cli=None, env=None, gpus=0) -> str:
    """The message of the ``SettingsError`` that :func:`settings` raises for the same arguments."""
    with pytest.raises(SettingsError) as info:
        settings(cli, env, gpus)
    return str(info.value)
