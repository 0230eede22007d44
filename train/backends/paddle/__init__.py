"""PaddlePaddle backend.

``import zlib`` comes first on purpose: libpaddle.so exports its own copy of zlib's symbols, and
Python's zlib module (used by PNG decoding paths, aiohttp/s3fs, gzip) loaded after
``import paddle`` binds to that copy and fails with "zlib.error: inconsistent stream state" or
aborts in inflateReset2. Loaded before paddle, it binds to the system zlib.
"""

import zlib  # noqa: F401  (must precede any paddle import; see above)
