"""Framework-free data layer: readers, decoding, transforms, caching and the bad-sample policy.

Nothing in this package imports PaddlePaddle or PyTorch (tests/test_framework_free.py checks), so
both images share it. The framework adapters live in train/backends/<framework>/.

Name hazard: this package is called ``datasets``, like Hugging Face's library on PyPI, which no
requirement file installs. The project is installed editable only (``pip install --no-deps -e
.``: make setup's venvs and the images): that writes no ``datasets/`` folder into site-packages
(a regular install would write into the folder of Hugging Face's library, where one is
installed), only a finder that maps the name to this folder. In an environment that also has
Hugging Face's ``datasets``, site-packages comes first, except from the repository root
(``python -m train``, pytest), where this folder does; ``import train`` then fails at once,
naming the file that ``datasets`` resolved to (train/__init__.py).
"""

SCHEMA_VERSION = 1
