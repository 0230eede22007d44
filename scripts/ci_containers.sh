#!/usr/bin/env bash
# Build and run the container images in CI, on a host with no Docker daemon, no GPU and no
# registry access (see shared/DESIGN.md section 5):
#
#   scripts/ci_containers.sh            # as root; installs podman & co. itself
#
#   1. install      apt: podman runc debootstrap ...; pip: podman-compose 1.6.0 (own venv)
#   2. storage      untag this script's images of an earlier run (unless CI_KEEP=1), prune the
#                   untagged ones, then check podman's storage has room for a cold build
#   3. rootfs       debootstrap --variant=minbase bookworm, imported as a podman image
#   4. stand-ins    CPU stand-ins for the GPU base images (docker/standin.Dockerfile):
#                   python 3.11 + paddlepaddle==2.6.2 / torch==2.6.0 torchvision==0.21.0
#   5. images       docker/paddle.Dockerfile and docker/torch.Dockerfile, --build-arg BASE_IMAGE=
#   6. smoke        compose services smoke-paddle / smoke-torch (compose.yaml + compose.cpu.yaml):
#                   /dev/shm inside == the compose file's shm_size, then the pytest subset
#   7. compose      `podman-compose up train-ocr` with compose.cpu.yaml on the OCR smoke config:
#                   data-ocr writes synthetic data into a named volume, train-ocr trains from it
#                   read-only and leaves summary.json in the runs volume
#
# Prints PASS/FAIL and the time of each step, and a summary; exit 1 if any step failed. The
# images replaced by this run are pruned at its end, so a CI host's storage holds one set.
# Logs: .cache/ci-containers/logs/. The real GPU bases stay the Dockerfiles' defaults.
# Knobs: CI_KEEP=1 keeps the stand-in/rootfs images of an earlier run (faster reruns);
#        PIP_CACHE_DIR (default ~/.cache/pip, shared with `make setup`) is mounted into the
#        stand-in builds, so torch's ~2.5 GB of wheels are not downloaded twice.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK="$ROOT/.cache/ci-containers"
LOGS="$WORK/logs"
mkdir -p "$LOGS"

PROJECT=starved-gpu-ci
ROOTFS_IMAGE=localhost/standin-rootfs:bookworm
STANDIN_PADDLE=localhost/standin-paddle:2.6.2
STANDIN_TORCH=localhost/standin-torch:2.6.0
export PADDLE_IMAGE=localhost/starved-gpu/paddle:ci
export TORCH_IMAGE=localhost/starved-gpu/torch:ci
HOST_CA=/etc/ssl/certs/ca-certificates.crt
PIP_CACHE="${PIP_CACHE_DIR:-$HOME/.cache/pip}"
mkdir -p "$PIP_CACHE"

# Limits podman accepts on this host: at or below the caller's hard limits (DESIGN.md 5).
# --format docker (builds): the OCI format ignores SHELL, and with it `set -o pipefail`.
PODMAN=(podman --runtime runc)
RUN_LIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
hard_nofile=$(ulimit -Hn)
[[ "$hard_nofile" == unlimited || "$hard_nofile" -gt 65536 ]] && hard_nofile=65536
export NOFILE="$hard_nofile"
hard_memlock=$(ulimit -Hl)
if [[ "$hard_memlock" == unlimited ]]; then export MEMLOCK=-1; else export MEMLOCK=$((hard_memlock * 1024)); fi

declare -a RESULTS=()
FAILED=0
T0=$(date +%s)

# step NAME CMD...: run CMD with output in $LOGS/NAME.log; PASS/FAIL line with its duration.
step() {
    local name="$1"; shift
    local start=$(date +%s) rc
    echo "=== $name: $*" | cut -c1-200
    "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    local secs=$(( $(date +%s) - start ))
    if [[ $rc -eq 0 ]]; then
        RESULTS+=("PASS  $(printf '%5ds' "$secs")  $name")
        echo "PASS $name (${secs}s)"
    else
        RESULTS+=("FAIL  $(printf '%5ds' "$secs")  $name (rc $rc, log $LOGS/$name.log)")
        echo "FAIL $name (${secs}s, rc $rc); last lines of $LOGS/$name.log:"
        tail -n 40 "$LOGS/$name.log" | sed 's/^/    /'
        FAILED=1
    fi
    return $rc
}

summary() {
    echo
    echo "=== ci_containers summary (total $(( ($(date +%s) - T0) / 60 )) min $(( ($(date +%s) - T0) % 60 )) s)"
    printf '%s\n' "${RESULTS[@]}"
    "${PODMAN[@]}" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' 2>/dev/null \
        | grep -E 'standin|starved-gpu' | sed 's/^/image  /'
    if [[ $FAILED -eq 0 ]]; then echo "ci_containers: PASS"; else echo "ci_containers: FAIL"; fi
}

