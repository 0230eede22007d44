#!/usr/bin/env bash
# Container entry point: run the preflight doctor on the config the command will use, then exec
# the command, which replaces this shell as PID 1 and so receives `docker stop`'s SIGTERM itself
# (the trainer turns it into "finish the step, save a checkpoint, exit 143").
#
#   docker compose run train-ocr python -m train --config configs/ocr/smoke.yaml --set k=v
#     -> python -m train.doctor --config configs/ocr/smoke.yaml --set k=v ; then the command
#
# The config is the command's own --config (with its --set items and --output-dir, so that the
# doctor checks the run directory the command will really write). The doctor is skipped, with a
# message, when SKIP_DOCTOR=1, when the command has no --config (a shell, pytest, a data script),
# when the command is the doctor itself, or when this image has no train/doctor.py. A FAIL from the doctor stops here (exit 1)
# instead of a bus error or a starved GPU hours later.
set -euo pipefail

say() { echo "entrypoint: $*" >&2; }

# Shorthands used by compose.yaml, so that the scenario is one variable and extra arguments
# are word-split by this shell (compose implementations split `command:` strings differently):
#   train [ARGS]   ->  python -m train --config "$CONFIG" $DEVICE_ARGS $TRAIN_ARGS [ARGS] --auto-resume
#   doctor [ARGS]  ->  python -m train.doctor --config "$CONFIG" $DEVICE_ARGS $TRAIN_ARGS [ARGS]
#   tune [ARGS]    ->  python -m train.tune --config "$CONFIG" $DEVICE_ARGS <TRAIN_ARGS' --set items> [ARGS]
# CONFIG is the scenario file, TRAIN_ARGS e.g. "--set loader.num_workers=6 --overwrite",
# DEVICE_ARGS is set by compose.cpu.yaml ("--set train.device=cpu ..."). `train` adds
# --auto-resume unless the arguments choose --resume or --overwrite themselves: a container that
# `docker compose stop` ended (checkpoint on SIGTERM) or that crashed continues where it was on
# the next `up`, and its first start begins a new run. `tune` takes only the --set items of
# TRAIN_ARGS: the tuner measures the scenario training would run, and has no run flags
# (--overwrite, --resume) of its own.
if [[ "${1:-}" == "train" || "${1:-}" == "doctor" ]]; then
    module=train
    [[ "$1" == "doctor" ]] && module=train.doctor
    shift
    # shellcheck disable=SC2206  # word splitting of the argument strings is the point
    set -- python -m "$module" --config "${CONFIG:?set CONFIG to a scenario file}" \
        ${DEVICE_ARGS:-} ${TRAIN_ARGS:-} "$@"
    if [[ "$module" == train && " $* " != *" --resume "* && " $* " != *" --overwrite "* \
          && " $* " != *" --auto-resume "* ]]; then
        set -- "$@" --auto-resume
    fi
elif [[ "${1:-}" == "tune" ]]; then
    shift
    # shellcheck disable=SC2206  # word splitting of the argument string is the point
    train_args=(${TRAIN_ARGS:-})
    sets=()
    for ((i = 0; i < ${#train_args[@]}; i++)); do
        case "${train_args[i]}" in
            --set) sets+=(--set "${train_args[i + 1]:-}") ;;
            --set=*) sets+=("${train_args[i]}") ;;
        esac
    done
    # shellcheck disable=SC2206
    set -- python -m train.tune --config "${CONFIG:?set CONFIG to a scenario file}" \
        ${DEVICE_ARGS:-} ${sets[@]+"${sets[@]}"} "$@"
fi

config=""
doctor_args=()
is_doctor=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    arg="${args[i]}"
    case "$arg" in
        --config) config="${args[i + 1]:-}" ;;
        --config=*) config="${arg#--config=}" ;;
        --set) doctor_args+=(--set "${args[i + 1]:-}") ;;
        --set=*) doctor_args+=(--set "${arg#--set=}") ;;
        --output-dir) doctor_args+=(--output-dir "${args[i + 1]:-}") ;;
        --output-dir=*) doctor_args+=(--output-dir "${arg#--output-dir=}") ;;
        --resume | --auto-resume | --overwrite) doctor_args+=("$arg") ;;
        train.doctor | train/doctor.py) is_doctor=1 ;;
    esac
done

if [[ $# -eq 0 ]]; then
    say "no command given; try: python -m train --config configs/ocr/single_gpu.yaml"
    exit 2
elif [[ "${SKIP_DOCTOR:-0}" == "1" ]]; then
    say "SKIP_DOCTOR=1: preflight doctor skipped"
elif [[ $is_doctor == 1 ]]; then
    : # the command is the doctor: do not run it twice
elif [[ -z "$config" ]]; then
    say "no --config in the command: preflight doctor skipped"
elif [[ ! -f train/doctor.py ]]; then
    say "train/doctor.py is not in this image yet: preflight doctor skipped"
else
    say "preflight: python -m train.doctor --config $config ${doctor_args[*]}"
    if ! python -m train.doctor --config "$config" "${doctor_args[@]}"; then
        say "preflight doctor reported FAIL (fix above, or SKIP_DOCTOR=1 to start anyway)"
        exit 1
    fi
fi

exec "$@"
