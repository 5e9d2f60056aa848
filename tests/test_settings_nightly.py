"""Tests for conformance.controller.settings' depth and the options a nightly run turns on: the nightly
depth (every world size's full plan, 200 examples), explicit hypothesis examples, compiled DDP, strict known
failures (the nightly gate) and hypothesis's seed, each carried by the re-run command.
"""

from __future__ import annotations

import pytest

from conformance.controller.settings import resolve
from conformance.controller.options import HYPOTHESIS_SEED_DEST
from tests.settings_helpers import getoption, settings, settings_error


# -- depth ------------------------------------------------------------------------------


def test_nightly_depth_gives_every_world_size_the_full_plan_and_200_examples():
    default, nightly = settings(), settings(env={"CONFORM_DEPTH": "nightly"})
    assert (default.depth, default.nightly, default.hypothesis_examples) == ("default", False, 3)
    assert [default.role(ws) for ws in default.world_sizes] == ["main", "extra"]
    assert (nightly.depth, nightly.hypothesis_examples) == ("nightly", 200)
    assert [nightly.role(ws) for ws in nightly.world_sizes] == ["main", "main"]
    args = nightly.rerun_args()  # a re-run of a nightly-only case must plan it again
    assert args[args.index("--depth") + 1] == "nightly" and "--hypothesis-examples" not in args
    assert "--depth" not in default.rerun_args()


def test_explicit_hypothesis_examples_win_over_the_depth():
    s = settings(cli={"conform_depth": "nightly", "conform_hypothesis_examples": "7"})
    assert s.hypothesis_examples == 7
    args = s.rerun_args()
    assert args[args.index("--hypothesis-examples") + 1] == "7"
    args = settings(cli={"conform_hypothesis_examples": "200"}).rerun_args()
    assert args[args.index("--hypothesis-examples") + 1] == "200" and "--depth" not in args


def test_a_bad_depth_names_its_source_and_the_choices():
    msg = settings_error(env={"CONFORM_DEPTH": "weekly"})
    assert "'weekly' from CONFORM_DEPTH" in msg and "default, nightly" in msg


def test_compiled_ddp_is_off_unless_asked_and_the_rerun_carries_it():
    assert not settings().with_compiled_ddp and "--with-compiled-ddp" not in settings().rerun_args()
    s = settings(env={"CONFORM_WITH_COMPILED_DDP": "1"})
    assert s.with_compiled_ddp and "--with-compiled-ddp" in s.rerun_args()


# -- strict known failures (the nightly gate) ---------------------------------------------


@pytest.mark.parametrize("env_value, expected", [("1", True), ("true", True), ("0", False), ("no", False)])
def test_strict_known_failures_from_the_environment(env_value, expected):
    assert settings(env={"CONFORM_STRICT_KNOWN_FAILURES": env_value}).strict_known_failures is expected


def test_strict_known_failures_flag_and_a_bad_environment_value():
    assert settings(cli={"conform_strict_known_failures": True}).strict_known_failures
    assert not settings().strict_known_failures
    msg = settings_error(env={"CONFORM_STRICT_KNOWN_FAILURES": "maybe"})
    assert "'maybe' from CONFORM_STRICT_KNOWN_FAILURES" in msg


def test_hypothesis_seed_is_hypothesis_own_option_and_the_rerun_command_carries_it():
    s = resolve(getoption(**{HYPOTHESIS_SEED_DEST: "7"}), {}, 0)
    assert s.hypothesis_seed == "7"
    args = s.rerun_args()
    assert args[args.index("--hypothesis-seed") + 1] == "7"
    assert "--hypothesis-seed" not in resolve(getoption(), {}, 0).rerun_args()


def test_a_disabled_hypothesis_plugin_leaves_the_seed_unset():
    def no_hypothesis(dest):
        if dest == HYPOTHESIS_SEED_DEST:
            raise ValueError("no option named 'hypothesis_seed'")
        return getoption()(dest)

    assert resolve(no_hypothesis, {}, 0).hypothesis_seed == ""
