"""Every test carries exactly one of the speed marks fast, model and slow (tests/marks.py): a run that collects
one without, or with two, stops before any test runs and names it, whatever ``-m`` selects."""

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.fast

HOOK = "from tests.marks import pytest_collection_modifyitems  # noqa: F401\n"
TESTS = """
import pytest

@pytest.mark.fast
def test_marked():
    pass

def test_unmarked():
    pass

@pytest.mark.fast
@pytest.mark.slow
def test_twice():
    pass
"""


def test_a_test_without_one_speed_mark_stops_the_run_naming_it(pytester):
    pytester.makeconftest(HOOK)
    pytester.makepyfile(test_new=TESTS)
    for selection in ([], ["-m", "fast"]):
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *selection)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        errors = result.stderr.str()
        assert "tests without exactly one of the marks fast, model, slow (2;" in errors
        assert "test_new.py::test_unmarked: none" in errors and "test_new.py::test_twice: slow, fast" in errors
        assert "test_marked" not in errors


def test_well_marked_tests_run_and_select_by_mark(pytester):
    pytester.makeconftest(HOOK)
    pytester.makepyfile(test_new=TESTS.replace("def test_unmarked", "@pytest.mark.model\ndef test_unmarked")
                        .replace("@pytest.mark.fast\n@pytest.mark.slow\n", "@pytest.mark.slow\n"))
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "fast").assert_outcomes(passed=1, deselected=2)
