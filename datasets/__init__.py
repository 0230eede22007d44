"""Framework-free data layer: readers, decoding, transforms, caching and the bad-sample policy.

Nothing in this package imports PaddlePaddle or PyTorch (tests/test_framework_free.py checks), so
both images share it. The framework adapters live in train/backends/<framework>/.

Name hazard: this package is called ``datasets``, like the Hugging Face library on PyPI. Run the
project from the repository root (``python -m train``, ``python scripts/...``) so that this
folder comes first on sys.path, and never install it into site-packages under that name.
"""

SCHEMA_VERSION = 1
