"""Checks of the Kubernetes manifests in deploy/kubernetes (no cluster needed)."""

from __future__ import annotations

import posixpath
import tomllib
from pathlib import Path

import pytest
import yaml

from aifs.config import load_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFESTS = ["aifs-daemonset.yaml", "example-training-pod.yaml"]


def _docs(name: str) -> list[dict]:
    with open(K8S / name) as fp:
        return [doc for doc in yaml.safe_load_all(fp) if doc is not None]


def _one(name: str, kind: str) -> dict:
    found = [doc for doc in _docs(name) if doc["kind"] == kind]
    assert len(found) == 1, f"{name}: expected one {kind}, found {len(found)}"
    return found[0]


def _pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def _daemonset() -> dict:
    return _one("aifs-daemonset.yaml", "DaemonSet")


def _container() -> dict:
    (container,) = _pod_spec(_daemonset())["containers"]
    return container


def _volume(spec: dict, name: str) -> dict:
    (volume,) = [v for v in spec["volumes"] if v["name"] == name]
    return volume


def _mount_at(container: dict, path: str) -> dict:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    return mount


def _lake_toml() -> str:
    return _one("aifs-daemonset.yaml", "ConfigMap")["data"]["lake.toml"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_document_has_api_version_and_kind(name):
    docs = _docs(name)
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc


def test_daemonset_container_is_privileged():
    assert _container()["securityContext"]["privileged"] is True


def test_daemonset_mounts_dev_fuse_from_chardevice_hostpath():
    mount = _mount_at(_container(), "/dev/fuse")
    volume = _volume(_pod_spec(_daemonset()), mount["name"])
    assert volume["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}


def test_daemonset_lake_hostpath_has_bidirectional_propagation():
    mount = _mount_at(_container(), "/mnt/lake")
    assert mount["mountPropagation"] == "Bidirectional"
    assert _volume(_pod_spec(_daemonset()), mount["name"])["hostPath"]["path"] == "/mnt/lake"


def test_daemonset_cache_dir_is_on_a_hostpath():
    cache_dir = tomllib.loads(_lake_toml())["cache_dir"]
    mounts = [m for m in _container()["volumeMounts"]
              if cache_dir == m["mountPath"] or cache_dir.startswith(m["mountPath"] + "/")]
    assert mounts, f"cache_dir {cache_dir} is on no volume"
    assert "hostPath" in _volume(_pod_spec(_daemonset()), mounts[0]["name"])


def test_grace_period_exceeds_unmount_timeout():
    env = {e["name"]: e["value"] for e in _container()["env"]}
    grace = _pod_spec(_daemonset())["terminationGracePeriodSeconds"]
    assert grace > float(env["AIFS_UNMOUNT_TIMEOUT"])


def test_daemonset_args_mount_in_foreground():
    args = _container()["args"]
    assert args[0] == "mount"
    assert "--foreground" in args


def test_daemonset_config_file_comes_from_the_configmap():
    container = _container()
    config_path = container["args"][container["args"].index("--config") + 1]
    configmap = _one("aifs-daemonset.yaml", "ConfigMap")
    mount = _mount_at(container, posixpath.dirname(config_path))
    volume = _volume(_pod_spec(_daemonset()), mount["name"])
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert posixpath.basename(config_path) in configmap["data"]


def test_lake_toml_options_are_all_aifs_options(tmp_path):
    path = tmp_path / "lake.toml"
    path.write_text(_lake_toml())
    config = load_config(str(path), {}, environ={})
    assert config.mountpoint == "/mnt/lake"
    assert config.metrics_address == "0.0.0.0"


def test_metrics_port_matches_container_port_and_annotation():
    port = tomllib.loads(_lake_toml())["metrics_port"]
    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    annotations = _daemonset()["spec"]["template"]["metadata"]["annotations"]
    assert ports["metrics"] == port
    assert annotations["prometheus.io/port"] == str(port)


def test_training_pod_mounts_lake_with_host_to_container():
    (doc,) = _docs("example-training-pod.yaml")
    spec = _pod_spec(doc)
    for container in spec["containers"]:
        mount = _mount_at(container, "/mnt/lake")
        assert mount["mountPropagation"] == "HostToContainer"
        assert _volume(spec, mount["name"])["hostPath"]["path"] == "/mnt/lake"
