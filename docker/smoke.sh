#!/usr/bin/env bash
# Smoke tests inside an image (services smoke-paddle / smoke-torch in compose.yaml):
# framework import, /dev/shm size, then a pytest subset that runs real DataLoader workers.
#   docker/smoke.sh paddle|torch        SMOKE_TESTS="tests/x.py ..." picks other tests
#   EXPECT_SHM_BYTES=N                  fail unless /dev/shm is exactly N bytes (CI sets it)
set -euo pipefail
cd "$(dirname "$0")/.."
framework="${1:?usage: docker/smoke.sh paddle|torch}"

python - "$framework" <<'PY'
import importlib, os, sys
fw = importlib.import_module(sys.argv[1])
st = os.statvfs("/dev/shm")
print(f"smoke: python {sys.version.split()[0]}, {sys.argv[1]} {fw.__version__}, "
      f"/dev/shm {st.f_blocks * st.f_frsize} bytes, {os.cpu_count()} CPUs, uid {os.getuid()}")
want = os.environ.get("EXPECT_SHM_BYTES")
if want and int(want) != st.f_blocks * st.f_frsize:
    sys.exit(f"smoke: FAIL /dev/shm is {st.f_blocks * st.f_frsize} bytes, expected {want}")
PY

case "$framework" in
    paddle) default="tests/test_config.py tests/test_lmdb_ocr.py tests/test_workers.py tests/test_scripts.py tests/test_dashboards.py"
            marks="not torch and not slow" ;;
    torch) default="tests/test_config.py tests/test_hdf5_and_folders.py tests/test_workers.py tests/test_backend_torch.py tests/test_dashboards.py"
           marks="not paddle and not slow" ;;
    *) echo "usage: docker/smoke.sh paddle|torch" >&2; exit 2 ;;
esac
read -r -a tests <<< "${SMOKE_TESTS:-$default}"
existing=()
for t in "${tests[@]}"; do
    if [[ -e "${t%%::*}" ]]; then existing+=("$t"); else echo "smoke: $t not in this image, skipped"; fi
done
export TEST_FRAMEWORK="$framework"  # a framework test that cannot import it fails, not skips
exec python -m pytest -q -p no:cacheprovider -m "$marks" "${existing[@]}"
