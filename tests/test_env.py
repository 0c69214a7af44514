"""Environment variables are read in one module (``kvfence/env.py``), and each one it reads is documented there."""

import re
from pathlib import Path

import pytest

from kvfence import env

pytestmark = pytest.mark.fast

PACKAGE = Path(env.__file__).parent
READS = re.compile(r"os\.environ(?:\.get)?\s*[\[(]|os\.getenv\(|in os\.environ")
# the data planes set and restore their libraries' own variables (MC_*, NIXL_*): writes, not kvfence settings
LIBRARY_SETTINGS = {"transfer/mooncake.py"}


def test_no_module_but_env_reads_the_environment():
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "env.py" and READS.search(p.read_text()))
    assert set(readers) <= LIBRARY_SETTINGS, readers


def test_every_variable_env_reads_is_in_its_table():
    source = (PACKAGE / "env.py").read_text()
    table = source.split('"""')[1]
    read = set(re.findall(r'"(KVFENCE_[A-Z0-9_]+)"', source))
    assert read and all(f"``{name}``" in table for name in read), read


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("yes", True)])
def test_switches_are_on_unless_set_to_zero(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("KVFENCE_SHM_C", raising=False)
    else:
        monkeypatch.setenv("KVFENCE_SHM_C", value)
    assert env.shm_c() is on


def test_openmp_threads_spin_briefly_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env.openmp_defaults()
    assert env.os.environ["GOMP_SPINCOUNT"] == str(env.OPENMP_SPIN_COUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    env.openmp_defaults()
    assert env.os.environ["GOMP_SPINCOUNT"] == "7"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    env.openmp_defaults()
    assert "GOMP_SPINCOUNT" not in env.os.environ


def test_the_cli_sets_the_openmp_default_before_torch_loads():
    import subprocess
    import sys

    script = ("import contextlib, io, os, sys\nfrom kvfence import cli\n"
              "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): cli.main(['--help'])\n"
              "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    clean = {k: v for k, v in env.os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=clean)
    assert out.stdout.split() == [str(env.OPENMP_SPIN_COUNT), "False"]
