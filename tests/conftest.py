"""Fixtures several test files share."""

import pytest

from tests.server import Server
from tests.tiny_models import tiny_model_dir

TINY = ("--model", str(tiny_model_dir("llama")), "--max-context", "1024")


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
