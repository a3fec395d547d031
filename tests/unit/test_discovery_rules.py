"""Discovery rules without sockets: selectors, which pod is a worker, the manifest, the flags."""

from __future__ import annotations

import logging

import pytest

from fastroute.config import Config, ConfigError, config_from_args
from fastroute.config.cli import parse_args
from fastroute.control.discovery import pod_worker, read_manifest, selector_matches
from fastroute.kube import kube_config_source, parse_selector


@pytest.mark.parametrize(
    "tokens,labels,ok",
    [
        (["app=sglang"], {"app": "sglang"}, True),
        (["app=sglang", "tier=gpu"], {"app": "sglang"}, False),
        (["app=sglang,tier=gpu"], {"app": "sglang", "tier": "gpu", "x": "y"}, True),
        (["app==sglang"], {"app": "sglang"}, True),
        (["app!=sglang"], {}, True),
        (["app!=sglang"], {"app": "sglang"}, False),
        (["app in (sglang, vllm)"], {"app": "vllm"}, True),
        (["app notin (sglang,vllm)"], {"app": "vllm"}, False),
        (["app notin (sglang,vllm)"], {}, True),
        (["gpu", "!spot"], {"gpu": ""}, True),
        (["gpu", "!spot"], {"gpu": "", "spot": "1"}, False),
        (["sglang.ai/role=prefill"], {"sglang.ai/role": "prefill"}, True),
    ],
)
def test_label_selector_semantics(tokens, labels, ok) -> None:
    assert selector_matches(parse_selector(tokens), labels) is ok


@pytest.mark.parametrize("bad", ["app sglang", "=x", "!app=x", "app in sglang", "a=(b)"])
def test_bad_selectors_name_the_flag(bad) -> None:
    with pytest.raises(ConfigError) as exc:
        Config(service_discovery=True, selector=[bad])
    assert exc.value.flag == "--selector"


