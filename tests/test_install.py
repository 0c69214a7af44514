"""What kvfence imports at run time is declared in pyproject.toml, and serving needs none of the test packages."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TEST_PACKAGES = ("openai", "pytest", "transformers", "accelerate", "matplotlib")
# Imported only where a data plane is chosen, and declared as that plane's extra.
OPTIONAL = {"mooncake": "mooncake", "nixl_cu12": "nixl", "nixl_cu13": "nixl", "nixl": "nixl"}


def _top_level_imports() -> set[str]:
    names = set()
    for path in (ROOT / "kvfence").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"kvfence", "__future__"}


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[ <>=!~\[;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


@pytest.mark.fast
def test_every_third_party_import_is_a_declared_dependency():
    declared = _requirement_names(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module in sorted(_top_level_imports()):
        if module in OPTIONAL:
            extra = OPTIONAL[module]
            assert extra in extras, f"{module} is imported, but pyproject has no '{extra}' extra"
            continue
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not dists & declared:
            missing.append(f"{module} (from {', '.join(sorted(dists))})")
    assert not missing, f"imported at run time but not in pyproject's dependencies: {missing}"


@pytest.mark.slow
def test_serving_imports_no_test_package():
    """The serve path (CLI, router app, both workers, every data plane's module) imports with the test packages
    made unimportable, as on an install without the test extra."""
    blocker = f"""
import sys
class NoTestPackages:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {TEST_PACKAGES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (test package)")
sys.meta_path.insert(0, NoTestPackages())
import kvfence.cli, kvfence.router.app, kvfence.workers.prefill, kvfence.workers.decode
import kvfence.transfer.shm, kvfence.transfer.tcp, kvfence.tools.probe, kvfence.tools.soak
kvfence.cli.build_parser().parse_args(["serve"])
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


@pytest.mark.slow
def test_cli_help_imports_no_http_client():
    run = subprocess.run([sys.executable, "-c", "import sys, kvfence.cli; kvfence.cli.build_parser(); "
                          "print(sorted(m for m in ('httpx', 'openai', 'torch') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.stdout.strip() == "[]", run.stderr[-2000:]
