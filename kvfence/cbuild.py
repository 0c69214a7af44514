"""Build a C source into a shared object once per machine, user and content; the model kernels, the shm copy and
the L3 tag check use it. Nothing here raises: without a compiler, when the build fails, or when the cache is not
private, callers get None and keep their Python path.

The cache is private: ``$KVFENCE_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/kvfence/kernels``, else
``~/.cache/kvfence/kernels``, made mode 0700. A cache directory that is a symlink, is owned by another user, or
that others may write into is refused, never used: whoever can write there could plant a library this process
would load."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import stat
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType

from kvfence import env

log = logging.getLogger(__name__)


def build(source: Path, flags: list[str], deps: list[Path] | None = None, suffix: str = ".so") -> Path | None:
    """The shared object built from ``source`` (and the ``deps`` it includes) with ``flags``, cached under the
    temp dir by content and compiler; None if it cannot be built here (logged)."""
    cc = shutil.which(env.c_compiler())
    if cc is None:
        log.warning("no C compiler: %s is not built (slower Python path)", source.name)
        return None
    text = b"".join(p.read_bytes() for p in [source, *(deps or [])])
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    cache = private_cache()
    if cache is None:
        return None
    out = cache / f"{source.stem}-{key}{suffix}"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run([cc, *flags, str(source), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("building %s failed (%s%s): slower Python path", source.name, e,
                        f": {detail.decode(errors='replace')[:300]}" if detail else "")
            return None
        os.replace(tmp, out)  # atomic: concurrent builders each publish a complete file
    return out


def cache_dir() -> Path:
    """Where built objects are kept (see the module docstring)."""
    root = env.cache_dir()
    if root:
        return Path(root) / "kernels"
    xdg = env.xdg_cache_home()
    return Path(xdg or Path.home() / ".cache") / "kvfence" / "kernels"


def private_cache() -> Path | None:
    """``cache_dir()``, made if missing; None (logged) if it is not a directory of this user's that only they can
    write to."""
    path = cache_dir()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        log.warning("cannot make the kernel cache %s (%s): slower Python paths", path, e)
        return None
    problem = _not_private(st) or _unsafe_parent(path.parent.stat())
    if problem:
        log.error("refusing the kernel cache %s: %s. Remove it, or set KVFENCE_CACHE_DIR to a directory of your "
                  "own (mode 0700); until then the C kernels are not loaded (slower Python paths)", path, problem)
        return None
    return path


def _not_private(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o022:
        return f"others may write into it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _unsafe_parent(st: os.stat_result) -> str | None:
    """Whoever may write into the parent could swap the cache for their own after it was checked."""
    if st.st_uid not in (os.getuid(), 0):
        return f"its parent is owned by uid {st.st_uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"others may write into its parent (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def load_extension(source: Path, name: str) -> ModuleType | None:
    """``source``, a CPython extension defining module ``name``, built and imported; None where Python's headers
    (python3-dev) or a compiler are missing or the build fails (logged)."""
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        log.info("no Python headers at %s (python3-dev): %s is not built (slower Python path)", include, source.name)
        return None
    path = build(source, ["-O2", "-shared", "-fPIC", f"-I{include}"], suffix=sysconfig.get_config_var("EXT_SUFFIX")
                 or ".so")
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a path with the extension suffix: an extension loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
