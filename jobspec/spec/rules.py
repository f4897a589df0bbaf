"""Rules that span sections of a spec: each problem names every field involved and a fix.

`JobSpec` runs them after its fields validate; the loader splits the problems by field path so
that each is reported at its own line. When some fields do not validate, the loader runs them on
what did (`jobspec.spec.partial`), so one `jobspec validate` reports every problem: a rule that reads
a field which failed its own validation meets `Unreadable` and is skipped. Each rule is therefore a
function of its own that reads its inputs before it reports anything.

This module never imports the spec: it states what it reads as protocols (`SpecView`), which
`JobSpec` meets, so the two modules form no import circle.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from jobspec.catalog import gpus as gpu_catalogue
from jobspec.catalog.presets import PRESETS
from jobspec.catalog.tiers import divisors
from jobspec.contract import SCRATCH_DIR, SHM_MOUNT, SPEC_MOUNT_DIR, WORKDIR
from jobspec.spec import object_store
from jobspec.spec.hub import hub_id_problems, hub_token_problems

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")

Problem = tuple[str, str, str | None]  # (field path, message, hint)


class Unreadable(Exception):
    """A rule read a field that failed its own validation: the rule is skipped, its input is reported as it is
    (a rule judged on a default or a guess would report a problem the user does not have)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


class CrossFieldError(ValueError):
    """Rules that span sections; each problem is (field path, message, hint)."""

    def __init__(self, problems: list[Problem]):
        super().__init__("; ".join(f"{p}: {m}" for p, m, _ in problems))
        self.problems = problems


# What the rules read of a spec (read-only properties: a frozen model's narrower types satisfy them).
class _Gpus(Protocol):
    @property
    def type(self) -> str | None: ...
    @property
    def count(self) -> int: ...
    @property
    def memory(self) -> int | None: ...


