"""Transforms match the conventions users compare us with: PaddleOCR's RecResizeImg and
CTCLabelEncode (paddle env), torchvision's RandomResizedCrop and Resize+CenterCrop (torch env)."""

from __future__ import annotations

import numpy as np
import pytest

from datasets import decode, image_transforms
from datasets.errors import BadSampleError, DatasetError
from datasets.ocr_transforms import PAD_VALUE, CharDict, augment_text_line, resize_and_pad
from datasets.synthetic import encode_image, imagenet_like


def test_resize_and_pad_keeps_ratio_and_pads_right(rng):
    image = rng.integers(0, 256, (32, 100, 3), dtype=np.uint8)
    out, ratio = resize_and_pad(image, (3, 48, 320))
    assert out.shape == (48, 320, 3) and out.dtype == np.uint8  # H, W, C
    assert ratio == 150 / 320  # ceil(48 * 100 / 32) = 150
    assert (out[:, 150:] == PAD_VALUE).all() and (out[:, :150] != PAD_VALUE).any()
    wide, ratio = resize_and_pad(rng.integers(0, 256, (20, 900, 3), dtype=np.uint8), (3, 48, 320))
    assert ratio == 1.0 and wide.shape == (48, 320, 3)
    gray, _ = resize_and_pad(image, (1, 32, 128))
    assert gray.shape == (32, 128, 1)


def test_char_dict_encoding_and_errors(tmp_path):
    chars = CharDict(list("abc"), use_space_char=True)
    assert chars.num_classes == 5
    encoded, length = chars.encode("ab c", 6)
    assert encoded.tolist() == [1, 2, 4, 3, 0, 0] and length == 4
    assert chars.decode(encoded) == "ab c"
    for label, kind in (
        ("", "empty_label"),
        ("abz", "label_out_of_dict"),
        ("a" * 7, "label_too_long"),
    ):
        with pytest.raises(BadSampleError) as info:
            chars.encode(label, 6)
        assert info.value.kind == kind
        # encode_into (a batch row) refuses the same labels and leaves the row as it was
        row = np.full(6, 9, dtype=np.int32)
        with pytest.raises(BadSampleError) as info:
            chars.encode_into(label, 6, row)
        assert info.value.kind == kind and row.tolist() == [9] * 6
    row = np.full(6, 9, dtype=np.int32)
    assert chars.encode_into("ab c", 6, row) == 4 and row.tolist() == encoded.tolist()
    (tmp_path / "d.txt").write_text("a\nbb\n")
    with pytest.raises(DatasetError, match="exactly one character"):
        CharDict.from_file(tmp_path / "d.txt")
    with pytest.raises(DatasetError, match="not found.*HINT"):
        CharDict.from_file(tmp_path / "missing.txt")


def test_text_augmentation_is_uint8_and_seeded(rng):
    image = rng.integers(0, 256, (40, 160, 3), dtype=np.uint8)
    a = augment_text_line(image, np.random.default_rng(5))
    b = augment_text_line(image, np.random.default_rng(5))
    assert a.dtype == np.uint8 and a.ndim == 3 and np.array_equal(a, b)


def test_decode_classifies_containers():
    good = encode_image(np.zeros((8, 8, 3), np.uint8), "png")
    assert decode.check_encoded(good) == "png"
    for data, kind in (
        (b"", "empty_image"),
        (b"GIF8", "garbage_image"),
        (good[:-20], "truncated_image"),
    ):
        with pytest.raises(BadSampleError) as info:
            decode.decode_bgr(data)
        assert info.value.kind == kind


def test_random_resized_crop_box_distribution_matches_the_definition():
    rng = np.random.default_rng(0)
    width, height = 500, 375
    boxes = np.array(
        [image_transforms.random_resized_crop_box(width, height, rng) for _ in range(4000)]
    )
    left, top, w, h = boxes.T
    assert (left >= 0).all() and (top >= 0).all()
    assert (left + w <= width).all() and (top + h <= height).all()
    scale = w * h / (width * height)
    assert scale.min() >= 0.07 and scale.max() <= 1.0
    # Area is drawn uniform in [0.08, 1]; with the aspect ratio some large boxes do not fit.
    assert 0.40 < scale.mean() < 0.56  # (boxes that do not fit are redrawn, lowering it)
    ratio = np.log(w / h)
    assert np.abs(ratio).max() <= np.log(4 / 3) + 0.05


@pytest.mark.torch
def test_random_resized_crop_matches_torchvision_statistics():
    import torch
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    image = torch.zeros(3, 375, 500)
    theirs = np.array(
        [RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(4000)]
    )  # (top, left, h, w)
    rng = np.random.default_rng(1)
    ours = np.array([image_transforms.random_resized_crop_box(500, 375, rng) for _ in range(4000)])
    their_area = theirs[:, 2] * theirs[:, 3] / (500 * 375)
    our_area = ours[:, 2] * ours[:, 3] / (500 * 375)
    their_aspect = np.log(theirs[:, 3] / theirs[:, 2])
    our_aspect = np.log(ours[:, 2] / ours[:, 3])
    for a, b in ((their_area, our_area), (their_aspect, our_aspect)):
        assert abs(a.mean() - b.mean()) < 0.02 and abs(a.std() - b.std()) < 0.02
        assert abs(np.median(a) - np.median(b)) < 0.03


