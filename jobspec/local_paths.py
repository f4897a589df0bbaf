"""Where a spec's paths point, on this machine and in the pod.

One spec goes from the laptop to the cluster, and its paths mean two things:
- `jobspec run`, `plan` and `validate` (this machine) read a relative path (model.path, data.path, data.eval_path,
  data.sources[].path, checkpoints.dir, checkpoints.local_dir, output.dir) written in the spec from the spec file's
  folder, wherever the command is run from, and one given with `--set` from the working directory (a path typed
  on a command line); `jobspec run` hands the runner absolute paths (`--set`), so it never guesses.
- In the pod the spec is mounted at /etc/jobspec/spec.yaml and the runner reads a relative path from the container's
  working directory, contract.WORKDIR (/workspace): `render` leaves the paths as written, and warns (as `validate`
  does for a cluster spec) when one names a file of this machine that the pod would not have.
- A local run writes under a local run directory: `runs/<name>` in the working directory when the spec sets no
  checkpoints.dir or names the pod's volume (checkpoints.pvc), whose default /checkpoints at the filesystem root
  only root could write; `jobspec run` says where.
A URL (s3://, gs://) and a hub id (org/name, with no file beside the spec of that name) are never paths here.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from jobspec.contract import WORKDIR
from jobspec.spec import object_store
from jobspec.spec.hub import is_hub_id
from jobspec.spec.models import JobSpec

LOCAL_RUNS = "runs"  # a local run's default directory: runs/<name> in the working directory


def path_fields(spec: JobSpec) -> list[tuple[str, str, bool]]:
    """(override key, value, read as data) of every path the spec sets."""
    data = spec.data
    found = [("model.path", spec.model.path, True), ("data.path", data.path, True), ("data.eval_path", data.eval_path,
             True)]  # fmt: skip
    found += [(f"data.sources.{i}.path", s.path, True) for i, s in enumerate(data.sources or [])]
    found += [("checkpoints.dir", spec.checkpoints.dir, False), ("checkpoints.local_dir", spec.checkpoints.local_dir,
              False), ("output.dir", spec.output.dir, False)]  # fmt: skip
    return [(key, value, is_data) for key, value, is_data in found if isinstance(value, str) and value]


def _local(value: str, is_data: bool, base: Path) -> bool:
    """`value` names a file or directory (not a URL, not a hub id that is no file beside the spec)."""
    if object_store.is_url(value):
        return False
    return not (is_data and is_hub_id(value, data=True) and not (base / value).exists())


def field_label(key: str) -> str:
    """data.sources.0.path -> data.sources[0].path"""
    parts = key.split(".")
    return ".".join(parts[:2]) + f"[{parts[2]}]." + parts[3] if parts[:2] == ["data", "sources"] else key


def read_overrides(
    spec_file: str | Path, spec: JobSpec, overrides: list[str] | None = None, cwd: Path | None = None
) -> list[str]:
    """`--set` items that make what reads the spec here (`run`, `plan`, `validate`) find its relative inputs (the model
    and data paths) in the spec's folder, wherever the command is run from; a path the user's own `overrides` give is
    read from the working directory, as any path typed on a command line."""
    return _absolute(spec_file, spec, overrides, cwd, read_only=True)


def _absolute(
    spec_file: str | Path, spec: JobSpec, overrides: list[str] | None, cwd: Path | None, *, read_only: bool
) -> list[str]:
    here = (cwd or Path.cwd()).resolve()
    typed = {item.partition("=")[0].strip() for item in overrides or []}
    folder = Path(spec_file).resolve().parent
    out = []
    for key, value, is_data in path_fields(spec):
        if (read_only and not is_data) or (key == "checkpoints.dir" and _pod_volume(spec)):
            continue  # a local run's checkpoints.dir is chosen in run_overrides
        base = here if key in typed else folder
        if _local(value, is_data, base) and not Path(value).is_absolute():
            out.append(f"{key}={json.dumps(str(base / value))}")
    return out


def run_overrides(
    spec_file: str | Path, spec: JobSpec, overrides: list[str] | None = None, cwd: Path | None = None
) -> tuple[list[str], list[str]]:
    """`--set` items that make a local run read relative paths from the spec's folder (a path the user's own
    `overrides` give, from the working directory, as any path typed on a command line) and write under a local run
    directory, and the lines that say so."""
    here = (cwd or Path.cwd()).resolve()
    out, said = _absolute(spec_file, spec, overrides, cwd, read_only=False), []
    if _pod_volume(spec) or (object_store.is_url(spec.checkpoints.dir) and not spec.checkpoints.local_dir):
        run_dir = here / LOCAL_RUNS / spec.name
        key = "checkpoints.local_dir" if object_store.is_url(spec.checkpoints.dir) else "checkpoints.dir"
        out.append(f"{key}={json.dumps(str(run_dir))}")
        if spec.checkpoints.pvc:
            out.append("checkpoints.pvc=null")
        why = (f"the spec's {spec.checkpoints.dir} is the pod's volume" if key == "checkpoints.dir" else
               f"staging for {spec.checkpoints.dir}")  # fmt: skip
        said.append(f"this run's files go to {run_dir} ({why}; set {key} to choose another)")
    return out, said


def _pod_volume(spec: JobSpec) -> bool:
    """checkpoints.dir is the pod's mount: unset (default /checkpoints) or a claim's mount point."""
    return bool(spec.checkpoints.pvc) or "dir" not in spec.checkpoints.model_fields_set


def cluster_warnings(spec_file: str | Path, spec: JobSpec) -> list[str]:
    """Paths of a cluster spec that the pod would not find: a relative path (the pod reads it from its working
    directory, not this spec's folder) or an absolute one that exists on this machine and on no volume the pod
    mounts (data.pvc)."""
    base = Path(spec_file).resolve().parent
    out = []
    for key, value, is_data in path_fields(spec):
        if not _local(value, is_data, base) or (key == "checkpoints.dir" and spec.checkpoints.pvc):
            continue
        label = field_label(key)
        if not Path(value).is_absolute():
            where = str(PurePosixPath(WORKDIR) / value)
            here = " (it exists beside the spec, on this machine only)" if (base / value).exists() else ""
            if key == "model.path":
                out.append(
                    f"model.path {value!r} is relative: the pod reads {where}, in its container's working "
                    f"directory{here}; put the model on a volume (data.pvc) or name its hub id"
                )
            elif is_data:
                out.append(
                    f"{label} {value!r} is relative: the pod reads {where}, in its container's working "
                    f"directory{here}; put the data on a volume (data.pvc) or in object storage (s3://...)"
                )
            else:  # fmt: skip
                out.append(f"{label} {value!r} is relative: the pod writes {where}, on its own disk, lost with the "
                           "pod; give an absolute path on checkpoints.pvc, or s3://...")  # fmt: skip
        elif is_data and Path(value).exists() and not _on_data_volume(spec, value):
            out.append(
                f"{label} {value!r} exists on this machine, but the pod reads its own filesystem: put the data "
                "on a volume (data.pvc, mounted at data.mount_path) or in object storage (s3://...)"
            )
    return out


def _on_data_volume(spec: JobSpec, value: str) -> bool:
    mount = spec.data.mount_path if spec.data.pvc else None
    return bool(mount) and PurePosixPath(value).is_relative_to(str(mount))


def is_cluster_spec(spec: JobSpec) -> bool:
    """A spec for GPUs or several nodes: it runs in pods (a cpu spec may run on this machine too)."""
    return spec.hardware.vendor != "cpu" or spec.hardware.nodes > 1