# ---------------------------------------------------------------- 1. install
install_tools() {
    local need=()
    for cmd in podman runc debootstrap newuidmap slirp4netns fuse-overlayfs; do
        command -v "$cmd" > /dev/null || need+=("$cmd")
    done
    if [[ ${#need[@]} -gt 0 ]]; then
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            podman runc debootstrap uidmap slirp4netns fuse-overlayfs
    fi
    if [[ ! -x "$WORK/venv/bin/podman-compose" ]]; then
        python3 -m venv "$WORK/venv"
        "$WORK/venv/bin/pip" install -q --disable-pip-version-check podman-compose==1.6.0
    fi
    "${PODMAN[@]}" --version && "$WORK/venv/bin/podman-compose" --version
}

# ---------------------------------------------------------------- 2. storage
# A cold run replaces every image below. The replaced ones stay in podman's storage, untagged,
# until something prunes them: ~9 GB a run, most of it torch's CUDA wheels (PyPI has no CPU
# build of torch 2.6.0). A CI host that keeps its storage between runs filled its disk that
# way, and failed while committing the torch stand-in's 5.4 GB layer, which podman first
# writes whole to a temporary file (image_copy_tmp_dir, /var/tmp by default).
OUR_IMAGES=("$PADDLE_IMAGE" "$TORCH_IMAGE" "$STANDIN_PADDLE" "$STANDIN_TORCH" "$ROOTFS_IMAGE")
# A cold build's peak, at the torch stand-in's commit, was 21 GB over the free space before it
# (df every 5 s; /var/tmp on the same file system). Kept images (CI_KEEP=1) need a few GB.
COLD_BUILD_GB=24
LAYER_TMP_GB=6    # torch's stand-in layer, written whole to the temporary directory

free_gb() { df --output=avail -B1G "$1" | tail -n 1 | tr -d ' '; }

prune_images() { "${PODMAN[@]}" image prune -f > /dev/null; }

make_room() {
    if [[ "${CI_KEEP:-0}" != 1 ]]; then
        # Untag first: podman keeps the layers of tagged images; prune then drops them.
        local image
        for image in "${OUR_IMAGES[@]}"; do
            "${PODMAN[@]}" image exists "$image" && "${PODMAN[@]}" untag "$image" "$image"
        done
    fi
    compose down -v > /dev/null 2>&1  # containers of an interrupted run hold their images
    prune_images || return 1
    local store tmp need=$COLD_BUILD_GB
    store=$("${PODMAN[@]}" info --format '{{.Store.GraphRoot}}') || return 1
    tmp="${TMPDIR:-/var/tmp}"
    [[ "${CI_KEEP:-0}" == 1 ]] && "${PODMAN[@]}" image exists "$STANDIN_TORCH" && need=4
    echo "free: $(free_gb "$store") GB in $store (need $need), $(free_gb "$tmp") GB in $tmp" \
         "(need $LAYER_TMP_GB)"
    if [[ $(free_gb "$store") -lt $need || $(free_gb "$tmp") -lt $LAYER_TMP_GB ]]; then
        echo "not enough disk for the images: free space on those file systems (podman" \
             "system df shows what podman holds), or point TMPDIR at a larger one."
        return 1
    fi
}

# ---------------------------------------------------------------- 3. rootfs
make_rootfs() {
    if [[ "${CI_KEEP:-0}" == 1 ]] && podman image exists "$ROOTFS_IMAGE"; then
        echo "kept $ROOTFS_IMAGE"; return 0
    fi
    local dir="$WORK/rootfs"
    rm -rf "$dir"
    debootstrap --variant=minbase bookworm "$dir" http://deb.debian.org/debian \
        && tar -C "$dir" -c . | "${PODMAN[@]}" import - "$ROOTFS_IMAGE" \
        && rm -rf "$dir"
}

# ---------------------------------------------------------------- 4. stand-in bases
build_standin() {  # TAG "FRAMEWORK PINS"
    if [[ "${CI_KEEP:-0}" == 1 ]] && podman image exists "$1"; then echo "kept $1"; return 0; fi
    local empty="$WORK/empty-context"
    mkdir -p "$empty"
    "${PODMAN[@]}" build --format docker --network host "${RUN_LIMITS[@]}" \
        -v "$HOST_CA:/etc/ssl/host-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/host-ca.crt \
        -v "$PIP_CACHE:/root/.cache/pip" \
        --build-arg ROOTFS_IMAGE="$ROOTFS_IMAGE" --build-arg FRAMEWORK_PIP="$2" \
        -f "$ROOT/docker/standin.Dockerfile" -t "$1" "$empty"
}

build_standins() {  # both at once: torch is download-bound, paddle mostly too
    build_standin "$STANDIN_PADDLE" "paddlepaddle==2.6.2" > "$LOGS/standin-paddle.log" 2>&1 &
    local p=$!
    build_standin "$STANDIN_TORCH" "torch==2.6.0 torchvision==0.21.0" > "$LOGS/standin-torch.log" 2>&1
    local rc_torch=$? rc_paddle=0
    wait $p || rc_paddle=$?
    tail -n 3 "$LOGS/standin-paddle.log" "$LOGS/standin-torch.log"
    [[ $rc_paddle -eq 0 && $rc_torch -eq 0 ]]
}

# ---------------------------------------------------------------- 5. project images
build_image() {  # Dockerfile BASE TAG
    "${PODMAN[@]}" build --format docker --network host "${RUN_LIMITS[@]}" \
        -v "$HOST_CA:$HOST_CA:ro" --build-arg BASE_IMAGE="$2" \
        -f "$1" -t "$3" "$ROOT"
}

# ---------------------------------------------------------------- 6./7. compose
compose() {
    # nproc: podman's default is above this host's hard limit (runc: "error setting rlimit type 6")
    "$WORK/venv/bin/podman-compose" --podman-args="--runtime runc" \
        --podman-run-args="--ulimit nproc=1024:1024" -p "$PROJECT" \
        -f "$ROOT/compose.yaml" -f "$ROOT/compose.cpu.yaml" "$@"
}

shm_bytes_of() {  # SERVICE -> its resolved shm_size in bytes, from the compose files
    compose config 2>/dev/null | python3 -c '
import sys, yaml
size = str(yaml.safe_load(sys.stdin)["services"][sys.argv[1]]["shm_size"]).strip().lower()
units = {"b": 1, "k": 2**10, "m": 2**20, "g": 2**30}
print(int(float(size[:-1]) * units[size[-1]]) if size[-1] in units else int(size))' "$1"
}

smoke() {  # SERVICE
    local want
    want=$(shm_bytes_of "$1") || return 1
    echo "expect /dev/shm = $want bytes (shm_size of $1)"
    EXPECT_SHM_BYTES="$want" compose run --rm "$1"
}

compose_train_ocr() {
    compose down -v > /dev/null 2>&1  # fresh volumes: data-ocr must really write the data
    export OCR_CONFIG=configs/ocr/smoke.yaml SYNTH_OCR_NUM="${CI_OCR_NUM:-2000}"
    export OCR_SET="--set data.train=/data/ocr/train --set data.val=/data/ocr/val
        --set data.char_dict=/data/ocr/charset.txt --set train.max_steps=${CI_OCR_STEPS:-100}
        --output-dir /runs/ocr-smoke-ci --overwrite"
    # Data first, as its own `up`: podman-compose 1.6 starts train-ocr without waiting for
    # depends_on's service_completed_successfully (Docker Compose waits).
    compose up --no-build data-ocr || return 1
    compose up --no-build --no-deps train-ocr || return 1
    local rc
    rc=$("${PODMAN[@]}" inspect --format '{{.State.ExitCode}}' "${PROJECT}_train-ocr_1") || return 1
    echo "train-ocr exit code: $rc"
    [[ "$rc" == 0 ]] || return 1
    "${PODMAN[@]}" run --rm "${RUN_LIMITS[@]}" -v "${PROJECT}_runs:/runs:ro" --entrypoint cat \
        "$PADDLE_IMAGE" /runs/ocr-smoke-ci/summary.json
}

step install install_tools || { summary; exit 1; }
step storage make_room || { summary; exit 1; }
step rootfs make_rootfs || { summary; exit 1; }
step standin-bases build_standins || { summary; exit 1; }
step image-paddle build_image docker/paddle.Dockerfile "$STANDIN_PADDLE" "$PADDLE_IMAGE"
step image-torch build_image docker/torch.Dockerfile "$STANDIN_TORCH" "$TORCH_IMAGE"
podman image exists "$PADDLE_IMAGE" && step smoke-paddle smoke smoke-paddle
podman image exists "$TORCH_IMAGE" && step smoke-torch smoke smoke-torch
podman image exists "$PADDLE_IMAGE" && step compose-train-ocr compose_train_ocr
compose down > /dev/null 2>&1
prune_images  # the images this run replaced
summary
exit $FAILED
