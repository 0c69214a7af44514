"""Every benchmark script still loads: they run by hand and seldom, so nothing else notices one that an API change
broke (``bench/safety_overhead.py`` once imported names ``bench/serve.py`` no longer had)."""

import subprocess
import sys

import pytest

from tests.server import ROOT

# Runs each script's top level (its imports and path set-up), not its main: a fresh process, so the scripts'
# sys.path edits stay out of the test session.
LOAD_ALL = """
import runpy, sys, traceback
from pathlib import Path
broken = []
for path in sorted(Path("bench").glob("*.py")):
    try:
        runpy.run_path(str(path), run_name="loaded_by_a_test")
    except Exception:
        broken.append(f"{path}: {traceback.format_exc(limit=-2)}")
print("\\n".join(broken))
sys.exit(1 if broken else 0)
"""


@pytest.mark.slow
def test_every_benchmark_script_loads():
    run = subprocess.run([sys.executable, "-c", LOAD_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert len(list((ROOT / "bench").glob("*.py"))) >= 10  # the glob found the scripts
