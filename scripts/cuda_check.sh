#!/usr/bin/env bash
# The CUDA check: tests/test_cuda.py (forward against transformers, batch invariance, engine, colocated and
# disaggregated servers through the openai client), bench/decode.py --device cuda on a random-weight model with
# SmolLM2-135M's shapes, and bench/serve.py --compare (colocated vs disaggregated serving on the GPU, issue #7's
# workload at concurrency 1, 16 and 32). Logs and JSON go to $OUT (default /tmp/kvfence-cuda-check).
#
#   bash scripts/cuda_check.sh --prepare   # here, on a CPU host: wheels for what the GPU image lacks (.whl/), and
#                                          # SmolLM2's tokenizer files (.devcheck/), which need the bundled GGUF
#   bash scripts/cuda_check.sh [tests] [decode] [serve]   # there, on the GPU host (default: all three), with
#                                          # those two folders beside the code
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvfence-cuda-check}
export TMPDIR=$PWD/.devcheck/tmp PYTHONUNBUFFERED=1
# The GPU image has torch, transformers, tokenizers, numpy, pytest ...; these are kvfence's and the tests' others.
WHEELS="gguf==0.19.0 msgspec==0.23.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4
pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0
opentelemetry-api==1.45.2 uvicorn==0.55.0 openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
h11==0.16.0 jiter==0.19.0 sniffio==1.3.1"

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p .whl "$TMPDIR"
    for w in $WHEELS; do
        .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$w" || exit 1
    done
    .venv/bin/python -c "from tests.tiny_models import tokenizer_files_dir; print(tokenizer_files_dir())" || exit 1
    du -sh .whl .devcheck
    exit 0
fi

mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvfence-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvfence-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
parts=${*:-tests decode serve}
status=0
if [[ " $parts " == *" tests "* ]]; then
    python3 -m pytest -q -rs -p no:cacheprovider --timeout 300 tests/test_cuda.py tests/test_pool.py \
        tests/test_sampler.py 2>&1 | tee "$OUT/tests.log" || status=1
    tail -n 40 "$TMPDIR"/kvfence-serve-*.log > "$OUT/servers.log" 2>/dev/null
fi
model=$(python3 -c "from tests.tiny_models import smollm2_shaped_dir; print(smollm2_shaped_dir())") || exit 1
if [[ " $parts " == *" decode "* ]]; then
    python3 bench/decode.py --device cuda --model "$model" --rounds 3 --json "$OUT/decode_cuda.json" 2>&1 \
        | tee "$OUT/decode.log" || status=1
fi
if [[ " $parts " == *" serve "* ]]; then
    python3 bench/serve.py --compare --server-args "--device cuda --model $model" --concurrency 1 16 32 \
        --repeats 1 --json "$OUT/serve_cuda.json" 2>&1 | tee "$OUT/serve.log" || status=1
    tail -n 30 "$TMPDIR"/kvfence-serve-*.log >> "$OUT/servers.log" 2>/dev/null
fi
exit $status
