"""The k8s/ manifests against the schemas a cluster would check them with, offline (~1 s).

- Core Kubernetes objects (PersistentVolumeClaim, ConfigMap, ...): Kubernetes' own OpenAPI
  schemas as shipped by kubernetes-validate, strict (an unknown field is an error, as with
  `kubectl apply`'s default --validate=strict).
- PaddleJob / PyTorchJob (kubeflow.org/v1): the training operator's CRD openAPIV3Schema, vendored
  in k8s/schemas/ (see the header there), made strict the way the API server applies a structural
  schema under strict field validation: an object with `properties` accepts no other keys unless
  it says x-kubernetes-preserve-unknown-fields.
- Every pod template inside a job, and the job's metadata, also against the core PodTemplateSpec
  and ObjectMeta schemas: a CRD's copy of the pod schema is a snapshot of some Kubernetes
  version, and CRDs may leave parts of it open.
- terminationGracePeriodSeconds: set on every pod template, and long enough (>= 60 s) to finish
  a step and write a checkpoint after SIGTERM.
- Least privilege on every container of every pod template, as compose.yaml's x-hardened:
  runAsNonRoot, no privilege escalation, every capability dropped and none added, the runtime's
  default seccomp filter (pod or container level), a read-only root filesystem, and a writable
  emptyDir at each path the images write outside their volumes (/tmp and HOME).

The negative tests break a copy of a real manifest in tmp_path and show each check fails on it.
kubernetes-validate and jsonschema are host-only tools (requirements/dev.txt).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="host-only tool: pip install -r requirements/dev.txt"
)
jsonschema = pytest.importorskip(
    "jsonschema", reason="host-only tool: pip install -r requirements/dev.txt"
)

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))
CRD_SCHEMAS = sorted((ROOT / "k8s" / "schemas").glob("*.yaml"))
# The Kubernetes minor version whose schemas the core objects and pod templates are checked
# against (kubernetes-validate ships 1.22-1.31; the training operator v1.8 supports 1.27-1.30).
K8S_VERSION = "1.30"
MIN_GRACE_SECONDS = 60
# Written with a read-only root filesystem: /tmp, and HOME (/home/trainer in both images,
# docker/*.Dockerfile); the same paths are tmpfs in compose.yaml (tests/test_containers_static.py
# checks that both match the Dockerfiles).
SCRATCH = ("/tmp", "/home/trainer")
REPLICA_SPECS = {"PaddleJob": "paddleReplicaSpecs", "PyTorchJob": "pytorchReplicaSpecs"}
# A core object for the tests of the core path (the manifests hold none today: the PVCs they
# use are created separately, see docs/containers.md).
PVC = {
    "apiVersion": "v1",
    "kind": "PersistentVolumeClaim",
    "metadata": {"name": "training-runs"},
    "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}},
}

SCHEMA_MAPS = ("properties", "patternProperties")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")


# ---------------------------------------------------------------- validation


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def strict_structural(schema, path: str = ""):
    """A copy of a CRD's structural schema that rejects unknown fields, as the API server does
    under strict field validation: objects that list their properties get
    ``additionalProperties: false`` unless they preserve unknown fields. OpenAPI's
    ``nullable: true`` becomes a JSON-schema null type. The root ``metadata`` stays open (the API
    server validates ObjectMeta itself; so does this test, against the core schema)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if key in out:
            out[key] = {
                name: strict_structural(sub, f"{path}.{name}") for name, sub in out[key].items()
            }
    for key in SCHEMA_LISTS:
        if key in out:
            out[key] = [strict_structural(sub, path) for sub in out[key]]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict_structural(out[key], path + "[]")
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = out.get("x-kubernetes-preserve-unknown-fields")
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and not preserve and path != ".metadata":
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a strict validator for each vendored CRD schema."""
    validators = {}
    for path in CRD_SCHEMAS:
        crd = yaml.safe_load(path.read_text())
        schema = strict_structural(crd["openAPIV3Schema"])
        jsonschema.Draft7Validator.check_schema(schema)
        key = (f"{crd['group']}/{crd['version']}", crd["kind"])
        validators[key] = jsonschema.Draft7Validator(schema)
    return validators


def dotted(path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def core_errors(doc: dict, where: str = "") -> list[str]:
    """The first error kubernetes-validate finds (it stops there) in a core object, strict."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = list(exc.path)
        if where and path and path[0] == "template":  # a pod template wrapped in a PodTemplate
            return [f"{where}.{dotted(path[1:])}: {exc.message} (core schema {exc.version})"]
        return [f"{dotted(path)}: {exc.message} (core schema {exc.version})"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"no schema: {exc.message} (a typo in kind/apiVersion, or a CRD not vendored)"]
    return []


