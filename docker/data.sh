#!/usr/bin/env bash
# Fill a named data volume with synthetic data, once (services data-ocr / data-resnet50 in
# compose.yaml). Your own data (OCR_DATA / RESNET_DATA set to a host folder) is mounted only into
# the training services, read-only, never here: this script then does nothing.
#   docker/data.sh ocr | resnet50
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
    ocr)
        if [[ -n "${OCR_DATA:-}" ]]; then
            echo "data-ocr: OCR_DATA=$OCR_DATA is mounted instead: no synthetic data written"
        elif [[ -f /data/ocr/charset.txt && -d /data/ocr/val ]]; then
            echo "data-ocr: synthetic OCR data already in the volume"
        else
            # --charset full: Latin + common Chinese characters (the image has a CJK font).
            python scripts/make_synthetic.py ocr --out /data/ocr --num "${SYNTH_OCR_NUM:-6000}" \
                --seed 0 --charset "${SYNTH_OCR_CHARSET:-full}" --quiet --overwrite
        fi
        ;;
    resnet50)
        if [[ -n "${RESNET_DATA:-}" ]]; then
            echo "data-resnet50: RESNET_DATA=$RESNET_DATA is mounted instead: no synthetic data written"
        elif [[ -f /data/resnet50/val.h5 ]]; then
            echo "data-resnet50: synthetic ImageNet data already in the volume"
        else
            python scripts/make_synthetic.py imagenet --out /data/resnet50/train.h5 \
                --num "${SYNTH_IMAGENET_NUM:-2000}" --classes 10 --seed 0 --quiet --overwrite
            # val last: its presence marks a complete volume (writers are atomic)
            python scripts/make_synthetic.py imagenet --out /data/resnet50/val.h5 --num 400 \
                --classes 10 --seed 1 --quiet --overwrite
        fi
        ;;
    *)
        echo "usage: docker/data.sh ocr|resnet50" >&2
        exit 2
        ;;
esac
