"""The C kernels load only from a private cache: a directory another user owns or may write into is refused."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvfence import cbuild

pytestmark = pytest.mark.fast


SOURCE = Path(cbuild.__file__).parent / "kvcache" / "tag_check.c"


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(root))
    return root


def _build() -> Path | None:
    include = cbuild.sysconfig.get_paths()["include"]
    return cbuild.build(SOURCE, ["-O1", "-shared", "-fPIC", f"-I{include}"], suffix=".check")


def test_the_cache_is_made_private_and_used(cache_root):
    cache = cbuild.private_cache()
    assert cache == cache_root / "kernels"
    assert cache.stat().st_mode & 0o777 == 0o700 and cache.stat().st_uid == os.getuid()


@pytest.mark.parametrize("spoil", ["writable by others", "owned by another user", "a symbolic link",
                                   "in a directory others may write"])
def test_a_cache_that_is_not_private_is_refused(cache_root, caplog, tmp_path, spoil):
    kernels = cache_root / "kernels"
    cache_root.mkdir()
    if spoil == "a symbolic link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        kernels.symlink_to(tmp_path / "elsewhere")
    else:
        kernels.mkdir(mode=0o700)
    if spoil == "writable by others":
        kernels.chmod(0o777)
    if spoil == "owned by another user":
        if os.getuid() != 0:
            pytest.skip("needs root to give a directory away")
        os.chown(kernels, 65534, 65534)
    if spoil == "in a directory others may write":
        cache_root.chmod(0o777)
    with caplog.at_level(logging.ERROR, logger="kvfence.cbuild"):
        assert cbuild.private_cache() is None
        assert _build() is None
    assert "refusing the kernel cache" in caplog.text
    assert not list(kernels.glob("*.check")), "something was built into the refused cache"


def test_a_private_cache_builds(cache_root):
    if cbuild.shutil.which("cc") is None:
        pytest.skip("no C compiler")
    built = _build()
    assert built is not None and built.parent == cache_root / "kernels" and built.stat().st_uid == os.getuid()
