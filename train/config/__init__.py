"""Typed, strict run configuration: one YAML file per scenario, checked before anything starts.

    python -m train.config configs/ocr/smoke.yaml --set loader.num_workers=4

prints the fully resolved config, or exits 2 with one line that says what is wrong and the fix:

    config error: configs/ocr/smoke.yaml: loader.num_wokers: unknown key. Did you mean
    loader.num_workers?

One module per concern: ``schema`` (the dataclasses: every field, its type, its default and its
doc; ``data:`` is the task's own data section, Task.data, which extends ``fields``' DataConfig),
``validate`` (checking a mapping against the schema's type hints, then across fields), ``load``
(YAML files, ``extends:``, ``--set``, ``${NAME}`` and the resolved file a run writes), ``errors``
(the one-line ConfigError). Import from the module that defines a name (``from
train.config.load import load_config``): the package re-exports nothing, so that a reader of
``fields`` (the tasks) does not load the whole loader, which reads the tasks.

Rules of the format
- The schema is the dataclasses in schema.py. Parsing walks their type hints, so a new knob is
  one line. Unknown keys, wrong types and out-of-range values are errors, never silently ignored.
- `extends: base.yaml` deep-merges a file over its base (chains allowed): mappings merge, lists
  and scalars replace. The extends path is relative to the file that contains it; one not
  found there is looked up from the working directory (the repository root), so a file written
  elsewhere (train.tune's tuned.yaml under runs/) can name its scenario as configs/....
- `--set key.path=value` overrides are read as YAML values and checked exactly like file values.
- Dataset and dictionary paths (data.train, data.val, data.char_dict, data.skip_keys_file) are
  relative to the repository root, i.e. the working directory of `python -m train`, NOT to the
  YAML file, so one path means the same in every config. They are kept as written; `s3://` URLs
  are left alone.
- `${NAME}` and `${NAME:-default}` in a string value are replaced by the environment variable
  NAME (the default when it is unset or empty), as in compose files; `$${` is a literal `${`. The
  scenario files use this for the roots that differ between a checkout and a container:
  OCR_DATA_DIR, RESNET50_DATA_DIR, RUNS_ROOT and CACHE_ROOT, which the images set once (ENV in
  docker/*.Dockerfile), so every scenario file works in both places unchanged. The resolved
  config (config.resolved.yaml, written owner-only; `python -m train.config`) shows the values
  after substitution, so a variable whose name looks secret (KEY, TOKEN, SECRET, PASSWORD or
  CREDENTIALS as a word of it) is refused: credentials stay in the environment of their reader.
- Floats need a dot: PyYAML follows YAML 1.1 and reads `1e-3` as a string; write `1.0e-3`.
- Every float field refuses NaN and infinities (`.nan`, `.inf`, `-.inf`, or nan and inf as
  text): NaN passes every range check, an infinity is no learning rate or timeout. A field
  for which an infinity means something says so in its type (fields.INFINITY).
- Byte sizes take an int or a string such as 512m, 8g, 1.5GiB. Units are powers of 1024, as in
  Docker's --shm-size.
"""