def grace_period_errors(where: str, pod_spec: dict) -> list[str]:
    grace = pod_spec.get("terminationGracePeriodSeconds")
    if grace is None:
        return [f"{where}.terminationGracePeriodSeconds: not set (Kubernetes' default is 30 s)"]
    if not isinstance(grace, int) or isinstance(grace, bool) or grace < MIN_GRACE_SECONDS:
        return [
            f"{where}.terminationGracePeriodSeconds: {grace!r}, want an integer >= "
            f"{MIN_GRACE_SECONDS}: the trainer finishes a step and writes a checkpoint on SIGTERM"
        ]
    return []


def hardening_errors(where: str, pod_spec: dict) -> list[str]:
    """What a pod template lacks of the least-privilege settings, one line each."""
    errors = []
    pod_context = pod_spec.get("securityContext") or {}
    if pod_context.get("runAsNonRoot") is not True:
        errors.append(
            f"{where}.securityContext.runAsNonRoot: {pod_context.get('runAsNonRoot')!r}, want True"
        )
    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type")
    volumes = {v.get("name"): v for v in pod_spec.get("volumes") or []}
    for kind in ("initContainers", "containers"):
        for index, container in enumerate(pod_spec.get(kind) or []):
            at = f"{where}.{kind}.{index}"
            context = container.get("securityContext") or {}
            escalation = context.get("allowPrivilegeEscalation")
            if escalation is not False:
                errors.append(
                    f"{at}.securityContext.allowPrivilegeEscalation: {escalation!r}, want False"
                )
            capabilities = context.get("capabilities") or {}
            if "ALL" not in (capabilities.get("drop") or []):
                errors.append(
                    f"{at}.securityContext.capabilities.drop: {capabilities.get('drop')!r}, "
                    "want ['ALL']"
                )
            if capabilities.get("add"):
                errors.append(
                    f"{at}.securityContext.capabilities.add: {capabilities['add']!r}, want none"
                )
            if context.get("privileged"):
                errors.append(f"{at}.securityContext.privileged: True")
            if context.get("runAsNonRoot") is False:
                errors.append(f"{at}.securityContext.runAsNonRoot: False overrides the pod's")
            seccomp = (context.get("seccompProfile") or {}).get("type", pod_seccomp)
            if seccomp != "RuntimeDefault":
                errors.append(
                    f"{at}: seccompProfile {seccomp!r}, want RuntimeDefault (pod or container)"
                )
            read_only = context.get("readOnlyRootFilesystem")
            if read_only is not True:
                errors.append(
                    f"{at}.securityContext.readOnlyRootFilesystem: {read_only!r}, want True"
                )
            mounts = {m.get("mountPath"): m for m in container.get("volumeMounts") or []}
            for path in SCRATCH:
                mount = mounts.get(path) or {}
                volume = volumes.get(mount.get("name")) or {}
                if "emptyDir" not in volume or mount.get("readOnly"):
                    errors.append(
                        f"{at}.volumeMounts: no writable emptyDir at {path} (the root "
                        "filesystem is read-only, and the images write there)"
                    )
    return errors


