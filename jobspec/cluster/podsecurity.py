"""Which Pod Security Standard a pod template meets: `restricted`, `baseline` or only `privileged`.

Pure (a pod spec in, a level and the reasons out), for the pre-submit check: a namespace labelled
`pod-security.kubernetes.io/enforce: restricted` refuses every pod of a Job whose template is only `baseline`,
and the refusal shows only as the Job controller's FailedCreate events, after submit. The rules are those of
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (current version), the checks that a
rendered pod or a spec's options can touch; a cluster's own admission policies beyond these are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

LEVELS = ("privileged", "baseline", "restricted")  # from least to most strict
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"

# Capabilities `baseline` allows to add (the container runtime's defaults); `restricted` allows NET_BIND_SERVICE only.
BASELINE_CAPABILITIES = frozenset(
    [
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    ]
)
SAFE_SYSCTLS = frozenset(
    [
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    ]
)
SELINUX_TYPES = frozenset(("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"))
RESTRICTED_VOLUMES = frozenset(
    ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret")
)


def _containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from (c for c in pod.get(key) or [] if isinstance(c, dict))


def _ctx(obj: dict[str, Any]) -> dict[str, Any]:
    ctx = obj.get("securityContext")
    return ctx if isinstance(ctx, dict) else {}


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    """What keeps the pod from `baseline` (empty: it meets it)."""
    out = [f"{key}: true" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key) is True]
    psc = _ctx(pod)
    if (psc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("securityContext.seccompProfile.type: Unconfined")
    if (psc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append("securityContext.appArmorProfile.type: Unconfined")
    sysctls = [s.get("name") for s in psc.get("sysctls") or [] if isinstance(s, dict)]
    out += [f"securityContext.sysctls: {name}" for name in sysctls if name not in SAFE_SYSCTLS]
    out += _selinux("securityContext", psc)
    volumes = [v for v in pod.get("volumes") or [] if isinstance(v, dict)]
    out += [f"volume {v.get('name')}: hostPath" for v in volumes if "hostPath" in v]
    for c in _containers(pod):
        name, csc = c.get("name"), _ctx(c)
        if csc.get("privileged") is True:
            out.append(f"container {name}: privileged")
        added = set((csc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            out.append(f"container {name}: capabilities.add {', '.join(sorted(map(str, added)))}")
        if (csc.get("windowsOptions") or {}).get("hostProcess") is True:
            out.append(f"container {name}: windowsOptions.hostProcess")
        if csc.get("procMount") not in (None, "Default"):
            out.append(f"container {name}: procMount {csc['procMount']}")
        for key in ("seccompProfile", "appArmorProfile"):
            if (csc.get(key) or {}).get("type") == "Unconfined":
                out.append(f"container {name}: {key}.type Unconfined")
        out += _selinux(f"container {name}", csc)
        out += [
            f"container {name}: hostPort {p['hostPort']}"
            for p in c.get("ports") or []
            if isinstance(p, dict) and p.get("hostPort")
        ]
    return out


def _selinux(where: str, ctx: dict[str, Any]) -> list[str]:
    opts = ctx.get("seLinuxOptions") or {}
    bad = (opts.get("type") or "") not in SELINUX_TYPES or opts.get("user") or opts.get("role")
    return [f"{where}: seLinuxOptions {opts}"] if bad else []


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What keeps the pod from `restricted`, beyond `baseline_violations`."""
    out = [
        f"volume {v.get('name')}: type {next((k for k in v if k != 'name'), '?')}"
        for v in pod.get("volumes") or []
        if isinstance(v, dict) and not any(k in RESTRICTED_VOLUMES for k in v if k != "name")
    ]
    psc = _ctx(pod)
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    if psc.get("runAsUser") == 0:
        out.append("securityContext.runAsUser: 0")
    for c in _containers(pod):
        name, csc = c.get("name"), _ctx(c)
        if csc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name}: allowPrivilegeEscalation is not false")
        non_root = csc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"container {name}: runAsNonRoot is not true")
        if csc.get("runAsUser") == 0:
            out.append(f"container {name}: runAsUser 0")
        seccomp = (csc.get("seccompProfile") or {}).get("type")
        if not (seccomp in ("RuntimeDefault", "Localhost") or (seccomp is None and pod_seccomp)):
            out.append(f"container {name}: no seccompProfile RuntimeDefault or Localhost")
        caps = csc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"container {name}: capabilities.drop lacks ALL")
        added = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            out.append(f"container {name}: capabilities.add {', '.join(sorted(map(str, added)))}")
    return out


def pod_level(pod: dict[str, Any]) -> tuple[str, list[str]]:
    """(the strictest level the pod meets, why it meets no stricter one)."""
    base = baseline_violations(pod)
    if base:
        return "privileged", base
    strict = restricted_violations(pod)
    return ("baseline", strict) if strict else ("restricted", [])


def meets(pod_level_name: str, enforced: str) -> bool:
    return LEVELS.index(pod_level_name) >= LEVELS.index(enforced)
