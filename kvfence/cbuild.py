"""Build a C source into a shared object once per machine, user and content; the model kernels, the shm copy and
the L3 tag check use it. Nothing here raises: without a compiler, or when the build fails, callers get None and
keep their Python path."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def build(source: Path, flags: list[str], deps: list[Path] | None = None, suffix: str = ".so") -> Path | None:
    """The shared object built from ``source`` (and the ``deps`` it includes) with ``flags``, cached under the
    temp dir by content and compiler; None if it cannot be built here (logged)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.warning("no C compiler: %s is not built (slower Python path)", source.name)
        return None
    text = b"".join(p.read_bytes() for p in [source, *(deps or [])])
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"kvfence-kernels-{os.getuid()}" / f"{source.stem}-{key}{suffix}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
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
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
