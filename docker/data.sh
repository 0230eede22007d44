#!/usr/bin/env bash
# Prepare the volumes a training service needs (services data-ocr / data-resnet50 in
# compose.yaml, which run this as root and finish before training starts):
#   1. /runs (the host's ./runs, bind-mounted): Docker creates a missing ./runs as root:root, which
#      training, running as HOST_UID:HOST_GID, could not write. A root-owned, empty /runs is
#      handed to HOST_UID:HOST_GID; one that belongs to someone else is never changed, and if
#      HOST_UID cannot write it this fails here with the fix instead of later in training.
#   2. Synthetic data into the named data volume, written as the image's user (uid 1000), once:
#      a second run finds it and writes nothing. Your own data (OCR_DATA / RESNET_DATA set to a
#      host folder) is mounted only into the training services, read-only: nothing is written.
#   docker/data.sh ocr | resnet50
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "data: $*"; }
TRAIN_USER_UID=$(id -u trainer)  # the image's user; owns /data/<task> in the image

prepare_runs() {
    local uid="${HOST_UID:-1000}" gid="${HOST_GID:-1000}" owner
    [[ -d /runs ]] || return 0
    owner=$(stat -c %u /runs)
    if [[ "$owner" == 0 && "$uid" != 0 && -z "$(ls -A /runs)" ]]; then
        chown "$uid:$gid" /runs
        say "/runs (host: \${RUNS_DIR:-./runs}) was created root-owned by Docker: now $uid:$gid"
    fi
    if ! setpriv --reuid="$uid" --regid="$gid" --clear-groups test -w /runs; then
        say "FAIL /runs (host: \${RUNS_DIR:-./runs}) is owned by $(stat -c %u:%g /runs)," \
            "mode $(stat -c %a /runs); training runs as $uid:$gid and cannot write it." >&2
        say "Fix: run as its owner (printf 'HOST_UID=%s\nHOST_GID=%s\n' \$(id -u) \$(id -g)" \
            ">> .env), or chown the folder to $uid:$gid, or set RUNS_DIR to a folder you own." >&2
        exit 1
    fi
}

as_train_user() { setpriv --reuid="$TRAIN_USER_UID" --regid="$TRAIN_USER_UID" --clear-groups "$@"; }

if [[ "$(id -u)" == 0 ]]; then
    prepare_runs
else
    as_train_user() { "$@"; }  # already unprivileged (e.g. a pod's runAsUser): write as we are
fi

case "${1:-}" in
    ocr)
        if [[ -n "${OCR_DATA:-}" ]]; then
            say "OCR_DATA=$OCR_DATA is mounted instead: no synthetic data written"
        elif [[ -f /data/ocr/charset.txt && -d /data/ocr/val ]]; then
            say "synthetic OCR data already in the volume"
        else
            # --charset full: Latin + common Chinese characters (the image has a CJK font).
            as_train_user python -m scripts.make_synthetic ocr --out /data/ocr \
                --num "${SYNTH_OCR_NUM:-6000}" --seed 0 --charset "${SYNTH_OCR_CHARSET:-full}" \
                --max-len "${SYNTH_OCR_MAX_LEN:-10}" --quiet --overwrite
            say "wrote $(du -sh /data/ocr | cut -f1) of synthetic OCR data as uid $TRAIN_USER_UID"
        fi
        ;;
    resnet50)
        if [[ -n "${RESNET_DATA:-}" ]]; then
            say "RESNET_DATA=$RESNET_DATA is mounted instead: no synthetic data written"
        elif [[ -f /data/resnet50/val.h5 ]]; then
            say "synthetic ImageNet data already in the volume"
        else
            as_train_user python -m scripts.make_synthetic imagenet --out /data/resnet50/train.h5 \
                --num "${SYNTH_IMAGENET_NUM:-2000}" --classes 10 --seed 0 --quiet --overwrite
            # val last: its presence marks a complete volume (writers are atomic)
            as_train_user python -m scripts.make_synthetic imagenet --out /data/resnet50/val.h5 \
                --num 400 --classes 10 --seed 1 --quiet --overwrite
            say "wrote $(du -sh /data/resnet50 | cut -f1) of synthetic ImageNet data as uid" \
                "$TRAIN_USER_UID"
        fi
        ;;
    *)
        echo "usage: docker/data.sh ocr|resnet50" >&2
        exit 2
        ;;
esac
