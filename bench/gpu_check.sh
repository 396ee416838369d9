#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py, docs/gpu.md): bench/gpu_check.sh OUTDIR [its options].
# Where the service's packages are missing and .gpu-kit/wheels holds wheels (carried to a lent
# device, which has no network: bench/gpu_prepare.sh), they are installed first, into a folder of
# their own and from that folder alone (--no-index): nothing comes from the network. PYTHON names
# the interpreter (default python3).
set -euo pipefail
out=$(realpath -m "${1:?usage: bench/gpu_check.sh OUTDIR [options of python -m bench.gpu_check]}")
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import fastapi, uvicorn, pydantic_settings" 2>/dev/null && compgen -G ".gpu-kit/wheels/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/gpu-kit-site
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu-kit/wheels/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m bench.gpu_check --out "$out" "$@"
