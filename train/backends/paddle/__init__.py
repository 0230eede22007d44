"""PaddlePaddle backend.

compat.py comes first on purpose: it loads the system zlib (Python's module and libz.so.1)
before paddle, and holds every other workaround for Paddle 2.6 (docs/paddle_png_zlib.md).
"""

from train.backends.paddle import compat  # noqa: F401  (must precede any paddle import)