def training_job_errors(doc: dict) -> list[str]:
    validator = crd_validators().get((doc.get("apiVersion"), doc.get("kind")))
    if validator is None:
        known = sorted(f"{v} {k}" for v, k in crd_validators())
        return [f"no CRD schema for {doc.get('apiVersion')} {doc.get('kind')}; vendored: {known}"]
    errors = [
        f"{dotted(e.absolute_path)}: {e.message} (CRD schema)"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))
    ]
    # The job's metadata, then each pod template, as core PodTemplate objects.
    errors += core_errors(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": doc.get("metadata", {})}
    )
    replicas = doc.get("spec", {}).get(REPLICA_SPECS.get(doc["kind"], ""), {})
    for role, replica in replicas.items() if isinstance(replicas, dict) else ():
        where = f"spec.{REPLICA_SPECS[doc['kind']]}.{role}.template"
        template = replica.get("template", {}) if isinstance(replica, dict) else {}
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "template": template}
        errors += core_errors(wrapped, where)
        errors += grace_period_errors(f"{where}.spec", template.get("spec") or {})
        errors += hardening_errors(f"{where}.spec", template.get("spec") or {})
    return errors


def document_errors(doc: dict) -> list[str]:
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    if str(doc["apiVersion"]).startswith("kubeflow.org/"):
        return training_job_errors(doc)
    return core_errors(doc)


def manifest_errors(path: Path) -> list[str]:
    """Every problem in every document of a manifest file, one line each."""
    errors = []
    for index, doc in enumerate(load_documents(path), start=1):
        name = doc.get("metadata", {}).get("name") if isinstance(doc, dict) else None
        kind = doc.get("kind") if isinstance(doc, dict) else None
        errors += [f"{path.name} #{index} {kind}/{name}: {e}" for e in document_errors(doc)]
    return errors


# ---------------------------------------------------------------- the real manifests


def test_manifests_are_found():
    kinds = {doc["kind"] for path in MANIFESTS for doc in load_documents(path)}
    assert {"PaddleJob", "PyTorchJob"} <= kinds, [p.name for p in MANIFESTS]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_schemas(path):
    errors = manifest_errors(path)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pod_templates_have_a_termination_grace_period(path):
    for doc in load_documents(path):
        if doc["kind"] not in REPLICA_SPECS:
            continue
        for role, replica in doc["spec"][REPLICA_SPECS[doc["kind"]]].items():
            grace = replica["template"]["spec"].get("terminationGracePeriodSeconds")
            assert type(grace) is int and grace >= MIN_GRACE_SECONDS, (
                f"{path.name} {role}: terminationGracePeriodSeconds={grace!r}; SIGTERM must "
                f"leave >= {MIN_GRACE_SECONDS} s to finish the step and write the checkpoint"
            )


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pod_templates_are_hardened(path):
    """Also inside test_manifest_matches_schemas; here on its own, so that a failure names it."""
    templates = 0
    for doc in load_documents(path):
        if doc["kind"] not in REPLICA_SPECS:
            continue
        for role, replica in doc["spec"][REPLICA_SPECS[doc["kind"]]].items():
            errors = hardening_errors(f"{path.name} {role}", replica["template"]["spec"])
            assert not errors, "\n".join(errors)
            templates += 1
    assert templates, f"{path.name}: no pod template checked"


@pytest.mark.parametrize("path", CRD_SCHEMAS, ids=lambda p: p.name)
def test_vendored_crd_schemas(path):
    text = path.read_text()
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    for needed in (
        "https://github.com/kubeflow/training-operator",
        "tag v1.",
        "manifests/base/crds/" + path.name,
        "sha256 ",
        "License: Apache-2.0",
    ):
        assert needed in header, f"{path.name}: the header must name the source ({needed!r})"
    crd = yaml.safe_load(text)
    assert crd["group"] == "kubeflow.org" and crd["version"] == "v1"
    assert crd["kind"] in REPLICA_SPECS
    jsonschema.Draft7Validator.check_schema(crd["openAPIV3Schema"])
    spec = crd["openAPIV3Schema"]["properties"]["spec"]["properties"]
    replica = spec[REPLICA_SPECS[crd["kind"]]]["additionalProperties"]
    pod = replica["properties"]["template"]["properties"]["spec"]["properties"]
    assert "terminationGracePeriodSeconds" in pod and "containers" in pod


def test_core_schemas_are_there():
    """kubernetes-validate ships the version named by K8S_VERSION (no network needed)."""
    assert kubernetes_validate.validate(PVC, K8S_VERSION, strict=True) == K8S_VERSION


# ---------------------------------------------------------------- broken copies fail


