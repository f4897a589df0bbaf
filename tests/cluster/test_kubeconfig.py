"""Finding the cluster: --kubeconfig, $KUBECONFIG, ~/.kube/config, in-cluster; and no secrets shown."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import yaml

from jobspec.cluster import kubeconfig as kc
from jobspec.errors import ConfigError

from .fake_api import TOKEN

KEY_DATA = base64.b64encode(b"-----BEGIN PRIVATE KEY-----\nS3CRETKEY\n-----END PRIVATE KEY-----\n").decode()


def write_config(
    path: Path, *, namespace: str | None = "team", user: dict | None = None, current: str = "main"
) -> Path:
    ctx = {"cluster": "c", "user": "u", **({"namespace": namespace} if namespace else {})}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": current,
                "clusters": [
                    {"name": "c", "cluster": {"server": "https://10.0.0.1:6443", "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "u", "user": user or {"token": TOKEN}}],
                "contexts": [
                    {"name": "main", "context": ctx},
                    {"name": "alt", "context": {"cluster": "c", "user": "u"}},
                ],
            }
        )
    )
    return path


def test_flag_loads_context_namespace_and_hides_the_token(tmp_path: Path) -> None:
    conn = kc.load_connection(str(write_config(tmp_path / "cfg")))
    assert (conn.context, conn.namespace, conn.server) == ("main", "team", "https://10.0.0.1:6443")
    assert "bearer token (redacted)" in conn.describe() and TOKEN not in conn.describe()
    alt = kc.load_connection(str(tmp_path / "cfg"), "alt")
    assert (alt.context, alt.namespace) == ("alt", None)


def test_kubeconfig_env_path_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_config(tmp_path / "cfg")
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(tmp_path / "missing"), str(cfg)]))
    assert kc.load_connection().namespace == "team"
    assert kc.context_namespace() == "team"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="none of these files exists"):
        kc.load_connection()


def test_home_kubeconfig_is_the_fallback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".kube").mkdir()
    write_config(tmp_path / ".kube" / "config")
    assert kc.load_connection().source == "kubeconfig ~/.kube/config"


def test_in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kubernetes.config.incluster_config as incluster

    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "ca.crt").write_text("not really a cert")
    (tmp_path / "namespace").write_text("runner-ns\n")
    monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setattr(kc, "IN_CLUSTER_NAMESPACE_FILE", str(tmp_path / "namespace"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    conn = kc.load_connection()
    assert (conn.source, conn.namespace, conn.server) == (
        "in-cluster service account",
        "runner-ns",
        "https://10.96.0.1:443",
    )
    assert TOKEN not in conn.describe()
    with pytest.raises(ConfigError, match="--context"):
        kc.load_connection(context="x")


def test_nothing_configured(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no Kubernetes configuration found"):
        kc.load_connection()
    with pytest.raises(ConfigError, match="no such file"):
        kc.load_connection(str(tmp_path / "nope"))
    assert kc.context_namespace() is None


def test_unknown_context(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope"):
        kc.load_connection(str(write_config(tmp_path / "cfg")), "nope")


def test_broken_yaml_is_reported_by_line_without_its_text(tmp_path: Path) -> None:
    bad = tmp_path / "cfg"
    bad.write_text(f"users:\n- name: u\n  user:\n    token: {TOKEN}: [oops\n")
    with pytest.raises(ConfigError) as info:
        kc.load_connection(str(bad))
    assert "not valid YAML (line" in str(info.value) and TOKEN not in str(info.value)


def test_client_certificates_are_never_shown(tmp_path: Path) -> None:
    user = {"client-certificate-data": base64.b64encode(b"CERT").decode(), "client-key-data": KEY_DATA}
    conn = kc.load_connection(str(write_config(tmp_path / "cfg", user=user)))
    assert "client certificate (redacted)" in conn.describe()
    assert "S3CRETKEY" not in conn.describe() and KEY_DATA not in conn.describe()


def test_redact_url_and_namespace_names() -> None:
    assert kc.redact_url("https://admin:pw@k8s.example:6443/x") == "https://***@k8s.example:6443/x"
    assert kc.redact_url("https://k8s.example") == "https://k8s.example"
    assert kc.validate_namespace("ml-team") == "ml-team"
    with pytest.raises(ConfigError):
        kc.validate_namespace("ML_team")


def test_context_namespace_follows_context_flag(tmp_path: Path) -> None:
    cfg = str(write_config(tmp_path / "cfg"))
    assert kc.context_namespace(cfg) == "team"
    assert kc.context_namespace(cfg, "alt") is None


def _alias_bomb(levels: int = 10) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nextra: *a{levels - 1}\n"


@pytest.mark.parametrize("attack", ["aliases", "depth", "size"])
def test_a_hostile_kubeconfig_is_refused_before_the_client_reads_it(tmp_path: Path, attack: str) -> None:
    """Entries aliasing a 9^10-node tree grew past 1.5 GB in the client library; 20,000 levels were a RecursionError;
    a huge file was read whole. Each is a ConfigError naming the file, in bounded time and memory, with no value."""
    cfg = write_config(tmp_path / "cfg")
    text = cfg.read_text()
    if attack == "aliases":
        cfg.write_text(text + _alias_bomb())
    elif attack == "depth":
        cfg.write_text(text + "extra: " + "[" * 20_000 + "]" * 20_000 + "\n")
    else:
        cfg.write_text(text + "extra: '" + "x" * (9 * 1024 * 1024) + "'\n")
    with pytest.raises(ConfigError) as info:
        kc.load_connection(str(cfg))
    assert str(cfg) in str(info.value) and TOKEN not in str(info.value)
    assert kc.context_namespace(str(cfg)) is None  # --dry-run=client: skipped, not a traceback


def test_a_kubeconfig_within_the_bounds_with_real_aliases_still_loads(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg")
    cfg.write_text(cfg.read_text() + "extra: &e {a: [1, 2]}\nmore: *e\n" + "notes: '" + "c" * 100_000 + "'\n")
    assert kc.load_connection(str(cfg)).namespace == "team"
