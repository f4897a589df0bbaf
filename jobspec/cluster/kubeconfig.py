"""Where the API server is and who we are: kubeconfig or in-cluster service account.

Lookup order, as kubectl does it: --kubeconfig, then $KUBECONFIG (a path list), then
~/.kube/config, then the pod's service account. Namespace: --namespace, then the spec (for
submit), then the kubeconfig context, then "default".

Nothing here ever prints or logs a credential: `Connection.describe()` says which kind of
authentication is in use, never its value, and YAML errors are reported by line only
(a YAML error's excerpt could show a token).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from jobspec.errors import ConfigError

IN_CLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_KUBECONFIG = "~/.kube/config"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1123: namespaces, object names


@dataclass(frozen=True)
class Connection:
    """A ready client configuration plus what the user should be told about it."""

    configuration: Any  # kubernetes.client.Configuration (imported lazily: it is slow to import)
    source: str  # "kubeconfig ~/.kube/config" or "in-cluster service account"
    context: str | None
    namespace: str | None  # the context's (or the service account's) namespace, if any

    @property
    def server(self) -> str:
        return redact_url(self.configuration.host)

    def describe(self) -> str:
        ctx = f", context {self.context}" if self.context else ""
        return f"{self.source}{ctx}, server {self.server}, auth: {auth_kind(self.configuration)}"


def validate_namespace(namespace: str) -> str:
    if not DNS_LABEL.match(namespace):
        raise ConfigError(
            f"namespace {namespace!r} is not a valid Kubernetes namespace name "
            "(lower-case letters, digits and '-', at most 63 characters)"
        )
    return namespace


def redact_url(url: str) -> str:
    """The URL without user:password, should a kubeconfig carry one in the server address."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def auth_kind(cfg: Any) -> str:
    """Which kind of credential is configured; never its value."""
    kinds = []
    if cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization") or cfg.refresh_api_key_hook:
        kinds.append("bearer token (redacted)")
    if cfg.cert_file:
        kinds.append("client certificate (redacted)")
    if cfg.username:
        kinds.append("basic auth (redacted)")
    return ", ".join(kinds) or "none"


def kubeconfig_paths(flag: str | None) -> str | None:
    """The kubeconfig path list to read, or None when there is none (then try in-cluster)."""
    if flag:
        if not Path(flag).expanduser().is_file():
            raise ConfigError(f"--kubeconfig {flag}: no such file")
        return flag
    env = os.environ.get("KUBECONFIG")
    if env:
        if not any(Path(p).expanduser().is_file() for p in env.split(os.pathsep) if p):
            raise ConfigError(f"KUBECONFIG={env}: none of these files exists")
        return env
    if Path(DEFAULT_KUBECONFIG).expanduser().is_file():
        return DEFAULT_KUBECONFIG
    return None


def read_kubeconfig(path: str) -> Any:
    """One kubeconfig file's data, read within bounds before any other reader sees it (safe_yaml.KUBECONFIG: 8 MiB, a
    regular file, aliases counted as every value they repeat, 32 levels): a kubeconfig whose entries alias a tree of
    9^10 nodes grew past 1.5 GB in the client library, and one nested 20,000 deep was a RecursionError. ConfigError
    naming the file and the line, never a value (a kubeconfig holds credentials)."""
    from jobspec.spec import safe_yaml
    from jobspec.untrusted import read_bounded

    bounds = safe_yaml.KUBECONFIG
    raw = read_bounded(Path(path).expanduser(), bounds.bytes, what="kubeconfig")
    try:
        return safe_yaml.construct(safe_yaml.compose(raw.decode("utf-8"), bounds))
    except UnicodeDecodeError:
        raise ConfigError(f"kubeconfig {path}: not UTF-8 text") from None
    except safe_yaml.YamlLimit as err:
        where = f" (line {err.line})" if err.line else ""
        raise ConfigError(f"kubeconfig {path}{where}: {err.message}; no real kubeconfig is, check the file") from None
    except yaml.YAMLError as err:
        raise _not_yaml(path, err) from None


def _not_yaml(paths: str, err: yaml.YAMLError) -> ConfigError:
    """A YAML error said by line only (its excerpt could show a token)."""
    mark = getattr(err, "problem_mark", None)
    where = f" (line {mark.line + 1})" if mark is not None else ""
    return ConfigError(f"kubeconfig {paths}: not valid YAML{where}")


def _load_kubeconfig(paths: str, context: str | None) -> Connection:
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.kube_config import KubeConfigLoader, KubeConfigMerger

    for path in (p for p in paths.split(os.pathsep) if p and Path(p).expanduser().is_file()):
        read_kubeconfig(path)  # bounded first: the client library reads it with no bound
    try:
        merger = KubeConfigMerger(paths)
        if merger.config is None:
            raise ConfigError(f"kubeconfig {paths}: no configuration found")
        loader = KubeConfigLoader(
            config_dict=merger.config, active_context=context, config_persister=merger.save_changes
        )
        cfg = Configuration()
        loader.load_and_set(cfg)
    except yaml.YAMLError as err:
        raise _not_yaml(paths, err) from None
    except ConfigException as err:
        raise ConfigError(f"kubeconfig {paths}: {_first_line(err)}") from None
    except OSError as err:
        raise ConfigError(f"kubeconfig {paths}: cannot read it ({err.strerror})") from None
    ctx = loader.current_context or {}
    namespace = (ctx.get("context") or {}).get("namespace")
    return Connection(cfg, f"kubeconfig {paths}", ctx.get("name"), namespace or None)


def _load_in_cluster() -> Connection:
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.incluster_config import load_incluster_config

    cfg = Configuration()
    try:
        load_incluster_config(client_configuration=cfg)
    except ConfigException as err:
        raise ConfigError(f"in-cluster configuration: {_first_line(err)}") from None
    try:
        namespace = Path(IN_CLUSTER_NAMESPACE_FILE).read_text().strip() or None
    except OSError:
        namespace = None
    return Connection(cfg, "in-cluster service account", None, namespace)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def load_connection(kubeconfig: str | None = None, context: str | None = None) -> Connection:
    """Connection settings from the kubeconfig (flag, $KUBECONFIG, ~/.kube/config) or in-cluster."""
    paths = kubeconfig_paths(kubeconfig)
    if paths is not None:
        return _load_kubeconfig(paths, context)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        if context:
            raise ConfigError(f"--context {context}: no kubeconfig to take it from (running in-cluster)")
        return _load_in_cluster()
    raise ConfigError(
        "no Kubernetes configuration found: pass --kubeconfig, set KUBECONFIG, create ~/.kube/config "
        "(e.g. `kind create cluster`), or run inside a cluster"
    )


def context_namespace(kubeconfig: str | None = None, context: str | None = None) -> str | None:
    """The namespace the kubeconfig context names, without loading credentials; None if unknown.

    Used by `submit --dry-run=client`, which must work with no cluster configured at all."""
    try:
        paths = kubeconfig_paths(kubeconfig)
    except ConfigError:
        return None
    if paths is None:
        return None
    merged: dict[str, Any] = {"contexts": []}
    for path in paths.split(os.pathsep):
        try:
            data = read_kubeconfig(path) or {}
        except (OSError, ConfigError):
            continue
        if isinstance(data, dict):
            merged["contexts"] += data.get("contexts") or []
            if data.get("current-context"):  # the last file that sets it wins, as in the client library
                merged["current-context"] = data["current-context"]
    name = context or merged.get("current-context")
    for item in merged["contexts"]:
        if isinstance(item, dict) and item.get("name") == name:
            return (item.get("context") or {}).get("namespace") or None
    return None
