"""deploy/inferencepool.yaml against the InferencePool CRD the Gateway API Inference Extension
publishes (vendored in tests/data with its source and commit), and its parts against each
other: the pool, the picker's Service and Deployment, its RBAC and the HTTPRoute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from fastroute.config.cli import parse_args  # noqa: E402
from fastroute.epp.options import refusal, split  # noqa: E402
from fastroute.epp.pool import pool_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "tests" / "data" / "inference.networking.k8s.io_inferencepools.yaml"
MANIFEST = ROOT / "deploy" / "inferencepool.yaml"


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return v1["schema"]["openAPIV3Schema"]


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_pool_is_valid_under_the_published_crd_schema() -> None:
    schema = _schema()
    pool = _one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, schema)
    # the CEL rule of endpointPickerRef: a Service reference has a port
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    # and the validator is live: what the schema forbids is refused
    for broken in (
        {"targetPorts": []},
        {"targetPorts": [{"number": 70000}]},
        {"selector": {"matchLabels": {}}},
        {"appProtocol": "grpc"},
    ):
        bad = {**pool, "spec": {**pool["spec"], **broken}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert pool_spec(pool) == ((("app", "sglang-llama"),), (30000,))


def test_the_route_the_picker_and_the_model_servers_fit_the_pool() -> None:
    pool = _one("InferencePool")
    name, ns = pool["metadata"]["name"], pool["metadata"]["namespace"]
    for d in _docs():
        assert d["metadata"]["namespace"] == ns
    # the HTTPRoute's backend is the pool
    route = _one("HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    refs = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}]
    # endpointPickerRef names the picker's Service and its gRPC port
    ref = pool["spec"]["endpointPickerRef"]
    svc = _one("Service", ref["name"])
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"  # the listener is plaintext h2
    epp = _one("Deployment", ref["name"])
    pod_labels = epp["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(svc["spec"]["selector"], pod_labels)
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    target = grpc_port["targetPort"]
    assert named.get(target, target) == 9002
    # the picker's command line runs: this pool, this port, no refusal
    assert container["command"] == ["fastroute"] and container["args"][0] == "epp"
    opts, rest = split(container["args"][1:])
    assert (opts.pool, opts.pool_namespace, opts.grpc_port) == (name, ns, 9002)
    assert refusal(parse_args(rest), 1, opts.pool) is None
    probe = container["readinessProbe"]["grpc"]
    assert probe["port"] == 9002
    # the pool selects the model servers, on their port, and not the picker itself
    selector = pool["spec"]["selector"]["matchLabels"]
    assert not _labels_match(selector, pod_labels)
    servers = [
        d
        for d in _docs()
        if d["kind"] == "Deployment" and _labels_match(selector, d["spec"]["template"]["metadata"]["labels"])
    ]
    assert servers
    ports = {p["number"] for p in pool["spec"]["targetPorts"]}
    for s in servers:
        (c,) = s["spec"]["template"]["spec"]["containers"]
        assert ports <= {p["containerPort"] for p in c["ports"]}
    # RBAC: the picker's service account may get, list and watch pods and inferencepools
    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = _one("RoleBinding")
    assert {"kind": "ServiceAccount", "name": sa, "namespace": ns} in binding["subjects"]
    role = _one("Role", binding["roleRef"]["name"])
    grants = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        for verb in ("get", "list", "watch"):
            assert (group, resource, verb) in grants
