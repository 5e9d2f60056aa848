"""Tests for scripts/setup_env.py: setup never replaces a user's torch, and builds offline when it can.

The script runs before anything is installed, so it is loaded from its path;
``pip`` and the torch probe are replaced by recorders, so nothing is installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_env(monkeypatch):
    spec = importlib.util.spec_from_file_location("setup_env_under_test", REPO / "scripts" / "setup_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.pip_calls = []
    monkeypatch.setattr(module, "pip", lambda *args: module.pip_calls.append(args) or 0)
    module.compiled = []
    monkeypatch.setattr(module.compileall, "compile_dir", lambda folder, **kw: module.compiled.append(folder) or True)
    return module


def fake_torch(monkeypatch, module, *, installed: bool, version: str = "", imports: bool = True):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "torch" else real_find_spec(name, *a))

    real_run = subprocess.run

    def run(cmd, **kw):
        # subprocess is one module for all: the zoo runs' threads start suites and scripts meanwhile
        if cmd[1:2] != ["-c"] or "print(torch.__version__)" not in cmd[2]:
            return real_run(cmd, **kw)
        return subprocess.CompletedProcess(cmd, 0 if imports else 1, stdout=version + "\n",
                                           stderr="" if imports else "ImportError: libcudart.so.12")
    monkeypatch.setattr(module.subprocess, "run", run)


@pytest.mark.parametrize("text, expected", [("2.11.0+cu128", (2, 11, 0)), ("70.1.0rc1", (70, 1, 0)),
                                            ("2.15.0.dev20261101", (2, 15, 0)), ("", ())])
def test_version_tuple_keeps_the_release_fields(setup_env, text, expected):
    assert setup_env.version_tuple(text) == expected


def test_an_installed_torch_is_used_and_never_reinstalled(setup_env, monkeypatch, capsys):
    fake_torch(monkeypatch, setup_env, installed=True, version="2.11.0+cu128")
    setup_env.ensure_torch()
    assert setup_env.pip_calls == []
    assert "using the installed torch 2.11.0+cu128 (never replaced)" in capsys.readouterr().out


def test_no_torch_installs_the_pinned_cpu_release(setup_env, monkeypatch):
    fake_torch(monkeypatch, setup_env, installed=False)
    setup_env.ensure_torch()
    assert setup_env.pip_calls == [("install", "torch==2.13.0")]


def test_a_torch_that_fails_to_import_is_an_error_not_a_reinstall(setup_env, monkeypatch, capsys):
    fake_torch(monkeypatch, setup_env, installed=True, imports=False)
    with pytest.raises(SystemExit) as info:
        setup_env.ensure_torch()
    assert info.value.code == 2 and setup_env.pip_calls == []
    err = capsys.readouterr().err
    assert "does not import, and setup will not replace it" in err and "libcudart" in err


def test_a_torch_older_than_supported_is_an_error_not_an_upgrade(setup_env, monkeypatch, capsys):
    fake_torch(monkeypatch, setup_env, installed=True, version="2.3.1")
    with pytest.raises(SystemExit):
        setup_env.ensure_torch()
    assert setup_env.pip_calls == [] and "older than 2.4" in capsys.readouterr().err


@pytest.mark.parametrize("setuptools, wheel, offline", [
    ("80.9.0", None, True),    # bdist_wheel is part of setuptools since 70.1
    ("70.1.0", None, True),
    ("65.5.0", None, False),   # a Python 3.11 venv: no wheel package
    ("65.5.0", "0.45.1", True),
    ("58.1.0", "0.45.1", False),  # a Python 3.9 venv: no PEP 660 editable builds
    (None, None, False),       # a Python 3.12 venv has no setuptools
])
def test_offline_build_needs_a_setuptools_that_builds_editable_wheels(setup_env, monkeypatch, setuptools, wheel,
                                                                       offline):
    monkeypatch.setattr(setup_env, "installed_version", {"setuptools": setuptools, "wheel": wheel}.get)
    assert setup_env.can_build_offline() is offline


def test_install_uses_no_build_isolation_only_when_it_builds_offline(setup_env, monkeypatch):
    monkeypatch.setattr(setup_env, "can_build_offline", lambda: True)
    setup_env.install_package(test_extra=True)
    monkeypatch.setattr(setup_env, "can_build_offline", lambda: False)
    setup_env.install_package(test_extra=True)
    assert setup_env.pip_calls == [("install", "--no-build-isolation", "-e", f"{REPO}[test]"),
                                   ("install", "-e", f"{REPO}[test]")]


def test_the_suite_is_installed_without_the_test_extra(setup_env, monkeypatch):
    # make conform on an offline GPU node: import-linter (the test extra) is not among what it must carry.
    monkeypatch.setattr(setup_env, "can_build_offline", lambda: True)
    monkeypatch.setattr(setup_env, "ensure_torch", lambda: None)
    monkeypatch.setattr(setup_env.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout="2.13.0\n"))
    assert setup_env.main([]) == 0
    assert setup_env.main(["--test"]) == 0
    assert setup_env.pip_calls == [("install", "--no-build-isolation", "-e", str(REPO)),
                                   ("install", "--no-build-isolation", "-e", f"{REPO}[test]")]
    # An editable install is imported from the checkout, which pip leaves uncompiled: setup compiles it, and
    # tests/ for make test, so no process of a run compiles them again where PYTHONDONTWRITEBYTECODE is set.
    assert setup_env.compiled == [str(REPO / "conformance"), str(REPO / "conformance"), str(REPO / "tests")]


def test_the_makefile_installs_the_test_extra_for_make_test_only():
    makefile = (REPO / "Makefile").read_text()
    assert "conform: setup\n" in makefile
    assert "test: $(TEST_STAMP)\n" in makefile and "test-fast: $(TEST_STAMP)\n" in makefile
    assert "$(TEST_STAMP): $(STAMP)\n\t@$(PYTHON) scripts/setup_env.py --test\n" in makefile


def test_a_failed_install_says_how_to_install_offline(setup_env, monkeypatch, capsys):
    monkeypatch.setattr(setup_env, "pip", lambda *args: 1)
    monkeypatch.setattr(setup_env, "can_build_offline", lambda: False)
    with pytest.raises(SystemExit):
        setup_env.install_package()
    assert "setuptools>=70.1" in capsys.readouterr().err