class _Hardware(Protocol):
    @property
    def vendor(self) -> str: ...
    @property
    def gpus(self) -> _Gpus: ...
    @property
    def nodes(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def memory(self) -> int | None: ...
    @property
    def shm_size(self) -> int: ...


class _Training(Protocol):
    @property
    def global_batch(self) -> int: ...
    @property
    def micro_batch(self) -> int | str: ...
    @property
    def precision(self) -> str: ...
    @property
    def steps(self) -> int | None: ...
    @property
    def epochs(self) -> float | None: ...
    @property
    def loss_kernel(self) -> str: ...
    @property
    def block_kernels(self) -> str: ...
    @property
    def objective(self) -> str: ...
    @property
    def grpo(self) -> Any: ...


class _Image(Protocol):
    @property
    def name(self) -> str | None: ...


class _Model(Protocol):
    @property
    def preset(self) -> str | None: ...
    @property
    def attention(self) -> str: ...
    @property
    def lora(self) -> Any: ...


class _Source(Protocol):
    @property
    def name(self) -> str | None: ...


class _Data(Protocol):
    @property
    def max_seq_len(self) -> int: ...
    @property
    def sources(self) -> Sequence[_Source] | None: ...
    @property
    def pvc(self) -> str | None: ...
    @property
    def mount_path(self) -> str: ...
    @property
    def streaming(self) -> bool: ...
    @property
    def eval_path(self) -> str | None: ...


class _Checkpoints(Protocol):
    @property
    def dir(self) -> str: ...
    @property
    def local_dir(self) -> str | None: ...
    @property
    def pvc(self) -> str | None: ...


class _Scheduling(Protocol):
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def annotations(self) -> Mapping[str, str]: ...
    @property
    def node_selector(self) -> Mapping[str, str]: ...


class _Output(Protocol):
    @property
    def export(self) -> bool: ...


class _Eval(Protocol):
    @property
    def benchmarks(self) -> Sequence[str]: ...


class SpecView(Protocol):
    """The parts of a `JobSpec` the rules read."""

    @property
    def hardware(self) -> _Hardware: ...
    @property
    def training(self) -> _Training: ...
    @property
    def image(self) -> _Image: ...
    @property
    def model(self) -> _Model: ...
    @property
    def data(self) -> _Data: ...
    @property
    def checkpoints(self) -> _Checkpoints: ...
    @property
    def scheduling(self) -> _Scheduling: ...
    @property
    def output(self) -> _Output: ...
    @property
    def eval(self) -> _Eval: ...


def cross_field_problems(spec: SpecView) -> list[Problem]:
    """Every rule's problems; a rule whose inputs did not validate (`Unreadable`) is left out."""
    out: list[Problem] = []
    for rule in _RULES:
        try:
            out += rule(spec)
        except Unreadable:
            continue
    return out


def _batch(spec: SpecView) -> list[Problem]:
    hw, tr = spec.hardware, spec.training
    world = hw.world_size
    if tr.global_batch % world:
        return [
            (
                "training.global_batch",
                f"{tr.global_batch} does not divide over {world} ranks (nodes {hw.nodes} x gpus {hw.gpus.count})",
                f"use a multiple of {world}, e.g. {max(world, tr.global_batch // world * world)}",
            )
        ]
    if isinstance(tr.micro_batch, int) and (tr.global_batch // world) % tr.micro_batch:
        per_rank = tr.global_batch // world
        fits = divisors(per_rank)  # O(sqrt n)
        return [
            (
                "training.micro_batch",
                f"{tr.micro_batch} does not divide the per-rank batch {per_rank} (global_batch / ranks)",
                f"use one of {fits} or `auto`",
            )
        ]
    return []


def _image_vendor(spec: SpecView) -> list[Problem]:
    image, vendor = (spec.image.name or "").lower(), spec.hardware.vendor
    if (vendor == "cuda" and "rocm" in image) or (vendor == "rocm" and re.search(r"cuda|nvidia", image)):
        return [
            (
                "image.name",
                f"image {spec.image.name!r} does not match hardware.vendor {vendor!r}",
                "use an image built for the vendor, or omit image.name for the default",
            )
        ]
    return []


def _gpu_type(spec: SpecView) -> list[Problem]:
    hw = spec.hardware
    kind = hw.gpus.type
    info = gpu_catalogue.lookup(kind) if kind else None
    if hw.vendor == "cpu" and kind:
        return [("hardware.gpus.type", "vendor cpu takes no GPU type", "remove hardware.gpus.type or set vendor")]
    if info and info.vendor != hw.vendor:
        return [
            (
                "hardware.gpus.type",
                f"{info.name} is a {info.vendor} GPU but hardware.vendor is {hw.vendor!r}",
                f"set hardware.vendor: {info.vendor}",
            )
        ]
    if info and hw.gpus.count > info.per_node and hw.vendor != "cpu":
        total = hw.gpus.count * hw.nodes  # the same GPUs over the fewest nodes that split them evenly
        nodes = next(n for n in range(-(-total // info.per_node), total + 1) if total % n == 0)
        return [("hardware.gpus.count", f"{hw.gpus.count} {info.name} on one node: no server holds more than "
                 f"{info.per_node}", f"the count is per node: the same {total} GPUs are hardware.gpus "
                 f"{info.name}:{total // nodes} with hardware.nodes {nodes}")]  # fmt: skip
    if kind and not info and hw.gpus.memory is None:
        close = gpu_catalogue.suggest(kind)
        known = f"one of {', '.join(gpu_catalogue.known_names())}, or give hardware.gpus.memory"
        hint = f"did you mean {' or '.join(close)}? Otherwise use {known}" if close else f"use {known}"
        return [("hardware.gpus.type", f"unknown GPU type {kind!r}", hint)]
    return []


def _preset_positions(spec: SpecView) -> list[Problem]:
    preset = spec.model.preset
    if not preset:
        return []
    limit = PRESETS[preset].max_positions
    if spec.data.max_seq_len > limit:
        return [
            (
                "data.max_seq_len",
                f"{spec.data.max_seq_len} exceeds model preset {preset!r}'s {limit} positions",
                f"use data.max_seq_len <= {limit}",
            )
        ]
    return []


def _checkpoint_dir(spec: SpecView) -> list[Problem]:
    ck = spec.checkpoints
    if object_store.is_url(ck.dir):  # published to an object store, staged in local_dir (an emptyDir)
        if ck.pvc:
            return [("checkpoints.pvc", f"a volume cannot be mounted at {ck.dir}, an object store",
                     "remove checkpoints.pvc (the bucket keeps the checkpoints), or give checkpoints.dir a path")]
        if ck.local_dir is not None and not ck.local_dir.startswith("/"):
            return [("checkpoints.local_dir", f"{ck.local_dir!r} must be an absolute path", "e.g. /checkpoints")]
        return []
    if ck.local_dir is not None:
        return [("checkpoints.local_dir", "applies only to an object-store checkpoints.dir (s3:// or gs://bucket/prefix)",
                 "remove it, or set checkpoints.dir to s3://... or gs://...")]  # fmt: skip
    if spec.checkpoints.pvc and not spec.checkpoints.dir.startswith("/"):
        return [
            (
                "checkpoints.dir",
                f"{spec.checkpoints.dir!r} must be an absolute path when checkpoints.pvc mounts a volume there",
                "e.g. /checkpoints",
            )
        ]
    return []


def _shm_size(spec: SpecView) -> list[Problem]:
    hw = spec.hardware
    if hw.memory is not None and hw.shm_size > hw.memory:
        return [
            (
                "hardware.shm_size",
                "exceeds hardware.memory: the memory-backed /dev/shm counts against the pod's memory limit",
                "lower shm_size or raise hardware.memory",
            )
        ]
    return []


def _data_mount(spec: SpecView) -> list[Problem]:
    return _data_mount_problems(spec) if spec.data.pvc else []


def _scheduling_keys(spec: SpecView) -> list[Problem]:
    out: list[Problem] = []
    for section in ("labels", "annotations", "node_selector"):
        try:
            items = getattr(spec.scheduling, section).items()
        except Unreadable:
            continue  # one map that did not validate leaves the other two to check
        for key, value in items:
            if not _LABEL_KEY.match(key) or len(key.rpartition("/")[2]) > 63:
                out.append((f"scheduling.{section}.{key}", "not a valid Kubernetes key", "e.g. team, example.com/team"))
            elif section != "annotations" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                out.append(
                    (
                        f"scheduling.{section}.{key}",
                        "not a valid label value",
                        "at most 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric",
                    )
                )
    return out


def _source_names(spec: SpecView) -> list[Problem]:
    """Each data source's name labels its samples in the logs and metrics: two sources may not share one (a
    default name, the file's, is made unique by the runner instead)."""
    first: dict[str, int] = {}
    out: list[Problem] = []
    for i, source in enumerate(spec.data.sources or ()):
        name = source.name
        if name is None:
            continue
        if not name.strip():
            out.append((f"data.sources.{i}.name", "is empty", "name the source, or leave name out (the file's name)"))
        elif name in first:
            out.append((f"data.sources.{i}.name", f"{name!r} is already data.sources.{first[name]}.name",
                        "give each source its own name, or leave name out (the file's name)"))  # fmt: skip
        else:
            first[name] = i
    return out


def _streaming_length(spec: SpecView) -> list[Problem]:
    """A stream (`data.streaming`) is read as the steps need it: its length is unknown before the end, so the
    run's length is `training.steps`, never epochs."""
    if not spec.data.streaming:
        return []
    tr = spec.training
    if tr.epochs is not None:
        return [("training.epochs", "cannot count passes over a stream (data.streaming: true has no known length)",
                 "set training.steps instead, or data.streaming: false to prepare the data up front")]  # fmt: skip
    if tr.steps is None:
        return [("training.steps", "is required with data.streaming: true (a stream has no known length, so "
                 "epochs cannot size the run)", "set training.steps, e.g. 1000")]  # fmt: skip
    return []


def _cpu_precision(spec: SpecView) -> list[Problem]:
    if spec.hardware.vendor == "cpu" and spec.training.precision == "fp16":
        return [("training.precision", "fp16 autocast is not supported for vendor cpu", "use bf16 or fp32")]
    return []


def flash_attention_problems(spec: SpecView) -> list[Problem]:
    """flash_attention_2 is a GPU kernel for 16-bit inputs: asked for where it cannot run, it is refused here
    rather than swapped for sdpa (the runner also checks that the flash_attn package is in the image)."""
    if spec.model.attention != "flash_attention_2":
        return []
    if spec.hardware.vendor == "cpu":
        return [("model.attention", "flash_attention_2 needs a GPU and hardware.vendor is cpu",
                 "use model.attention: sdpa, or a cuda/rocm vendor")]  # fmt: skip
    if spec.training.precision == "fp32":
        return [("model.attention", "flash_attention_2 runs in bf16/fp16 only and training.precision is fp32",
                 "set training.precision to auto, bf16 or fp16, or model.attention: sdpa")]  # fmt: skip
    return []


def liger_problems(spec: SpecView) -> list[Problem]:
    """Liger Kernel's cross-entropy and block kernels are Triton kernels: a GPU's (the runner also checks the package
    is installed and, for the blocks, that Liger has kernels for the family)."""
    problems: list[Problem] = []
    if spec.training.loss_kernel == "liger" and spec.hardware.vendor == "cpu":
        fix = "use training.loss_kernel: chunked (the same loss in plain PyTorch), or a cuda vendor"
        problems.append(("training.loss_kernel", "liger runs Triton kernels on a GPU and hardware.vendor is cpu", fix))
    if spec.training.block_kernels == "liger" and spec.hardware.vendor == "cpu":
        fix = "use training.block_kernels: plain (transformers' own modules), or a cuda vendor"
        why = "liger runs Triton kernels on a GPU and hardware.vendor is cpu"
        problems.append(("training.block_kernels", why, fix))
    return problems


def _objective(spec: SpecView) -> list[Problem]:
    """A preference objective reads one prepared source of pairs (DPO computes its reference log-probs over all of it
    once; every objective keeps a pair's two chats together, which the streaming reader does not)."""
    objective = spec.training.objective
    if objective == "sft":
        return []
    d, out = spec.data, []
    if d.streaming:
        out.append(("data.streaming", f"training.objective {objective} needs the pairs prepared whole (a pair's "
                    "chats stay together; DPO computes its reference log-probs once over them)",
                    "set data.streaming: false"))  # fmt: skip
    if d.sources is not None and len(d.sources) > 1:
        out.append(("data.sources", f"training.objective {objective} reads one source of preference pairs",
                    "join the sources into one file, or give it as data.path"))  # fmt: skip
    formats = {d.format, *(s.format for s in d.sources or [] if s.format is not None)}
    if objective in ("kto", "grpo") and formats != {"auto"}:
        records = "unpaired {prompt, completion, label}" if objective == "kto" else "prompt-only {prompt, ...}"
        out.append(("data.format", f"training.objective {objective} reads TRL's {records} records, not data.format "
                    f"{', '.join(sorted(formats - {'auto'}))}",
                    "leave data.format at auto (and no source's format)"))  # fmt: skip
    if objective == "grpo":
        out += _grpo(spec)
    return out


def _grpo(spec: SpecView) -> list[Problem]:
    """GRPO's prompt and completion share a row of data.max_seq_len; its KL term needs a reference in memory."""
    g, out = spec.training.grpo, []
    if g is None:
        return out
    if g.max_completion_length >= spec.data.max_seq_len:
        out.append(("training.grpo.max_completion_length", f"{g.max_completion_length} leaves no room for the prompt "
                    f"in data.max_seq_len {spec.data.max_seq_len} (a row holds the prompt, then the completion)",
                    f"raise data.max_seq_len above it (e.g. {g.max_completion_length + 512}), or lower "
                    "max_completion_length"))  # fmt: skip
    if g.beta > 0 and spec.model.lora is None:
        out.append(("training.grpo.beta", f"{g.beta}: the KL term scores the starting model, which full "
                    "fine-tuning would have to hold as a second copy (not supported)",
                    "set model.lora (its disabled adapter is the reference), or training.grpo.beta: 0 (TRL's "
                    "default)"))  # fmt: skip
    if spec.data.eval_path is not None:
        out.append(("data.eval_path", "training.objective grpo has no held-out loss (its loss is measured on "
                    "completions it samples); the rewards of every step are its metrics",
                    "remove data.eval_path"))  # fmt: skip
    return out


def _benchmarks_export(spec: SpecView) -> list[Problem]:
    """The job's benchmarks run on its exported model: without an export there is nothing to run them on."""
    if spec.eval.benchmarks and not spec.output.export:
        return [("eval.benchmarks", "run on the exported model at the end of the job, and output.export is false",
                 "set output.export: true, or drop eval.benchmarks (`jobspec eval RUN_DIR` runs them after a "
                 "`jobspec export`)")]  # fmt: skip
    return []


def _gcs_credentials(spec: Any) -> list[Problem]:
    """`gcs_credentials` serves gs:// locations only, and names the pods' GOOGLE_APPLICATION_CREDENTIALS: with none
    it is a Secret mounted into every pod for nothing (a typo'd location, or one moved to s3://); beside
    env.GOOGLE_APPLICATION_CREDENTIALS (a Secret's value) one of the two would be dropped without a word."""
    if spec.gcs_credentials is None:
        return []
    if "GOOGLE_APPLICATION_CREDENTIALS" in spec.env:
        why = "is given twice, here and as env.GOOGLE_APPLICATION_CREDENTIALS: both name the pods' key file, and one "
        return [("gcs_credentials", why + "would be dropped", "keep gcs_credentials and remove the env entry")]
    data = spec.data
    places = [spec.checkpoints.dir, data.path, data.eval_path, *(source.path for source in data.sources or ())]
    if not any(isinstance(place, str) and place.startswith("gs://") for place in places):
        return [("gcs_credentials", "no gs:// location uses it (checkpoints.dir, data.path, data.eval_path and "
                 "data.sources[].path name none): the key would be mounted into every pod for nothing",
                 "point one of them at gs://bucket/..., or remove gcs_credentials")]  # fmt: skip
    return []


_RULES: tuple[Callable[[SpecView], list[Problem]], ...] = (
    _benchmarks_export, _gcs_credentials,
    _objective, _batch, _image_vendor, _gpu_type, _preset_positions, _checkpoint_dir, _shm_size, _data_mount,
    _scheduling_keys, _cpu_precision, flash_attention_problems, liger_problems, _source_names, _streaming_length,
    hub_id_problems, hub_token_problems,
)  # fmt: skip


def _run_dir(spec: SpecView) -> str:
    return object_store.run_dir(spec.checkpoints.dir, spec.checkpoints.local_dir)


def _data_mount_problems(spec: SpecView) -> list[Problem]:
    """`data.mount_path` must be absolute and not another of the pod's mounts (the API rejects duplicates)."""
    mount = spec.data.mount_path
    if not mount.startswith("/"):
        return [("data.mount_path", "must be an absolute path", "e.g. /data")]
    taken = {
        SPEC_MOUNT_DIR: "the spec", SHM_MOUNT: "/dev/shm", SCRATCH_DIR: "scratch space",
        posixpath.normpath(posixpath.join(WORKDIR, _run_dir(spec))): "checkpoints.dir",
    }  # fmt: skip
    owner = taken.get(posixpath.normpath(mount))
    return [("data.mount_path", f"{mount} is already the pod's mount for {owner}", "use e.g. /data")] if owner else []
