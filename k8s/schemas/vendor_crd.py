"""Reduce a CustomResourceDefinition to the schema that tests/test_k8s_schemas.py validates with.

Writes the served version's openAPIV3Schema with every schema-level ``description`` removed (the
prose is ~2/3 of the file; no validation keyword is touched), under a header naming the source:

    git -C training-operator show v1.8.1:manifests/base/crds/kubeflow.org_paddlejobs.yaml > crd.yaml
    python k8s/schemas/vendor_crd.py crd.yaml --repo kubeflow/training-operator --tag v1.8.1 \
        --commit 0f8735faade3651dfe44e45c6fbc30fa9152641d \
        --path manifests/base/crds/kubeflow.org_paddlejobs.yaml \
        > k8s/schemas/kubeflow.org_paddlejobs.yaml

(and the same for kubeflow.org_pytorchjobs.yaml).

Only ``description`` keys of schema objects are dropped: a *property* named "description" (a
key inside ``properties``) is kept, since the walk knows which mappings are schemas.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import yaml

# Keywords whose value is one schema, a list of schemas, or a name -> schema mapping.
ONE_SCHEMA = ("items", "additionalProperties", "not")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
SCHEMA_MAPS = ("properties", "patternProperties")


def strip_descriptions(schema):
    """A copy of an OpenAPI v3 schema without ``description`` keywords."""
    if not isinstance(schema, dict):
        return schema  # additionalProperties: true/false
    out = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in ONE_SCHEMA:
            out[key] = strip_descriptions(value)
        elif key in SCHEMA_LISTS:
            out[key] = [strip_descriptions(v) for v in value]
        elif key in SCHEMA_MAPS:
            out[key] = {name: strip_descriptions(v) for name, v in value.items()}
        else:
            out[key] = value
    return out


def reduce_crd(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served", True)]
    return {
        "group": crd["spec"]["group"],
        "version": version["name"],
        "kind": crd["spec"]["names"]["kind"],
        "openAPIV3Schema": strip_descriptions(version["schema"]["openAPIV3Schema"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path, help="the CRD YAML as released")
    parser.add_argument("--repo", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--path", required=True, help="the CRD's path in the repository")
    parser.add_argument("--license", default="Apache-2.0")
    args = parser.parse_args(argv)
    raw = args.crd.read_bytes()
    reduced = reduce_crd(yaml.safe_load(raw))
    header = [
        f"{reduced['kind']} ({reduced['group']}/{reduced['version']}): the CRD's openAPIV3Schema,",
        "vendored for tests/test_k8s_schemas.py (CI has no cluster and no internet).",
        f"Source: https://github.com/{args.repo}, tag {args.tag} (commit {args.commit}),",
        f"  {args.path}",
        f"  sha256 {hashlib.sha256(raw).hexdigest()}",
        f"License: {args.license} (Copyright The Kubeflow Authors), as the source repository.",
        "Reduced by k8s/schemas/vendor_crd.py: the served version's openAPIV3Schema only, with the",
        "schema `description` texts removed; every validation keyword is as released.",
        "Regenerate with that script (its docstring has the command); do not edit by hand.",
    ]
    sys.stdout.write("".join(f"# {line}\n" for line in header))
    sys.stdout.write(yaml.safe_dump(reduced, sort_keys=False, default_flow_style=None, width=100))
    return 0


if __name__ == "__main__":
    sys.exit(main())
