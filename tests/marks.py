"""The speed marks: every test carries exactly one of ``fast``, ``model`` and ``slow`` (pyproject.toml says what
each means; ``gpu`` comes in addition). ``tests/conftest.py`` installs the hook below."""

from __future__ import annotations

import pytest

SPEEDS = ("fast", "model", "slow")


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: an unmarked test stops every run, '-m fast' included
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        speeds = [mark.name for mark in item.iter_markers() if mark.name in SPEEDS]
        if len(speeds) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(speeds) or 'none'}")
    if wrong:
        raise pytest.UsageError(f"tests without exactly one of the marks {', '.join(SPEEDS)} ({len(wrong)}; "
                                "pyproject.toml says what each means; give the module a pytestmark or the test "
                                "its own decorator):\n" + "\n".join(wrong))
