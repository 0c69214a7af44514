"""Fixtures several test files share, the check that every test carries one speed mark (tests/marks.py), and the
long checks that run in the background (tests/background.py)."""

from pathlib import Path

import pytest

from tests.background import background_result, pytest_collection_finish, pytest_sessionfinish  # noqa: F401
from tests.marks import pytest_collection_modifyitems  # noqa: F401 (the hook: pytest finds it here)
from tests.server import Server
from tests.tiny_models import tiny_model_dir

TINY = ("--model", str(tiny_model_dir("llama")), "--max-context", "1024")


@pytest.fixture
def anyio_backend():
    """The ``@pytest.mark.anyio`` tests run on asyncio only."""
    return "asyncio"


@pytest.fixture(scope="session")
def model() -> str:
    """The tiny random-weight Llama's directory (tests/tiny_models.py), as ``--model`` and ``Pair`` take it."""
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="session")
def tenants_file(tmp_path_factory) -> Path:
    """A tenants file: alice, bob and carol, whose keys are ``sk-<name>``, and the admin key ``sk-admin``."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text("".join(f'[tenants.{t}]\napi_keys = ["sk-{t}"]\n\n' for t in ("alice", "bob", "carol"))
                    + '[admin]\napi_keys = ["sk-admin"]\n')
    return path


@pytest.fixture(scope="session")
def tiny_colocated():
    """A colocated server on the tiny random-weight Llama, shared by the API tests (they change no state)."""
    with Server("--mode", "colocated", *TINY) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_disaggregated():
    """The same model served 1 prefill + 1 decode: it must answer exactly as ``tiny_colocated``."""
    with Server(*TINY) as server:
        yield server
