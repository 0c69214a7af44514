"""The import contracts of ``pyproject.toml`` (``[tool.importlinter]``): who may import whom, checked by
import-linter over the real import graph, and shown able to fail."""

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
LINT = ROOT / ".venv" / "bin" / "lint-imports"


def lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    done = lint()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "The protocol cores are sans-IO" in done.stdout


def test_a_contract_the_code_breaks_is_reported(tmp_path):
    """The router does import the core's types: a contract forbidding it must come out broken, naming the
    import, so a green run above means the graph was read."""
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_package = "kvfence"\n\n[[tool.importlinter.contracts]]\n'
                      'name = "router without core"\ntype = "forbidden"\nsource_modules = ["kvfence.router"]\n'
                      'forbidden_modules = ["kvfence.core"]\n')
    done = lint("--config", str(config))
    assert done.returncode == 1 and "router without core BROKEN" in done.stdout, done.stdout[-3000:]
    assert "kvfence.router.app -> kvfence.core" in done.stdout