def _pod(**status) -> dict:
    st = {"phase": "Running", "podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}
    st.update(status)
    return {"metadata": {"name": "p", "annotations": {"sglang.ai/bootstrap-port": "8998"}}, "status": st}


def test_pod_worker_needs_running_ready_and_an_ip() -> None:
    ann = "sglang.ai/bootstrap-port"
    assert pod_worker(_pod(), 8000, ann) == ("http://10.0.0.5:8000", 8998)
    assert pod_worker(_pod(), 8000, "other/annotation") == ("http://10.0.0.5:8000", None)
    assert pod_worker(_pod(podIP="fd00::5"), 80, ann)[0] == "http://[fd00::5]:80"
    assert pod_worker(_pod(phase="Pending"), 80, ann) is None
    assert pod_worker(_pod(podIP=None), 80, ann) is None
    assert pod_worker(_pod(conditions=[{"type": "Ready", "status": "False"}]), 80, ann) is None
    assert pod_worker(_pod(conditions=[]), 80, ann) is None
    deleting = _pod()
    deleting["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert pod_worker(deleting, 80, ann) is None
    bad = _pod()
    bad["metadata"]["annotations"][ann] = "not-a-port"
    assert pod_worker(bad, 80, ann) == ("http://10.0.0.5:80", None)


def test_manifest_format() -> None:
    got = read_manifest('{"workers": [{"url": "http://a:1/"}, {"url": "http://b:2"}]}', pd=False)
    assert got == {"http://a:1": ("regular", None, "workers[0]"), "http://b:2": ("regular", None, "workers[1]")}
    got = read_manifest(
        '[{"url": "http://p:1", "worker_type": "prefill", "bootstrap_port": 8998},'
        ' {"url": "http://d:1", "worker_type": "decode", "bootstrap_port": 1}]',
        pd=True,
    )
    assert got == {"http://p:1": ("prefill", 8998, "workers[0]"), "http://d:1": ("decode", None, "workers[1]")}
    for bad in (
        '{"workers": 3}',
        '[{"url": 1}]',
        '[{"url": "http://a:1"}]',
        '[{"url": "http://a:1", "worker_type": "prefill", "bootstrap_port": "x"}]',
        '[{"url": "http://a:1", "worker_type": "decode"}, {"url": "http://a:1", "worker_type": "decode"}]',
        "{",
    ):
        with pytest.raises(ValueError):
            read_manifest(bad, pd=True)


def test_discovery_flags(tmp_path, monkeypatch) -> None:
    kc = tmp_path / "kubeconfig"
    kc.write_text("{}")
    monkeypatch.setenv("KUBECONFIG", str(kc))
    c = parse_args(
        [
            "--service-discovery",
            "--selector",
            "app=sglang",
            "tier=gpu",
            "--service-discovery-port",
            "8000",
            "--service-discovery-namespace",
            "ns",
            "--router-bootstrap-port-annotation",
            "x/y",
        ]
    )
    assert (
        c.discovery,
        c.selector,
        c.service_discovery_port,
        c.service_discovery_namespace,
        c.bootstrap_port_annotation,
    ) == ("kubernetes", ["app=sglang", "tier=gpu"], 8000, "ns", "x/y")
    c = parse_args(
        [
            "--pd-disaggregation",
            "--service-discovery",
            "--prefill-selector",
            "app=sglang",
            "component=prefill",
            "--decode-selector",
            "component=decode",
        ]
    )
    assert c.discovery == "kubernetes" and c.prefill_selector == ["app=sglang", "component=prefill"]
    c = parse_args(
        ["--discovery-provider", "file", "--discovery-file", "/x.json", "--discovery-check-interval-secs", "5"]
    )
    assert (c.discovery, c.discovery_file, c.discovery_check_interval_secs) == ("file", "/x.json", 5)
    assert parse_args([]).discovery is None


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--service-discovery"], "--selector"),
        (["--pd-disaggregation", "--service-discovery"], "--service-discovery"),
        (["--service-discovery", "--selector", "a=b", "--prefill-selector", "a=b"], "--prefill-selector"),
        (["--discovery-provider", "file"], "--discovery-file"),
        (["--service-discovery", "--selector", "a=b", "--service-discovery-port", "0"], "--service-discovery-port"),
    ],
)
def test_incomplete_discovery_flags_are_refused(argv, flag, tmp_path, monkeypatch, capsys) -> None:
    kc = tmp_path / "kubeconfig"
    kc.write_text("{}")
    monkeypatch.setenv("KUBECONFIG", str(kc))
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_sub_flags_without_discovery_are_ignored_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        c = parse_args(["--selector", "app=x", "--service-discovery-port", "8000"])
    assert c.discovery is None
    assert [r.getMessage().split()[0] for r in caplog.records] == ["--selector", "--service-discovery-port"]


def test_sub_flags_with_discovery_are_not_reported_ignored(tmp_path, monkeypatch, caplog) -> None:
    kc = tmp_path / "kubeconfig"
    kc.write_text("{}")
    monkeypatch.setenv("KUBECONFIG", str(kc))
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args(["--service-discovery", "--selector", "app=x"])
        assert caplog.records == []
        # as the peers: --selector means nothing in PD mode
        parse_args(["--pd-disaggregation", "--service-discovery", "--selector", "app=x", "--decode-selector", "app=y"])
    assert [r.getMessage().split()[0] for r in caplog.records] == ["--selector"]


def test_kube_config_source(tmp_path) -> None:
    kc = tmp_path / "config"
    assert kube_config_source({"KUBECONFIG": str(kc)}) is None
    kc.write_text("{}")
    assert kube_config_source({"KUBECONFIG": str(kc)}) == ("kubeconfig", str(kc))
    with pytest.raises(ConfigError, match="no Kubernetes configuration"):

        class NS:
            pass

        ns = NS()
        ns.service_discovery = True
        ns.selector = ["a=b"]
        config_from_args(ns, environ={"KUBECONFIG": str(tmp_path / "missing")})
