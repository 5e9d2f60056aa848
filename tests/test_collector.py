"""Python's cyclic collector in the suite's processes: kept off over the imports, frozen once they are done, and
always on again for what the cases make.

The suite imports torch with the collector off (``conformance/__init__.py``), the zygote freezes what it imported
before it forks ranks (``conformance/ranks/zygote.py``), and the controller freezes what its configured session
holds (``conformance/controller/pytest_plugin.py``); docs/speed.md gives what that saves. What must hold: a
process that imports the suite gets its collector back as it had it, a rank forked from the zygote collects what
its cases leave, and so does the controller. Each test is a child interpreter, so the collector's state of this
process plays no part.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, *args: str, cwd: Path = REPO, env_extra=None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORM_") and k != "PYTEST_ADDOPTS"}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, *(("-c", code) if code else ()), *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-3000:]
    return proc.stdout


def test_importing_the_suite_gives_the_collector_back_as_it_was():
    out = _python("import gc\n"
                  "import conformance\n"
                  "print('on', gc.isenabled())\n")
    assert "on True" in out, out
    out = _python("import gc\n"
                  "gc.disable()\n"
                  "import conformance\n"
                  "print('off', gc.isenabled())\n")
    assert "off False" in out, out


def test_the_zygote_forks_with_its_imports_frozen_and_the_collector_on():
    """What a forked rank inherits: every object of the imports frozen (never walked again), the collector on for
    what its cases make."""
    out = _python("import gc\n"
                  "from conformance.ranks import zygote\n"
                  "zygote._preload()\n"
                  "print('enabled', gc.isenabled(), 'frozen', gc.get_freeze_count() > 100_000)\n")
    assert "enabled True frozen True" in out, out


def test_the_controller_collects_again_once_its_session_is_configured(tmp_path):
    """``conform`` keeps the collector off while pytest, its plugins and the hooks' modules import, then freezes
    them and turns it on: a plugin that reads its state once the cases are collected finds it on."""
    (tmp_path / "gc_probe.py").write_text(
        "import gc\n"
        "def pytest_collection_finish(session):\n"
        "    print(f'controller: enabled {gc.isenabled()} frozen {gc.get_freeze_count() > 100_000}', flush=True)\n")
    out = _python("", "-m", "conformance", "--co", "-q", "-p", "gc_probe", "-k", "test_registration",
                  env_extra={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert "controller: enabled True frozen True" in out, out