def paddle_pod(docs):
    return docs[0]["spec"]["paddleReplicaSpecs"]["Worker"]["template"]["spec"]


def torch_pod(docs):
    return docs[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def container_context(pod: dict) -> dict:
    return pod["containers"][0]["securityContext"]


def unmount(pod: dict, path: str) -> None:
    container = pod["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != path]


def add_pvc(docs, **spec_changes):
    pvc = copy.deepcopy(PVC)
    pvc["spec"].update(spec_changes)
    docs.append(pvc)


BROKEN = {
    # a typo'd pod field: the CRD's strict schema and the core PodTemplateSpec both reject it
    "pod-field-typo": (
        "paddlejob-ocr.yaml",
        lambda docs: rename(
            paddle_pod(docs), "terminationGracePeriodSeconds", "terminationGracePeriodSecond"
        ),
        [
            r"spec\.paddleReplicaSpecs\.Worker\.template\.spec: Additional properties are not "
            r"allowed \('terminationGracePeriodSecond' was unexpected\) \(CRD schema\)",
            r"Worker\.template\.spec: .*'terminationGracePeriodSecond' was unexpected.*core schema",
            r"terminationGracePeriodSeconds: not set",
        ],
    ),
    "pod-field-wrong-type": (
        "pytorchjob-resnet50.yaml",
        lambda docs: torch_pod(docs).update(terminationGracePeriodSeconds="120"),
        [
            r"Master\.template\.spec\.terminationGracePeriodSeconds: '120' is not of type "
            r"'integer' \(CRD schema\)",
            r"Master\.template\.spec\.terminationGracePeriodSeconds: .*core schema",
            r"terminationGracePeriodSeconds: '120', want an integer >= 60",
        ],
    ),
    "grace-period-too-short": (
        "pytorchjob-resnet50.yaml",
        lambda docs: torch_pod(docs).update(terminationGracePeriodSeconds=30),
        [r"Worker\.template\.spec\.terminationGracePeriodSeconds: 30, want an integer >= 60"],
    ),
    "container-field-typo": (
        "paddlejob-ocr.yaml",
        lambda docs: rename(paddle_pod(docs)["containers"][0], "volumeMounts", "volumeMount"),
        [r"containers\.0: .*'volumeMount' was unexpected.*CRD schema", r"core schema"],
    ),
    "bad-quantity": (
        "paddlejob-ocr.yaml",
        lambda docs: paddle_pod(docs)["containers"][0]["resources"]["limits"].update(
            memory="128 GB"
        ),
        [r"limits\.memory: '128 GB' does not match"],
    ),
    "job-field-typo": (
        "paddlejob-ocr.yaml",
        lambda docs: rename(docs[0]["spec"]["runPolicy"], "backoffLimit", "backoffLimt"),
        [r"spec\.runPolicy: .*'backoffLimt' was unexpected"],
    ),
    "job-field-wrong-type": (
        "pytorchjob-resnet50.yaml",
        lambda docs: docs[0]["spec"].update(nprocPerNode=4),
        [r"spec\.nprocPerNode: 4 is not of type 'string' \(CRD schema\)"],
    ),
    "replicas-wrong-type": (
        "paddlejob-ocr.yaml",
        lambda docs: docs[0]["spec"]["paddleReplicaSpecs"]["Worker"].update(replicas="two"),
        [r"Worker\.replicas: 'two' is not of type 'integer'"],
    ),
    "job-metadata-typo": (
        "pytorchjob-resnet50.yaml",
        lambda docs: docs[0]["metadata"].update(lables={"app": "resnet50"}),
        [r"metadata: .*'lables' was unexpected.*core schema"],
    ),
    "core-object-field-typo": (
        "paddlejob-ocr.yaml",
        lambda docs: add_pvc(docs, accessMode=["ReadWriteMany"]),
        [r"#2 PersistentVolumeClaim/training-runs: spec: .*'accessMode' was unexpected"],
    ),
    "core-object-wrong-type": (
        "paddlejob-ocr.yaml",
        lambda docs: add_pvc(docs, accessModes="ReadWriteMany"),
        [r"#2 PersistentVolumeClaim/training-runs: spec\.accessModes: 'ReadWriteMany' is not"],
    ),
    # least privilege: each setting removed or weakened on its own; the schemas accept all of
    # these, so only the hardening check catches them
    "privilege-escalation-allowed": (
        "pytorchjob-resnet50.yaml",
        lambda docs: container_context(torch_pod(docs)).update(allowPrivilegeEscalation=True),
        [
            r"Master\.template\.spec\.containers\.0\.securityContext\.allowPrivilegeEscalation: "
            r"True, want False",
            r"Worker\.template\.spec\.containers\.0\.securityContext\.allowPrivilegeEscalation",
        ],
    ),
    "capabilities-kept": (
        "paddlejob-ocr.yaml",
        lambda docs: container_context(paddle_pod(docs)).pop("capabilities"),
        [r"Worker\.template\.spec\.containers\.0\.securityContext\.capabilities\.drop: None"],
    ),
    "capability-added": (
        "paddlejob-ocr.yaml",
        lambda docs: container_context(paddle_pod(docs))["capabilities"].update(add=["SYS_ADMIN"]),
        [r"capabilities\.add: \['SYS_ADMIN'\], want none"],
    ),
    "privileged": (
        "pytorchjob-resnet50.yaml",
        lambda docs: container_context(torch_pod(docs)).update(privileged=True),
        [r"Master\.template\.spec\.containers\.0\.securityContext\.privileged: True"],
    ),
    "writable-root-filesystem": (
        "pytorchjob-resnet50.yaml",
        lambda docs: container_context(torch_pod(docs)).pop("readOnlyRootFilesystem"),
        [r"Master\.template\.spec\.containers\.0\.securityContext\.readOnlyRootFilesystem: None"],
    ),
    "no-seccomp-profile": (
        "paddlejob-ocr.yaml",
        lambda docs: paddle_pod(docs)["securityContext"].pop("seccompProfile"),
        [r"Worker\.template\.spec\.containers\.0: seccompProfile None, want RuntimeDefault"],
    ),
    "container-seccomp-unconfined": (
        "paddlejob-ocr.yaml",
        lambda docs: container_context(paddle_pod(docs)).update(
            seccompProfile={"type": "Unconfined"}
        ),
        [r"containers\.0: seccompProfile 'Unconfined', want RuntimeDefault"],
    ),
    "root-allowed": (
        "pytorchjob-resnet50.yaml",
        lambda docs: torch_pod(docs)["securityContext"].update(runAsNonRoot=False),
        [r"Master\.template\.spec\.securityContext\.runAsNonRoot: False, want True"],
    ),
    "no-writable-tmp": (
        "pytorchjob-resnet50.yaml",
        lambda docs: unmount(torch_pod(docs), "/tmp"),
        [r"Master\.template\.spec\.containers\.0\.volumeMounts: no writable emptyDir at /tmp "],
    ),
    "no-writable-home": (
        "paddlejob-ocr.yaml",
        lambda docs: unmount(paddle_pod(docs), "/home/trainer"),
        [r"containers\.0\.volumeMounts: no writable emptyDir at /home/trainer "],
    ),
    "unknown-kind": (
        "paddlejob-ocr.yaml",
        lambda docs: docs.append({**copy.deepcopy(PVC), "kind": "PersistentVolumeClam"}),
        [r"no schema: .*PersistentVolumeClam"],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_copy_fails(case, tmp_path):
    source, breaks, expected = BROKEN[case]
    docs = load_documents(ROOT / "k8s" / source)
    assert not manifest_errors(ROOT / "k8s" / source)
    breaks(docs)
    broken = tmp_path / source
    broken.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    errors = manifest_errors(broken)
    text = "\n".join(errors)
    assert errors, f"{case}: the broken copy passed"
    for pattern in expected:
        assert re.search(pattern, text), f"{case}: no error matching {pattern!r} in:\n{text}"


def test_a_valid_core_object_passes(tmp_path):
    """The core path accepts a correct object (the negative cases above are not vacuous)."""
    docs = load_documents(ROOT / "k8s" / "pytorchjob-resnet50.yaml")
    add_pvc(docs)
    path = tmp_path / "with-pvc.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    assert manifest_errors(path) == []
