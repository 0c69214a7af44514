"""API keys to tenants: parsing, load-time validation, Bearer headers."""

from pathlib import Path

import pytest

from kvfence.core import AuthenticationError
from kvfence.router.tenants import TenantConfigError, Tenants, bearer_key

pytestmark = pytest.mark.fast


GOOD = """
[tenants.alice]
api_keys = ["sk-alice-1", "sk-alice-2"]

[tenants.bob]
api_keys = ["sk-bob"]
"""


def load(tmp_path: Path, text: str) -> Tenants:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return Tenants.from_toml(path)


def test_parses_tenants_and_authenticates_each_key(tmp_path):
    t = load(tmp_path, GOOD)
    assert t.names == ("alice", "bob")
    assert not t.is_open
    assert t.authenticate("Bearer sk-alice-1") == "alice"
    assert t.authenticate("Bearer sk-alice-2") == "alice"
    assert t.authenticate("Bearer sk-bob") == "bob"


@pytest.mark.parametrize("header", ["bearer sk-bob", "BEARER sk-bob", "Bearer   sk-bob  ", "  Bearer sk-bob"])
def test_bearer_scheme_is_case_insensitive_and_whitespace_tolerant(tmp_path, header):
    assert load(tmp_path, GOOD).authenticate(header) == "bob"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic sk-bob", "sk-bob", "Token sk-bob"])
def test_missing_or_non_bearer_header_is_401_missing(tmp_path, header):
    with pytest.raises(AuthenticationError, match="Missing API key") as e:
        load(tmp_path, GOOD).authenticate(header)
    assert e.value.status == 401
    assert e.value.to_body()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("key", ["sk-carol", "sk-alice", "sk-alice-1x", "SK-BOB"])
def test_unknown_key_is_401_incorrect_and_never_echoed(tmp_path, key):
    with pytest.raises(AuthenticationError, match="Incorrect API key provided") as e:
        load(tmp_path, GOOD).authenticate(f"Bearer {key}")
    assert key not in e.value.message
    assert e.value.to_body()["error"]["type"] == "authentication_error"


def test_bearer_key():
    assert bearer_key("Bearer a.b-c") == "a.b-c"
    assert bearer_key("Bearer two words") == "two words"  # not a key any tenant can have: no spaces allowed
    assert bearer_key(None) is None


def test_open_mode_accepts_anything_as_default():
    t = Tenants.open()
    assert t.is_open and t.names == ("default",)
    for header in (None, "", "Bearer whatever", "garbage"):
        assert t.authenticate(header) == "default"


def test_key_under_two_tenants_fails_at_load_without_printing_it(tmp_path):
    text = GOOD + '\n[tenants.mallory]\napi_keys = ["sk-bob"]\n'
    with pytest.raises(TenantConfigError, match="already a key of tenant 'bob'") as e:
        load(tmp_path, text)
    assert "sk-bob" not in str(e.value)
    assert "tenants.toml" in str(e.value)


def test_key_twice_under_one_tenant_fails_at_load(tmp_path):
    with pytest.raises(TenantConfigError, match="already a key"):
        load(tmp_path, '[tenants.a]\napi_keys = ["k", "k"]\n')


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "no tenants"),
        ("[tenants]\n", "no tenants"),
        ('[tenants.a]\napi_keys = []\n', "non-empty list"),
        ('[tenants.a]\napi_keys = [""]\n', r"api_keys\[0\]"),
        ('[tenants.a]\napi_keys = ["ok", " padded"]\n', r"api_keys\[1\]"),
        ('[tenants.a]\napi_keys = ["with space"]\n', r"api_keys\[0\]"),
        ('[tenants.a]\napi_keys = [42]\n', r"api_keys\[0\]"),
        ('[tenants.a]\napi_keys = "sk-a"\n', "non-empty list"),
        ('[tenants.a]\napi_key = ["sk-a"]\n', r"unknown keys \['api_key'\]"),
        ('[tenants.a]\napi_keys = ["sk-a"]\nextra = 1\n', r"unknown keys \['extra'\]"),
        ("[tenants.a]\nweight = 2\n", "with api_keys"),
        ('[tenants.""]\napi_keys = ["sk-a"]\n', "tenant name"),
        ('[tenants."a b"]\napi_keys = ["sk-a"]\n', "tenant name"),
        ('tenants = 3\n', "must be a table"),
        ('[tenant.a]\napi_keys = ["sk-a"]\n', "unknown top-level"),
        ("[tenants.a\n", "not valid TOML"),
    ],
)
def test_malformed_files_fail_at_load(tmp_path, text, match):
    with pytest.raises(TenantConfigError, match=match):
        load(tmp_path, text)


def test_constructor_validates_like_the_file():
    assert Tenants({"a": ["k1"], "b": ["k2"]}).authenticate("Bearer k2") == "b"
    with pytest.raises(TenantConfigError):
        Tenants({})
    with pytest.raises(TenantConfigError):
        Tenants({"a": ["k"], "b": ["k"]})