@pytest.mark.torch
def test_eval_transform_matches_torchvision_resize_center_crop():
    import io

    from PIL import Image
    from torchvision import transforms

    data = encode_image(imagenet_like(3, np.random.default_rng(0)), "jpeg")
    reference = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224)])
    import cv2

    theirs = np.asarray(reference(Image.open(io.BytesIO(data)).convert("RGB")))
    ours = image_transforms.eval_transform(data)
    assert ours.shape == theirs.shape == (224, 224, 3)
    # Same geometry, one resampling pass instead of two: sub-pixel differences only, which the
    # synthetic images' pixel noise would exaggerate, so compare their low-pass content.
    blur = [cv2.GaussianBlur(x, (9, 9), 0).astype(np.int16) for x in (ours, theirs)]
    assert np.abs(blur[0] - blur[1]).mean() < 2.0


@pytest.mark.torch
@pytest.mark.parametrize("upscale", [1, 3])  # 3: crops big enough for a 1/2-scale DCT decode
def test_train_transform_matches_torchvision_resized_crop_on_the_same_box(upscale):
    """Same box, same flip, torchvision's resized_crop (PIL, antialiased bilinear) as the
    reference: our libjpeg-turbo decode (reduced scale where the crop allows) + box shrink +
    bilinear resize must give the same picture, up to resampling differences."""
    import io

    import cv2
    from PIL import Image
    from torchvision.transforms import functional

    image = imagenet_like(2, np.random.default_rng(0))
    if upscale > 1:
        image = cv2.resize(image, None, fx=upscale, fy=upscale, interpolation=cv2.INTER_CUBIC)
    data = encode_image(image, "jpeg")
    pil = Image.open(io.BytesIO(data)).convert("RGB")
    for seed in range(12):
        draws = np.random.default_rng(seed)  # the draws train_transform makes, in its order
        left, top, width, height = image_transforms.random_resized_crop_box(*pil.size, draws)
        flip = draws.random() < 0.5
        theirs = functional.resized_crop(pil, top, left, height, width, [224, 224])
        theirs = np.asarray(functional.hflip(theirs) if flip else theirs)
        ours = image_transforms.train_transform(data, np.random.default_rng(seed))
        assert ours.shape == (224, 224, 3) and ours.dtype == np.uint8 and ours.flags.c_contiguous
        # Synthetic images are noisy at the pixel level, which exaggerates resampling
        # differences: compare raw pixels loosely and the low-pass content tightly.
        assert np.abs(ours.astype(np.int16) - theirs).mean() < 8.0, seed
        blur = [cv2.GaussianBlur(x, (9, 9), 0).astype(np.int16) for x in (ours, theirs)]
        assert np.abs(blur[0] - blur[1]).mean() < 1.5, seed


def test_reduced_dct_decoding_is_used_only_when_the_crop_allows():
    large = encode_image(cv2_resize_3x(imagenet_like(1, np.random.default_rng(0))), "jpeg")
    full = decode.decode_rgb(large)
    half = decode.decode_rgb(large, min_width=full.shape[1] // 2, min_height=full.shape[0] // 2)
    assert half.shape[0] == -(-full.shape[0] // 2) and half.shape[1] == -(-full.shape[1] // 2)
    # A 3/4 scale would satisfy a 0.6 minimum, but the slow generic IDCT is never chosen.
    wide = decode.decode_rgb(large, min_width=int(full.shape[1] * 0.6), min_height=1)
    assert wide.shape == full.shape


def cv2_resize_3x(image: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.resize(image, None, fx=3, fy=3, interpolation=cv2.INTER_CUBIC)


@pytest.mark.paddle
def test_ocr_resize_matches_paddleocr_rec_resize_img(rng):
    import paddleocr  # noqa: F401  (puts ppocr on the path)
    from ppocr.data.imaug.rec_img_aug import RecResizeImg

    for shape in ((32, 100), (48, 400), (20, 60)):
        image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        theirs = RecResizeImg(image_shape=[3, 48, 320])({"image": image.copy()})
        ours, ratio = resize_and_pad(image, (3, 48, 320))
        normalized = (ours.transpose(2, 0, 1).astype(np.float32) / 255 - 0.5) / 0.5
        width = int(round(ratio * 320))
        assert ratio == pytest.approx(theirs["valid_ratio"])
        np.testing.assert_allclose(
            normalized[:, :, :width], theirs["image"][:, :, :width], atol=1e-5
        )
        if width < 320:
            assert np.abs(normalized[:, :, width:]).max() < 0.005  # pad ~ their zero padding


@pytest.mark.paddle
def test_ctc_encoding_matches_paddleocr_and_reads_ppocr_keys():
    import os

    import paddleocr
    from ppocr.data.imaug.label_ops import CTCLabelEncode

    keys = os.path.join(os.path.dirname(paddleocr.__file__), "ppocr", "utils", "ppocr_keys_v1.txt")
    ours = CharDict.from_file(keys, use_space_char=True)
    theirs = CTCLabelEncode(max_text_length=25, character_dict_path=keys, use_space_char=True)
    assert ours.num_classes == len(theirs.character)
    for text in ("hello 123", "中文识别", "ABC,def"):
        encoded, length = ours.encode(text, 25)
        reference = theirs({"label": text})
        assert length == reference["length"]
        assert encoded.tolist() == list(reference["label"])
