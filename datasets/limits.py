"""Sizes the data layer refuses past, in a module of constants only: the config's defaults
(train/config/fields.py) import them without loading a decoder."""

from __future__ import annotations

# data.max_image_pixels' default: 40 Mpixels (120 MB as RGB, per worker) fits ImageNet's largest
# photos and text lines thousands of pixels long; a 20000 x 20000 scan or a PNG decompression
# bomb (a few KB that inflate to gigabytes) is refused from its header, before any pixel.
MAX_IMAGE_PIXELS = 40_000_000
