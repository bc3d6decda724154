#!/usr/bin/env bash
# The GPU run in one call, on a machine with a CUDA GPU, its own torch and Triton, and this tree:
#   OUT=/some/dir bash benchmarks/gpu/run_on_device.sh
# Installs nothing from outside. Where the machine's Python lacks kvtool's zstandard or lz4, wheels
# placed beforehand in .whl/ (pip download --only-binary=:all: for that Python) are installed into a
# scratch folder. Then, each part under its own time limit, everything logged to $OUT/run.log:
#   1. the machine: nvidia-smi, the Python, torch, Triton and the GPU they see ($OUT/env.json);
#   2. kvtool's C core built for that Python (the CPU-decode restore needs it; without a compiler the
#      numpy reference runs, which the log says);
#   3. the GPU path's tests on CUDA (tests/test_gpu_decode.py, tests/test_gpu_restore.py): every decode
#      and paged restore bit for bit against the CPU decode;
#   4. benchmarks/gpu/gpu_restore.py in full ($OUT/gpu_restore.json): decode GB/s, raw against
#      compressed host-to-device, the paged GPU restore and the exphuff CPU-decode restore, each
#      row naming the GPU.
# About 6 minutes on an H100 or H200, so that a second run fits in 15 minutes of device time.
# SMOKE=1 runs the benchmark at tiny sizes (on a machine without a GPU: Triton's interpreter), to check
# the script itself before device time is spent.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0

part() {  # part NAME SECONDS COMMAND...: run it under a time limit, log how it ended, go on either way
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@"
    local status=$?
    echo "== $name: exit $status after $((SECONDS - started)) s"
    [ "$status" = 0 ] || failed=1
}

if compgen -G ".whl/*.whl" >/dev/null; then
    part wheels 120 "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvtool-site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/kvtool-site"
fi
part machine 60 nvidia-smi
part versions 120 "$py" - "$OUT/env.json" <<'PY'
import json, platform, sys
from importlib import metadata
import torch, triton
info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
for package in ("numpy", "ml_dtypes", "xxhash", "safetensors", "zstandard", "lz4"):
    try:
        info[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
        info[package] = "missing"
print(json.dumps(info, indent=1))
open(sys.argv[1], "w").write(json.dumps(info, indent=1) + "\n")
PY
part build-core 240 "$py" setup.py -q build_ext --inplace --parallel 16
part native-status 60 "$py" -c "from kvtool import _native; print('kvtool native core:', _native.status())"
part tests 240 "$py" -m pytest -q -p no:cacheprovider tests/test_gpu_decode.py tests/test_gpu_restore.py
part benchmark 420 "$py" benchmarks/gpu/gpu_restore.py --json "$OUT/gpu_restore.json" ${SMOKE:+--smoke}
echo "run_on_device: $([ "$failed" = 0 ] && echo 'every part passed' || echo 'a part failed: see above')"
exit "$failed"
