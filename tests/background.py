"""Long single-core checks run in the background from the start of the session, on the CPU the suite leaves idle.

The suite keeps about 1.3 of two cores busy: a core idles while a test waits on a server, or while a test runs
on one thread. A test whose answer is one long computation (an exhaustive model check, a rerun in a fresh
process) names it with ``@background(job)``. When collection ends, the jobs of the selected tests start, in the
order the tests will run, on two worker processes under ``SCHED_IDLE`` (nice 19 where that is missing): they run
only when no test wants the CPU. The test takes ``job(**its parameters)``'s return value from the
``background_result`` fixture, waiting for it if it is not done yet. Its assertions are unchanged: only where the
work runs moves. A job's exception (with its traceback) is raised in its test; the workers' own output is dropped.

A job is a module-level function of a test module (the worker imports it by name).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.pool import AsyncResult, Pool
from typing import Any

import pytest

_pool: Pool | None = None
_started: dict[tuple, AsyncResult] = {}
_results: dict[str, AsyncResult] = {}  # by test node id


def background(job: Callable[..., Any]) -> Callable:
    """Mark a test whose result is ``job(**the test's parameters)``, computed in the background."""

    def mark(test: Callable) -> Callable:
        test.background_job = job  # type: ignore[attr-defined]
        return test

    return mark


def rerun(path: str, selection: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The tests of ``path`` that ``-k selection`` picks, in a fresh pytest process with ``env``: a job's way to run
    tests under another flavour. Their own per-test timeout is off, as idle CPU comes when it comes; the whole run
    gets 3,000 s."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "0", path,
                           "-k", selection], env=env, capture_output=True, text=True, timeout=3000)


def _worker_start() -> None:
    """Run at the lowest priority, on one thread (and so the processes a job starts): of two OpenMP threads, one
    preempted by a test stalls the other at every barrier. Quietly: progress bars would land between pytest's
    dots."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the jobs of the tests selected, in the order they will run."""
    global _pool
    if session.config.option.collectonly:
        return
    for item in session.items:
        job = getattr(getattr(item, "function", None), "background_job", None)
        if job is None:
            continue
        if _pool is None:
            _pool = multiprocessing.get_context("spawn").Pool(2, initializer=_worker_start)
        params = item.callspec.params if hasattr(item, "callspec") else {}
        key = (job, tuple(sorted(params.items())))  # tests that name the same job and parameters share one run
        if key not in _started:
            _started[key] = _pool.apply_async(job, kwds=params)
        _results[item.nodeid] = _started[key]


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _pool is not None:
        _pool.terminate()
        _pool.join()


@pytest.fixture
def background_result(request: pytest.FixtureRequest) -> Any:
    """This test's background job's return value (waits for it)."""
    result = _results.get(request.node.nodeid)
    if result is None:
        raise RuntimeError(f"{request.node.nodeid} has no background job (mark it with @background)")
    return result.get()
