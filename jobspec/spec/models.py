"""The job spec: Pydantic models for one training job, as written in YAML.

Every field carries a description (they feed `jobspec schema` and the spec
reference, docs/reference/spec.md). Sections forbid unknown keys, so a typo fails at `jobspec validate`, not in
the pod. Cross-field rules live in `JobSpec._check` and name every field involved.

No `from __future__ import annotations` here: with it, pydantic compiles and evaluates each of the
~125 field annotations from its string when the models are built, on every start of the CLI (~5 ms
CPU, a sixth of the models' build time). The methods name their own class in quotes instead.
"""

import hashlib
import json
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jobspec.catalog import gpus as gpu_catalogue
from jobspec.catalog import tiers
from jobspec.catalog.families import FAMILIES
from jobspec.catalog.model_config import BOUNDS as ARCH_BOUNDS
from jobspec.catalog.model_config import ConfigProblems, shape_from_config
from jobspec.catalog.presets import PRESETS
from jobspec.contract import RESERVED_ENV_PREFIX
from jobspec.errors import HintedValueError
from jobspec.spec import object_store
from jobspec.spec.credentials import SECRET_REF_HINT, credential_kind, inline_credentials, is_secret_name
from jobspec.spec.rules import CrossFieldError, cross_field_problems
from jobspec.spec.safe_yaml import MAX_KEY_CHARS, MAX_STRING_CHARS, out_of_range
from jobspec.spec.units import GPUS_PATTERN, ByteSize, CpuQuantity, parse_gpus

Tier = Literal[("auto", *tiers.TIERS)]  # type: ignore[valid-type]
Vendor = Literal["cuda", "rocm", "cpu"]
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_REF = re.compile(r"^\$\([A-Za-z_][A-Za-z0-9_]*\)$")  # a dependent variable: `HF_HUB_TOKEN: $(HF_TOKEN)`

# Every string has a length limit, checked before any pattern, secret scan or suggestion reads it: pydantic
# measures a string before its after-validators run, and each before-validator here measures it first itself.
# (The YAML reader already refuses any text over safe_yaml.MAX_STRING_CHARS and any key over MAX_KEY_CHARS.)
# Kubernetes' own limits where the value lands in an object's field; Linux's PATH_MAX for paths.
MAX_PATH_CHARS = 4096  # paths, URIs and hub ids (a file:// URI holds a path)
MAX_SUBDOMAIN_CHARS = 253  # a DNS subdomain: PriorityClass names, Secret keys
MAX_WORD_CHARS = 256  # record keys, module names, W&B project and entity, run and experiment names
MAX_LABEL_VALUE_CHARS = 63
MAX_GPU_TYPE_CHARS = 64  # "A100-SXM4-80GB"; no catalogue name comes near
SIMPO_GAMMA = 0.5  # TRL's CPOConfig default target margin for SimPO
# Objectives scored against the starting model's log-probs, computed once before training (runner/train/reference.py)
REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
# distribution/reference: a repository of at most 255 characters (registry included), a tag of at most 128,
# and the longest digest this spec accepts (sha512).
MAX_IMAGE_CHARS = 255 + len(":") + 128 + len("@sha512:") + 128

def _one_line(value: str) -> str:
    if why := object_store.control_problem(value):
        raise ValueError(why)
    return value


PathStr = Annotated[str, StringConstraints(max_length=MAX_PATH_CHARS), AfterValidator(_one_line)]
WordStr = Annotated[str, StringConstraints(max_length=MAX_WORD_CHARS)]
KeyStr = Annotated[str, StringConstraints(max_length=MAX_KEY_CHARS)]  # env names, label and annotation keys
TextStr = Annotated[str, StringConstraints(max_length=MAX_STRING_CHARS)]  # env values, annotation values


def check_length(value: str, limit: int) -> None:
    """Refuse a text over `limit` characters, for a before-validator to call before it reads the text: the same
    error as pydantic's own max_length (which never quotes the value, so the loader shows it as it is)."""
    if len(value) > limit:
        raise PydanticCustomError(
            "string_too_long", "String should have at most {max_length} characters", {"max_length": limit}
        )


def _dns_label(value: str, max_len: int = 63) -> str:
    check_length(value, max_len)
    if not _DNS_LABEL.match(value):
        raise ValueError(
            f"{value!r} is not a valid name: use at most {max_len} lowercase letters, digits and '-', "
            "starting with a letter and ending with a letter or digit"
        )
    return value


def _on_off(value: Any) -> Any:
    # YAML 1.1 reads bare on/off/yes/no as booleans; accept them as the words they were.
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


# json_schema_input_type: `jobspec schema` accepts every spelling the validator does (an editor must not flag them).
_LABEL_SCHEMA = Annotated[str, Field(pattern=_DNS_LABEL.pattern, max_length=63)]
JobName = Annotated[
    str,
    BeforeValidator(
        lambda v: _dns_label(v, 50) if isinstance(v, str) else v,
        json_schema_input_type=Annotated[str, Field(pattern=_DNS_LABEL.pattern, max_length=50)],
    ),
]
DnsLabel = Annotated[
    str, BeforeValidator(lambda v: _dns_label(v) if isinstance(v, str) else v, json_schema_input_type=_LABEL_SCHEMA)
]
# bool: YAML 1.1 reads a bare `on`/`off` as true/false.
OnOffAuto = Annotated[
    Literal["auto", "on", "off"], BeforeValidator(_on_off, json_schema_input_type=Literal["auto", "on", "off"] | bool)
]


def annotation_types(annotation: Any) -> list[Any]:
    """The types an annotation admits, Annotated and unions unwrapped: `Annotated[A | None, ...]` -> [A, None].
    For the loader (where a problem's path leads), the one-pass rules and the tests that walk the models."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return annotation_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in annotation_types(arg)]
    return [annotation]


def _compile_scope(value: Any) -> Any:
    """`training.compile`: true is `blocks` and false `off` (the switch it was); a number is neither."""
    if isinstance(value, bool):
        return "blocks" if value else "off"
    if isinstance(value, int | float):
        raise ValueError(f"the number {value!r} is not a compile scope: write blocks, model or off (true: blocks)")
    return value


class Section(BaseModel):
    # allow_inf_nan: `.inf` or an overflowing 1e999 is never a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Booleans are not numbers, and numbers and strings are not booleans: pydantic's lax mode reads `true` as
        1, 1 or 0 as a boolean and 'off', 'no', 'f' as false, and YAML 1.1 reads yes/no/on/off as booleans, so
        `steps: true` trained 1 step, `global_batch: yes` was 1 and `output.export: 0` or `training.compile: 'off'`
        silently switched a setting. A number field (or a list of them) that admits no boolean refuses one; a
        switch (a field that admits only booleans) refuses anything but true or false."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value)):
            if _numbers_only(field.annotation):
                raise ValueError("a boolean is not a number (YAML reads true/false/yes/no/on/off as booleans): "
                                 "write the number")
        elif isinstance(value, int | float | str) and _switch(field.annotation):
            shown = f"the number {value!r}" if not isinstance(value, str) else f"the text {value[:20]!r}"
            raise ValueError(f"is a switch: write true or false (without quotes), not {shown}")
        return value


def _switch(annotation: Any) -> bool:
    """Whether an annotation admits booleans and nothing else but None: a switch."""
    kinds = [k for k in annotation_types(annotation) if k is not type(None)]
    return bool(kinds) and all(k is bool for k in kinds)


def _numbers_only(annotation: Any) -> bool:
    """Whether an annotation admits numbers (int or float, or lists of them) and no boolean."""
    kinds = [k for t in annotation_types(annotation) for k in (annotation_types(typing.get_args(t)[0])
             if typing.get_origin(t) is list and typing.get_args(t) else [t])]  # fmt: skip
    return bool not in kinds and any(k in (int, float) for k in kinds)


# distribution/reference's grammar, which kubelet and containerd parse: [host[:port]/]path[:tag][@digest].
_IMAGE_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_IMAGE_HOST = rf"(?:{_IMAGE_LABEL}(?:\.{_IMAGE_LABEL})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
_IMAGE_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_IMAGE_REF = re.compile(rf"(?P<repo>(?:{_IMAGE_HOST}/)?{_IMAGE_PATH}(?:/{_IMAGE_PATH})*)(?::{_IMAGE_TAG})?")
_DIGEST_HEX = {"sha256": 64, "sha384": 96, "sha512": 128}  # the algorithms OCI runtimes verify


def _image_reference(value: str | None) -> str | None:
    """Refuse what kubelet would fail as InvalidImageName, and a digest of the wrong shape. The value is
    never echoed: a credential in it is reported (without it) by `JobSpec._check`."""
    if value is not None:
        check_length(value, MAX_IMAGE_CHARS)
    if value is None or credential_kind(value):
        return value
    ref, at, digest = value.partition("@")
    if at:
        algorithm, _, hex_part = digest.partition(":")
        want = _DIGEST_HEX.get(algorithm)
        if want is None or len(hex_part) != want or not re.fullmatch(r"[0-9a-f]+", hex_part):
            raise ValueError(
                "the digest after '@' must be sha256: and 64 lowercase hex digits (sha384/sha512: 96/128), "
                "as `crane digest IMAGE` or `docker buildx imagetools inspect IMAGE` print it"
            )
    match = _IMAGE_REF.fullmatch(ref)
    if not match or len(match["repo"]) > 255:
        raise ValueError(
            "not an image reference: use [registry[:port]/]repository[:tag][@sha256:<digest>], with the "
            "repository in lowercase and no spaces, e.g. ghcr.io/me/trainer:1.0@sha256:<64 hex digits>"
        )
    return value


class ImageSpec(Section):
    name: Annotated[
        Annotated[str, StringConstraints(max_length=MAX_IMAGE_CHARS)] | None,
        BeforeValidator(lambda v: _image_reference(v) if isinstance(v, str) else v),
        Field(
            description="Container image, e.g. `repo:tag` or pinned `repo@sha256:<digest>`. "
            "Default: the image `jobspec image push` recorded for `hardware.vendor`, pinned by digest, else the tag "
            "ghcr.io/jobspec/runner:<version>-<vendor> (docs/getting-started/cluster.md#images)."
        ),
    ] = None
    pull_policy: Annotated[
        Literal["Always", "IfNotPresent", "Never"] | None,
        Field(description="Kubernetes imagePullPolicy; default IfNotPresent for an image pinned by digest, Always for "
              "a tag (which can move)."),
    ] = None
    pull_secrets: Annotated[
        list[DnsLabel], Field(description="Names of Secrets (in the job's namespace) used to pull the image.")
    ] = []


class LoraSpec(Section):
    rank: Annotated[int, Field(ge=1, le=1024, description="LoRA rank r: trainable params per target are r*(in+out).")]
    alpha: Annotated[float, Field(gt=0, description="LoRA scaling numerator (scale = alpha / rank).")] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1, description="Dropout on the LoRA input.")] = 0.0
    targets: Annotated[
        list[WordStr],
        Field(
            min_length=1,
            description="Module names to adapt, e.g. [c_attn] for GPT-2 or [q_proj, v_proj] for Llama-style models; "
            "experts.gate_up_proj and experts.down_proj adapt a mixture of experts' routed experts (peft's "
            "target_parameters, a rank-r pair per expert).",
        ),
    ] = ["c_attn"]


class Architecture(Section):
    """Shape of a dense model given by `path`, so `jobspec plan` can estimate memory without loading it (the short
    form; any other family: the model's config.json inline, `ArchitectureConfig`)."""

    family: Annotated[
        Literal["gpt2", "llama"],
        Field(description="Block of a dense model: gpt2 or llama (any other family: write its config.json inline)."),
    ]
    layers: Annotated[int, Field(ge=1, le=ARCH_BOUNDS["layers"], description="Number of transformer blocks.")]
    hidden: Annotated[int, Field(ge=1, le=ARCH_BOUNDS["hidden"], description="Hidden size.")]
    heads: Annotated[int, Field(ge=1, le=ARCH_BOUNDS["heads"], description="Attention heads (divide `hidden`).")]
    vocab: Annotated[int, Field(ge=1, le=ARCH_BOUNDS["vocab"], description="Vocabulary size.")]
    intermediate: Annotated[int, Field(ge=1, le=ARCH_BOUNDS["intermediate"], description="MLP inner width.")]
    max_positions: Annotated[
        int, Field(ge=1, le=ARCH_BOUNDS["max_positions"], description="Longest sequence the model supports.")
    ] = 2048
    kv_heads: Annotated[
        int | None,
        Field(
            ge=1, le=ARCH_BOUNDS["kv_heads"], description="Key/value heads (grouped-query attention), divide `heads`."
        ),
    ] = None
    tie_embeddings: Annotated[
        bool, Field(description="Output head shares the input embedding (always true for gpt2).")
    ] = False

    @field_validator("family", mode="before")
    @classmethod
    def _dense_family(cls, value: Any) -> Any:
        if isinstance(value, str) and value in FAMILIES and value not in ("gpt2", "llama"):
            raise HintedValueError(
                f"{value} is not a dense gpt2 or llama block the short form describes",
                f"write the model's config.json inline instead: `architecture: {{model_type: {value}, ...}}` with "
                "the keys of its config.json on the hub (`jobspec init --model ORG/NAME --config config.json` "
                "writes it)",
            )
        return value

    @model_validator(mode="after")
    def _heads_split(self) -> "Architecture":
        if self.hidden % self.heads:
            raise ValueError(f"heads {self.heads} does not divide hidden {self.hidden}: attention splits the width")
        if self.kv_heads is not None and (self.kv_heads > self.heads or self.heads % self.kv_heads):
            raise ValueError(f"kv_heads {self.kv_heads} does not divide heads {self.heads}")
        return self


ModelType = Literal[tuple(FAMILIES)]  # type: ignore[valid-type]
ARCHITECTURE_FIX = (
    "copy the value from the model's config.json on the hub (huggingface.co/ORG/NAME/blob/main/config.json), or let "
    "`jobspec init --model ORG/NAME --config config.json` write the section"
)


class ArchitectureConfig(BaseModel):
    """A model's config.json written inline (the same keys as on the hub): what `jobspec plan` reads of a `path` it
    cannot open here, read and checked as a local config.json is (jobspec/catalog/model_config.py), for every family
    jobspec plans: mixtures of experts, latent attention, soft caps, sliding windows."""

    # extra: any key of a config.json; only those the plan reads are checked (numbers: integers in bounds)
    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    model_type: Annotated[
        ModelType,
        Field(description=f"transformers' model_type, one of the families jobspec plans: {', '.join(FAMILIES)}."),
    ]

    def config(self) -> dict[str, Any]:
        """The config.json as a dict (model_type and every other key as written)."""
        return {"model_type": self.model_type, **(self.model_extra or {})}

    @model_validator(mode="after")
    def _buildable(self) -> "ArchitectureConfig":
        try:
            shape_from_config(self.config(), where="model.architecture")
        except ConfigProblems as err:
            raise CrossFieldError(
                [(f"model.architecture.{key}", why, ARCHITECTURE_FIX) for key, why in err.problems]
            ) from None
        return self


def _architecture_form(value: Any) -> str:
    """Which form `model.architecture` is written in: a config.json (it names a `model_type`) or the short dense one."""
    if isinstance(value, dict):
        return "ArchitectureConfig" if "model_type" in value else "Architecture"
    return type(value).__name__ if isinstance(value, (Architecture, ArchitectureConfig)) else "Architecture"


ArchitectureField = Annotated[
    Annotated[Architecture, Tag("Architecture")] | Annotated[ArchitectureConfig, Tag("ArchitectureConfig")],
    Discriminator(_architecture_form),
]


_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _secret_key(value: Any) -> Any:
    """A Secret's data key as Kubernetes allows one (letters, digits, '-', '_', '.'; not '.', '..' or '..x'): a
    key is also the file name of a mounted item (gcs_credentials), so a path such as ../../etc/shadow never is."""
    if isinstance(value, str) and (not _SECRET_KEY.fullmatch(value) or value in (".", "..") or value.startswith("..")):
        raise PydanticCustomError(  # its own type: the loader shows this message, which never quotes the value
            "secret_key", "a Secret's key is letters, digits, '-', '_' and '.' (not '.' or '..', no '/'): the key "
            "under the Secret's data, as `kubectl describe secret NAME` lists them")
    return value


class SecretRef(Section):
    secret: Annotated[DnsLabel, Field(description="Secret name in the job's namespace.")]
    key: Annotated[str, Field(min_length=1, max_length=MAX_SUBDOMAIN_CHARS, description="Key inside the Secret."),
                   BeforeValidator(_secret_key)]  # fmt: skip
    optional: Annotated[bool, Field(description="Start even if the Secret or key is missing.")] = False


def _secret_only(value: Any) -> Any:
    if isinstance(value, (str, int, float)):  # never echoed: it may be the key itself
        raise ValueError(
            "inline credentials are refused (they would land in the ConfigMap and the logs): "
            "reference a Secret instead, e.g. `{secret: wandb, key: api-key}`"
        )
    return value


SecretOnly = Annotated[SecretRef, BeforeValidator(_secret_only)]


HUB_CACHE_CLAIM = "jobspec-hf-cache"  # `claim: auto`: `<this>-rwx` / `-rwo` / `-rwop` by access mode
_REVISION = re.compile(r"^[A-Za-z0-9_][\w.+-]*(/[\w.+-]+)*$")  # a branch, tag or commit; no '..', no leading '-'


def _claim(value: Any) -> Any:
    if isinstance(value, bool):  # YAML 1.1 reads a bare `none`/`no`/`off` loosely: false means no claim
        return "auto" if value else "none"
    return _dns_label(value) if isinstance(value, str) else value


def _revision(value: Any) -> Any:
    if isinstance(value, str):
        check_length(value, MAX_WORD_CHARS)
        if not _REVISION.match(value) or ".." in value:
            raise ValueError(
                "not a hub revision: use a branch (main), a tag (v1.0) or a commit hash (40 hex digits), "
                "as the model's page on the hub lists them"
            )
    return value


class HubCacheSpec(Section):
    """The Hugging Face cache (HF_HOME) of the pods when the model or data come from the hub: on a volume,
    so that a restart, the other nodes' next attempt and the next job find the files instead of
    downloading them again."""

    claim: Annotated[
        str,
        BeforeValidator(_claim, json_schema_input_type=_LABEL_SCHEMA | bool),
        Field(
            description=f"auto: the PersistentVolumeClaim `{HUB_CACHE_CLAIM}-<rwx|rwo|rwop>` of the job's namespace "
            "(by access mode), rendered with the job and created by `jobspec submit` when missing; it is never "
            "deleted with the job and every job of the namespace shares it. A name: that existing claim, used "
            "as it is (not rendered, never created, changed or deleted). none: an emptyDir, each pod downloads "
            "again and nothing is kept."
        ),
    ] = "auto"
    size: Annotated[
        ByteSize,
        Field(description="Storage the claim asks for (`claim: auto` when it creates it), e.g. 200Gi."),
    ] = 200 * 1024**3
    storage_class: Annotated[
        Annotated[str, StringConstraints(max_length=MAX_SUBDOMAIN_CHARS)] | None,
        Field(description="storageClassName of the claim jobspec creates; null: the cluster's default class."),
    ] = None
    access_mode: Annotated[
        Literal["auto", "ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"],
        Field(
            description="Access mode of the claim jobspec creates; auto: ReadWriteMany when hardware.nodes > 1 "
            "(every node mounts it), else ReadWriteOnce (jobs sharing it then run on one node at a time)."
        ),
    ] = "auto"


def _hub_cache(value: Any) -> Any:
    # `hub_cache: none` (or false) is the short form of `{claim: none}`.
    return {"claim": "none"} if value in ("none", False) else value


class ModelSpec(Section):
    preset: Annotated[
        PresetName | None,
        Field(description=f"Built-in architecture built from config, no download: {', '.join(PRESETS)}."),
    ] = None
    path: Annotated[
        PathStr | None,
        Field(description="Local directory (or hub id, where the pod can reach the hub) of a causal LM to fine-tune."),
    ] = None
    architecture: Annotated[
        ArchitectureField | None,
        Field(
            description="Shape of the `path` model for memory planning, where its config.json is not on this machine "
            "(a hub id): the model's config.json inline (a mapping with its `model_type`, the same keys as on the "
            "hub; any family jobspec plans), or for a dense model the short form {family: gpt2|llama, layers, "
            "hidden, heads, vocab, intermediate}. A local model's config.json is read instead."
        ),
    ] = None
    dtype: Annotated[
        Literal["auto", "bf16", "fp16", "fp32"],
        Field(description="dtype of the stored weights of `path`; training precision is `training.precision`."),
    ] = "auto"
    attention: Annotated[
        Literal["sdpa", "eager", "flash_attention_2"],
        Field(
            description="Attention kernel: sdpa (memory-efficient, any device), eager, or flash_attention_2 "
            "(GPU, bf16/fp16, needs the flash-attn package in the image; never replaced by sdpa silently). A family "
            "that refuses sdpa (Gemma 2, gpt-oss) runs eager when this is left at its default, and is refused (exit 2) "
            "when sdpa is named."
        ),
    ] = "sdpa"
    lora: Annotated[LoraSpec | None, Field(description="Train LoRA adapters instead of all weights.")] = None
    quantize: Annotated[
        Literal["none", "nf4", "auto"],
        Field(
            description="With `lora`: hold the frozen base's block linear layers in 4 bits (nf4: torchao's NF4, "
            "QLoRA; 0.52 bytes a parameter against 2), or `auto`: 16 bits at each tier where they fit, else nf4. "
            "The export writes the adapter for the 16-bit base (merged: into the dequantized base training saw)."
        ),
    ] = "none"
    revision: Annotated[
        WordStr | None,
        BeforeValidator(_revision),
        Field(
            description="Hub models: the branch, tag or commit of `path` to load; pin a commit for a run that "
            "restarts on the same weights. Default: the repository's default branch (main)."
        ),
    ] = None
    hub_token: Annotated[
        SecretOnly | None,
        Field(
            description="Hub models and datasets: Secret holding a Hugging Face token, for gated or private "
            "repositories (env HF_TOKEN); never inline."
        ),
    ] = None
    hub_cache: Annotated[
        HubCacheSpec,
        BeforeValidator(_hub_cache, json_schema_input_type=HubCacheSpec | Literal["none"] | bool),
        Field(
            description="Where the pods keep the Hugging Face cache (HF_HOME) when the model or data come from "
            "the hub: {claim, size, storage_class, access_mode}, or `none` for an emptyDir."
        ),
    ] = HubCacheSpec()

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if (self.preset is None) == (self.path is None):
            raise ValueError("set exactly one of `model.preset` or `model.path`")
        if self.preset is not None and self.architecture is not None:
            raise ValueError(f"`model.architecture` describes a `model.path` model; beside `model.preset: "
                             f"{self.preset}` (built from the preset's own shape) it would be ignored: remove "
                             "model.architecture, or replace the preset by model.path")  # fmt: skip
        if self.quantize != "none" and self.lora is None:
            raise ValueError(
                f"`model.quantize: {self.quantize}` quantizes a frozen base, which only LoRA adapters train on: "
                "add `model.lora` (e.g. {rank: 16, targets: [q_proj, v_proj]}) or remove `model.quantize`"
            )
        if self.quantize != "none" and self.preset and PRESETS[self.preset].family == "gpt2":
            raise ValueError(
                f"`model.quantize: {self.quantize}` needs linear projections and the preset {self.preset} is GPT-2 "
                "(Conv1D): use a Llama-style preset (llama-tiny) or remove `model.quantize`"
            )
        return self


def _data_source(value: Any) -> Any:
    """A data path, a hub id, or an object in an object store (`s3://bucket/key.jsonl`, `gs://bucket/prefix/`)."""
    if isinstance(value, str):
        check_length(value, MAX_PATH_CHARS)
        if why := object_store.data_problem(value):
            raise ValueError(why)
    return value


def _local_cache_dir(value: Any) -> Any:
    if isinstance(value, str) and object_store.is_url(value):
        raise ValueError("is where the pod keeps tokenized (and downloaded) data: a local path or a volume's, not "
                         "a URL; remove it (default: the run directory's data-cache)")  # fmt: skip
    return value


DataPath = Annotated[PathStr, BeforeValidator(_data_source)]


class DataSource(Section):
    path: Annotated[
        str,
        StringConstraints(min_length=1, max_length=MAX_PATH_CHARS),  # in the string's schema: a string's error
        BeforeValidator(_data_source),
        Field(
            description="One source: any file, directory, hub id or s3:// / gs:// object `data.path` takes "
            "(relative to the spec's folder for jobspec run, to /workspace in a pod).",
        ),
    ]
    weight: Annotated[
        float,
        Field(gt=0, le=1e6, description="Share of the samples drawn from this source: weight / sum of the weights."),
    ] = 1.0
    name: Annotated[
        WordStr | None,
        Field(description="Label of the source in logs and metrics; default the file or directory name."),
    ] = None
    format: Annotated[
        Literal["auto", "prompt_response", "messages", "preference", "text"] | None,
        Field(description="Record layout of this source; default `data.format`."),
    ] = None


class DataSpec(Section):
    path: Annotated[
        DataPath | None,
        Field(
            description="Training data: a .jsonl, .json (array) or .parquet file, a datasets save_to_disk directory "
            "(a DatasetDict gives its train split) or a hub dataset id (org/name); relative to the spec's folder for "
            "jobspec run, to /workspace in a pod; or such a file (directory) in object storage, s3://bucket/key.jsonl "
            "(s3://bucket/prefix/) or gs://..., "
            "downloaded once per node into the data cache; omit for the bundled synthetic set."
        ),
    ] = None
    format: Annotated[
        Literal["auto", "prompt_response", "messages", "preference", "text"],
        Field(
            description="Record layout: {prompt, response}, {messages: [{role, content}]} or, for a preference "
            "`training.objective` (dpo, ipo, simpo, orpo), preference pairs {prompt, chosen, rejected} (texts, or "
            "message lists with an optional prompt list: TRL's conventions); text = raw documents {text} for "
            "continued pretraining (loss on every token, packed unless `packing: false`); auto detects per file. "
            "`objective: kto` reads TRL's unpaired {prompt, completion, label} records (format auto)."
        ),
    ] = "auto"
    text_field: Annotated[WordStr, Field(description="Key of the document in text records.")] = "text"
    prompt_field: Annotated[WordStr, Field(description="Key of the prompt in prompt/response records.")] = "prompt"
    response_field: Annotated[WordStr, Field(description="Key of the response in prompt/response records.")] = (
        "response"
    )
    messages_field: Annotated[WordStr, Field(description="Key of the message list in chat records.")] = "messages"
    max_seq_len: Annotated[
        int,
        Field(
            ge=16,
            le=131072,
            description="Tokens per sample (longer chats are truncated, longer raw-text documents cut into blocks); "
            "sizes memory.",
        ),
    ] = 512
    packing: Annotated[
        bool,
        Field(
            description="Pack several records into each max_seq_len row, each attending only to itself (positions "
            "restart per record); turned off, with the reason in the log, where the model's attention cannot. "
            "Default true with `format: text`."
        ),
    ] = False
    text_overlap: Annotated[
        int,
        Field(
            ge=0,
            description="With `format: text`: tokens of context shared by consecutive blocks of a document longer "
            "than a row (each such document is cut into blocks of `max_seq_len`, no token dropped); scored in the "
            "first block only, so every token is trained on once. Below `max_seq_len`; default 0.",
        ),
    ] = 0
    streaming: Annotated[
        bool,
        Field(
            description="Read the training records in order as the steps need them, tokenized on the fly in a "
            "background thread (memory flat in the data size; no cache), resumable by position. Needs "
            "`training.steps` (a stream has no known length); eval comes from `eval_path` only."
        ),
    ] = False
    shuffle_buffer: Annotated[
        int | None,
        Field(
            ge=0,
            le=1_000_000,
            description="With `streaming`: records shuffled together, window by window (seeded; 0 or 1: file "
            "order); default 1024.",
        ),
    ] = None
    sources: Annotated[
        list[DataSource] | None,
        Field(
            min_length=1,
            max_length=64,
            description="Several training sources mixed by weight ({path, weight, name, format} each), sampled "
            "deterministically with exact resume; exclusive with `path` (one source).",
        ),
    ] = None
    cache_dir: Annotated[
        PathStr | None,
        BeforeValidator(_local_cache_dir),
        Field(
            description="Where the tokenized data is cached, content-addressed, for every rank and restart (and "
            "s3:// and gs:// data sources downloaded); default `<checkpoints.dir>/data-cache` (the local run "
            "directory's)."
        ),
    ] = None
    pvc: Annotated[
        DnsLabel | None, Field(description="PersistentVolumeClaim with the data, mounted read-only at `mount_path`.")
    ] = None
    mount_path: Annotated[PathStr, Field(description="Where `pvc` is mounted in the pod.")] = "/data"
    eval_path: Annotated[
        DataPath | None,
        Field(
            description="Eval data, in any format `path` takes (a DatasetDict gives its validation, else test, "
            "split); default: hold out `eval_fraction`."
        ),
    ] = None
    eval_fraction: Annotated[
        float, Field(ge=0, lt=0.5, description="Fraction of the training file held out for eval when no eval_path.")
    ] = 0.05
    num_workers: Annotated[
        Literal["auto"] | Annotated[int, Field(ge=0, le=64)],
        Field(description="DataLoader workers; auto sizes them from CPUs and host memory."),
    ] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _pack_text(cls, data: Any) -> Any:
        """Raw text for continued pretraining packs by default (a row per short document wastes most of it)."""
        if isinstance(data, dict) and data.get("format") == "text" and "packing" not in data:
            return {**data, "packing": True}
        return data

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> "DataSpec":
        if self.sources is not None and self.path is not None:
            raise ValueError("set `data.path` (one source) or `data.sources` (several, by weight), not both")
        return self

    @model_validator(mode="after")
    def _stream_options(self) -> "DataSpec":
        # A stream's length is unknown: no fraction of it can be held out; an eval set comes from eval_path.
        # eval_fraction left at its default means no eval (the runner logs it); set explicitly, it is refused.
        if self.streaming and not self.eval_path and "eval_fraction" in self.model_fields_set and self.eval_fraction:
            raise ValueError(
                "`data.streaming` cannot hold out `data.eval_fraction` of a stream of unknown length: set "
                "`data.eval_path` (an eval set, prepared as usual) or `data.eval_fraction: 0` (no eval)"
            )
        if self.shuffle_buffer is not None and not self.streaming:
            raise ValueError(
                "`data.shuffle_buffer` applies to `data.streaming: true` only (prepared data is shuffled whole): "
                "remove it or set `data.streaming: true`"
            )
        return self

    @model_validator(mode="after")
    def _text_overlap(self) -> "DataSpec":
        if not self.text_overlap:
            return self
        if self.text_overlap >= self.max_seq_len:
            raise ValueError(
                f"`data.text_overlap: {self.text_overlap}` must be below `data.max_seq_len: {self.max_seq_len}` "
                "(each block after a document's first scores max_seq_len - text_overlap new tokens): lower it, e.g. "
                f"to {self.max_seq_len // 4}"
            )
        formats = [self.format, *(s.format for s in self.sources or [])]
        if "text" not in formats:
            raise ValueError(
                "`data.text_overlap` applies to raw text only (documents cut into blocks): set `data.format: text` "
                "(or a source's `format: text`), or remove `data.text_overlap`"
            )
        return self

    def train_sources(self, bundled: str) -> list[DataSource]:
        """The training sources: `sources`, or `path` (`bundled`, the runner's sample set, when None) as one source
        of weight 1."""
        if self.sources is not None:
            return list(self.sources)
        return [DataSource(path=self.path or bundled)]


REWARD_KINDS = ("accuracy", "format", "length", "python")
THINK_FORMAT = r"^<think>(?!.*<think>)(.*?)</think>.*$"  # TRL's think_format_reward


class RewardSpec(Section):
    """One reward function of `objective: grpo`; the completion's reward is the weighted sum of them (TRL's
    `reward_funcs` and `reward_weights`)."""

    kind: Annotated[
        Literal["accuracy", "format", "length", "python"],
        Field(
            description="accuracy = 1 when the completion's final answer (its last \\boxed{...}, else what follows "
            "its last `####` or `answer:`, else its last number, else its last line) equals the record's `column` "
            "after normalising (case, spaces, $, commas, a trailing period, numbers by value), else 0; None (left "
            "out of the group's mean) for a record whose column is empty. format = 1 when the completion matches "
            "`pattern` (Python regex, DOTALL and MULTILINE, from its start), else 0. length = TRL's soft overlong "
            "punishment (DAPO, Eq. 13): 0 up to max_completion_length - `cache` tokens, then falling linearly to "
            "-1 at max_completion_length. python = `function` of `file`, called as TRL calls a reward function: "
            "f(prompts=..., completions=..., completion_ids=..., **the records' other columns) -> one float (or "
            "None) per completion."
        ),
    ]
    name: Annotated[
        str | None,
        StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.-]{1,64}$"),
        Field(description="The reward's name in the metrics (`rewards/<name>/mean`); default: the kind, or the "
              "function's name."),
    ] = None
    weight: Annotated[float, Field(ge=-1000, le=1000, description="Its weight in the summed reward.")] = 1.0
    column: Annotated[
        str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.-]{1,64}$"),
        Field(description="accuracy: the record's field holding the reference answer."),
    ] = "answer"
    pattern: Annotated[
        str, StringConstraints(min_length=1, max_length=1000),
        Field(description="format: the regular expression a well-formed completion matches (default: TRL's "
              "think_format_reward, one <think>...</think> block first)."),
    ] = THINK_FORMAT
    cache: Annotated[
        int, Field(ge=0, le=65536, description="length: the soft punishment's window, in tokens (DAPO's L_cache).")
    ] = 64
    file: Annotated[
        PathStr | None,
        Field(description="python: the .py file holding `function`, relative to the spec file (shipped with the "
              "job in its ConfigMap, as eval.benchmarks task files are) or absolute (a file in the image or on a "
              "volume). Only a file the spec names is ever run."),
    ] = None
    function: Annotated[
        str, StringConstraints(max_length=100, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,99}$"),
        Field(description="python: the function's name in `file`."),
    ] = "reward"

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "RewardSpec":
        if self.kind == "python":
            if not self.file or not self.file.endswith(".py"):
                raise ValueError("a python reward needs `file`: the path of a .py file holding `function` (relative "
                                 "to the spec file, or absolute in the pod)")  # fmt: skip
        elif self.file is not None:
            raise ValueError(f"`file` is for kind: python; a {self.kind} reward is built in: remove `file`")
        if self.kind == "format":
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"`pattern` is not a regular expression: {err}") from None
        return self

    @property
    def label(self) -> str:
        return self.name or (self.function if self.kind == "python" else self.kind)


class GrpoSpec(Section):
    """GRPO (TRL's GRPOTrainer, its defaults): each prompt's `num_generations` completions sampled by the model in
    the pod, scored by `rewards`, and trained on with their group-normalised advantages."""

    num_generations: Annotated[
        int, Field(ge=2, le=256, description="Completions per prompt (the group; TRL's default 8). A sample of "
                   "`training.global_batch` is one prompt with its group, so a step trains global_batch x "
                   "num_generations completions.")
    ] = 8
    max_completion_length: Annotated[
        int, Field(ge=1, le=2**17, description="Most tokens a completion is sampled to (TRL's default 512); the "
                   "prompt keeps its last data.max_seq_len - max_completion_length tokens.")
    ] = 512
    temperature: Annotated[float, Field(gt=0, le=100, description="Sampling temperature (TRL's default 1.0).")] = 1.0
    top_k: Annotated[
        int, Field(ge=0, le=2**20, description="Sample from the k likeliest tokens only (TRL's default 0: all); the "
                   "loss's log-probs stay those of the whole distribution at the temperature, as TRL's.")
    ] = 0
    top_p: Annotated[
        float, Field(gt=0, le=1, description="Sample from the smallest set of likeliest tokens whose probability "
                     "reaches top_p (nucleus sampling; TRL's default 1.0: all).")
    ] = 1.0
    min_p: Annotated[
        float | None, Field(ge=0, le=1, description="Drop tokens less likely than min_p times the likeliest one "
                            "(TRL's default null: none).")
    ] = None
    repetition_penalty: Annotated[
        float, Field(gt=0, le=100, description="Divides the positive scores (multiplies the negative ones) of every "
                     "token already in the prompt or the completion before the temperature, as transformers' "
                     "RepetitionPenaltyLogitsProcessor (TRL's default 1.0: none); the loss's log-probs stay the "
                     "model's, as TRL's.")
    ] = 1.0
    beta: Annotated[
        float, Field(ge=0, le=100, description="Weight of the KL term against the starting model (TRL's default "
                     "0: no reference); above 0 needs model.lora, whose disabled adapter is the reference.")
    ] = 0.0
    loss_type: Annotated[
        Literal["dapo", "grpo", "dr_grpo", "cispo", "sapo"],
        Field(description="The token loss and how the step averages it (TRL's loss_type): dapo = the clipped ratio "
              "times the advantage, over the step's completion tokens (TRL's default), grpo = the same, each "
              "completion's token mean, then over completions, dr_grpo = over completions x max_completion_length "
              "(Dr. GRPO); cispo = the advantage times the log-prob, weighted by the ratio clipped above at "
              "epsilon_high itself (not 1 + epsilon_high: MiniMax-M1's CISPO, ScaleRL recommends epsilon_high 5; "
              "averaged as dapo); sapo = a smooth gate, sigmoid(tau (ratio - 1)) 4 / tau, instead of the clip (SAPO; "
              "tau: sapo_temperature_pos or _neg by the advantage's sign; averaged as grpo). TRL's bnpo (a mean per "
              "micro-batch) is not offered: the micro-batch is the planner's, and would change the training."),
    ] = "dapo"
    sapo_temperature_pos: Annotated[
        float, Field(gt=0, le=100, description="SAPO's tau for tokens of completions with a positive advantage "
                     "(TRL's default 1.0); only with loss_type sapo.")
    ] = 1.0
    sapo_temperature_neg: Annotated[
        float, Field(gt=0, le=100, description="SAPO's tau for the others (TRL's default 1.05); only with loss_type "
                     "sapo.")
    ] = 1.05
    num_iterations: Annotated[
        int, Field(ge=1, le=64, description="Optimizer steps on each sampled batch (TRL's num_iterations, the GRPO "
                   "paper's mu; default 1): a step's prompts are sampled once and trained on this many steps in a row, "
                   "the ratio to the log-probs at sampling clipped to [1 - epsilon, 1 + epsilon_high]. The data goes "
                   "this many times slower: `training.epochs` counts num_iterations steps per batch.")
    ] = 1
    epsilon: Annotated[
        float, Field(gt=0, lt=1, description="Lower clip of the probability ratio, 1 - epsilon (TRL's default 0.2); "
                     "binds only with num_iterations above 1.")
    ] = 0.2
    epsilon_high: Annotated[
        float | None, Field(gt=0, le=10, description="Upper clip, 1 + epsilon_high (TRL's; null: epsilon; DAPO "
                            "recommends 0.28); binds only with num_iterations above 1.")
    ] = None
    scale_rewards: Annotated[
        Literal["group", "batch", "none"],
        Field(description="What divides the advantages (reward minus its group's mean): the group's standard "
              "deviation (TRL's default), the whole step's, or nothing (Dr. GRPO)."),
    ] = "group"
    rewards: Annotated[
        list[RewardSpec], Field(max_length=16, description="The reward functions, summed by weight.")
    ] = []


class TrainingSpec(Section):
    global_batch: Annotated[
        int,
        Field(
            ge=1,
            le=2**20,  # 1Mi samples; the divisor search that sizes the micro-batch stays instant
            description="Effective batch: samples per optimizer step, all GPUs; sizing never changes it.",
        ),
    ]
    micro_batch: Annotated[
        Literal["auto"] | Annotated[int, Field(ge=1)],
        Field(description="Samples per GPU per forward pass; auto = the largest that fits and divides the batch."),
    ] = "auto"
    learning_rate: Annotated[float, Field(gt=0, lt=1, description="Peak learning rate (AdamW).")] = 2e-4
    lr_scaling: Annotated[
        Literal["none", "linear"],
        Field(description="linear: lr = learning_rate * global_batch / lr_base_batch (Goyal et al. 2017)."),
    ] = "none"
    lr_base_batch: Annotated[int | None, Field(ge=1, description="Batch that `learning_rate` was tuned for.")] = None
    warmup_steps: Annotated[int, Field(ge=0, description="Linear warmup steps before cosine decay.")] = 0
    min_lr_ratio: Annotated[float, Field(ge=0, le=1, description="Cosine decay floor as a fraction of peak.")] = 0.1
    steps: Annotated[int | None, Field(ge=1, description="Optimizer steps to train; exclusive with epochs.")] = None
    epochs: Annotated[float | None, Field(gt=0, description="Passes over the data (1 when steps is unset).")] = None
    precision: Annotated[
        Literal["auto", "bf16", "fp16", "fp32"],
        Field(description="Autocast precision; auto = bf16 where supported, else fp16 on GPU, fp32 on CPU."),
    ] = "auto"
    gradient_checkpointing: Annotated[
        OnOffAuto, Field(description="Activation checkpointing; auto = on for the tiers that need it.")
    ] = "auto"
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay.")] = 0.0
    optimizer: Annotated[
        Literal["adamw", "adamw_8bit", "auto", "sgd"],
        Field(
            description="adamw = torch's fused AdamW, its two moments in fp32 (8 bytes a trainable parameter); "
            "adamw_8bit = torchao's AdamW8bit, both moments block-wise in 8 bits (about 2 bytes a parameter; a "
            "tensor under 4096 values keeps fp32 ones), on the tiers whose optimizer state is on the GPU (fast, "
            "zero2, zero3); the offload tiers (zero2_offload, minimal) keep AdamW's fp32 moments on the host; auto = "
            "adamw, or adamw_8bit at a tier where AdamW's moments do not fit and 8-bit ones do (chosen before "
            "offloading; the plan and the log say so). adamw_8bit and auto need torchao (the GPU images carry it; "
            "pip install 'jobspec-k8s[offload]'). sgd = torch's SGD without momentum (no state at all: "
            "zero2_offload then offloads nothing, minimal keeps 8 bytes a parameter on the host instead of 16); "
            "its learning rate wants to be far larger than AdamW's. Adafactor is not offered: torch's does not "
            "step FSDP2's sharded parameters."
        ),
    ] = "adamw"
    max_grad_norm: Annotated[float | None, Field(gt=0, description="Gradient clipping norm; null disables.")] = 1.0
    seed: Annotated[int, Field(ge=0, description="Seed for model init, data order and dropout.")] = 42
    log_every: Annotated[int, Field(ge=1, description="Optimizer steps between metric records.")] = 10
    eval_every: Annotated[int | None, Field(ge=1, description="Steps between evaluations; null: at the end.")] = None
    eval_batches: Annotated[int, Field(ge=1, description="Micro-batches per evaluation.")] = 8
    compile: Annotated[
        Literal["off", "blocks", "model"],
        BeforeValidator(_compile_scope),
        Field(
            description="torch.compile: `blocks` (or true) compiles each transformer block on its own (regional "
            "compilation: one block's code compiled once and reused by every layer, under FSDP2 and activation "
            "checkpointing; the loss head stays eager), `model` the whole model in one graph, `off` (or false) none. "
            "The first steps are slower while it compiles (each compilation is logged with its seconds; a new "
            "micro-batch after an OOM compiles once more); evaluation, GRPO's sampling and the reference pass run "
            "eagerly. A model this torch cannot compile stops the run with exit 2. `jobspec plan` counts the fewer "
            "activations compiled blocks keep for backward."
        ),
    ] = "off"
    loss_kernel: Annotated[
        Literal["chunked", "liger"],
        Field(
            description="The cross-entropy from the hidden states, chunk by chunk (never the whole fp32 logits): "
            "chunked = plain PyTorch, any device; liger = Liger Kernel's Triton kernel for each chunk (CUDA "
            "image; needs liger-kernel and a GPU)."
        ),
    ] = "chunked"
    block_kernels: Annotated[
        Literal["plain", "liger"],
        Field(
            description="The transformer blocks' elementwise kernels: plain = transformers' own modules; liger = "
            "Liger Kernel's Triton kernels where it has them for the family (RMSNorm, the SwiGLU/GeGLU MLP's gated "
            "activation, RoPE), which keep fewer activations for backward and fuse each into one kernel (CUDA image; "
            "needs liger-kernel and a GPU; the same losses to rounding). `jobspec plan` counts the activations they "
            "keep."
        ),
    ] = "plain"
    objective: Annotated[
        Literal["sft", "dpo", "ipo", "simpo", "orpo", "kto", "grpo"],
        Field(
            description="sft = token cross-entropy on the responses; the preference objectives train on "
            "{prompt, chosen, rejected} pairs (TRL's conventions): dpo = Direct Preference Optimization (sigmoid), "
            "against the starting model's log-probs computed once before training and cached beside the tokenized "
            "data (with LoRA: the adapter off); ipo = IPO (TRL's DPOTrainer, loss_type ipo: its squared loss on "
            "length-averaged log-ratios), against the same reference; simpo = SimPO (TRL's CPOTrainer, loss_type "
            "simpo, cpo_alpha 0) and orpo = ORPO (TRL's ORPOTrainer), both reference-free, on length-normalised "
            "log-probs; kto = KTO (TRL's KTOTrainer) on unpaired {prompt, completion, label} records, against the "
            "reference, with its KL estimate from mismatched prompt/completion rows; grpo = GRPO (TRL's GRPOTrainer, "
            "loss_type dapo) on prompt-only {prompt, ...} records: completions sampled in the pod, scored by "
            "`training.grpo.rewards`."
        ),
    ] = "sft"
    beta: Annotated[
        float,
        Field(
            gt=0,
            le=100,
            description="The preference objective's beta (TRL's default 0.1 for each): DPO's and KTO's, how far the "
            "policy may move from the reference; IPO's regularisation tau (its target margin is 1 / (2 beta)); "
            "SimPO's reward scale; ORPO's weight of the odds-ratio term (lambda).",
        ),
    ] = 0.1
    desirable_weight: Annotated[
        float,
        Field(gt=0, le=1000, description="KTO's weight of the desirable (label true) records' losses (TRL's "
              "KTOConfig default 1.0); only with `objective: kto`."),
    ] = 1.0
    undesirable_weight: Annotated[
        float,
        Field(gt=0, le=1000, description="KTO's weight of the undesirable (label false) records' losses (TRL's "
              "KTOConfig default 1.0); only with `objective: kto`."),
    ] = 1.0
    simpo_gamma: Annotated[
        float | None,
        Field(
            ge=0,
            le=100,
            description="SimPO's target reward margin, gamma; only with `objective: simpo`, where null means TRL's "
            f"CPOConfig default, {SIMPO_GAMMA}.",
        ),
    ] = None
    grpo: Annotated[
        GrpoSpec | None, Field(description="GRPO's settings; only with `objective: grpo`, which needs rewards.")
    ] = None

    @model_validator(mode="after")
    def _schedule(self) -> "TrainingSpec":
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set either `training.steps` or `training.epochs`, not both: remove one (from the command "
                             "line: --set training.epochs=null to train by steps, --set training.steps=null by "
                             "epochs)")  # fmt: skip
        if self.lr_scaling == "linear" and self.lr_base_batch is None:
            raise ValueError("`training.lr_scaling: linear` needs `training.lr_base_batch` (its tuned batch)")
        if self.warmup_steps and self.steps is not None and self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})")
        if self.simpo_gamma is not None and self.objective != "simpo":
            raise ValueError(f"`training.simpo_gamma` is SimPO's: set `training.objective: simpo`, or drop "
                             f"simpo_gamma (objective {self.objective})")  # fmt: skip
        weighted = [f for f in ("desirable_weight", "undesirable_weight")  # TRL's 1.0 is no weighting (a spec
                    if f in self.model_fields_set and getattr(self, f) != 1.0]  # dumped and read again has it set)
        if self.grpo is not None and self.objective != "grpo":
            raise ValueError(f"`training.grpo` is GRPO's: set `training.objective: grpo`, or drop it "
                             f"(objective {self.objective})")  # fmt: skip
        if self.objective == "grpo" and (self.grpo is None or not self.grpo.rewards):
            raise ValueError("`training.objective: grpo` needs `training.grpo.rewards`, e.g. [{kind: accuracy, "
                             "column: answer}] (records {prompt, answer}) or [{kind: python, file: rewards.py}]")
        if weighted and self.objective != "kto":
            raise ValueError(f"`training.{weighted[0]}` is KTO's: set `training.objective: kto`, or drop it "
                             f"(objective {self.objective})")  # fmt: skip
        return self

    @property
    def gamma(self) -> float:
        """SimPO's target margin: `simpo_gamma`, or TRL's default."""
        return SIMPO_GAMMA if self.simpo_gamma is None else self.simpo_gamma

    @property
    def peak_lr(self) -> float:
        if self.lr_scaling == "linear" and self.lr_base_batch:
            return self.learning_rate * self.global_batch / self.lr_base_batch
        return self.learning_rate


class GpuRequest(Section):
    type: Annotated[
        Annotated[str, StringConstraints(max_length=MAX_GPU_TYPE_CHARS)] | None,
        Field(description="GPU model, e.g. H100, A100-80GB, RTX3080-20GB, MI300X (see `jobspec plan`)."),
    ] = None
    count: Annotated[int, Field(ge=1, le=64, description="GPUs per node (processes per node for vendor cpu).")] = 1
    memory: Annotated[ByteSize | None, Field(description="Memory per GPU, for types jobspec does not know.")] = None

    @property
    def memory_bytes(self) -> int | None:
        if self.memory is not None:
            return self.memory
        info = gpu_catalogue.lookup(self.type) if self.type else None
        return info.memory_bytes if info else None


# The host memory a pod requests per rank (a GPU; a process for vendor cpu) when hardware.memory is unset
# (jobspec/render/pod.py); `jobspec plan` says when an offload tier needs more.
DEFAULT_MEMORY_PER_RANK: typing.Mapping[str, int] = types.MappingProxyType({"cuda": 8 * 1024**3, "rocm": 8 * 1024**3,
                                                                           "cpu": 2 * 1024**3})  # fmt: skip


class HardwareSpec(Section):
    vendor: Annotated[Vendor, Field(description="cuda (NVIDIA), rocm (AMD) or cpu (no accelerator).")] = "cuda"
    gpus: Annotated[
        GpuRequest,
        BeforeValidator(
            parse_gpus,
            json_schema_input_type=GpuRequest
            | Annotated[int, Field(ge=1, le=64)]
            | Annotated[str, Field(pattern=GPUS_PATTERN, examples=["H100:8", "RTX3080-20GB:2"])],
        ),
        Field(description="GPUs per node: 'H100:8', 8, or {type, count, memory}."),
    ] = GpuRequest()
    nodes: Annotated[int, Field(ge=1, le=1024, description="Nodes (pods) in the Indexed Job.")] = 1
    cpu: Annotated[
        CpuQuantity | None,
        Field(description="CPU request per pod, e.g. 8 or '500m' (no limit); default 2 per GPU, 1 per CPU process."),
    ] = None
    memory: Annotated[
        ByteSize | None,
        Field(
            description="Host memory per pod (request = limit), e.g. '64Gi'; default a request of 8Gi per GPU, "
            "2Gi per CPU process, with no limit."
        ),
    ] = None
    shm_size: Annotated[ByteSize, Field(description="Size of the memory-backed /dev/shm (dataloader workers).")] = (
        8 * 1024**3
    )
    supplemental_groups: Annotated[
        list[int] | None,
        Field(description="Extra GIDs for the pod; ROCm default [44, 109] (video, render) for /dev/kfd and /dev/dri."),
    ] = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus.count


class MemorySpec(Section):
    tier: Annotated[
        Tier, Field(description="Memory tier; auto = the fastest the memory model says fits (docs/concepts/tiers.md).")
    ] = "auto"
    fallback: Annotated[bool, Field(description="On OOM at micro-batch 1, resume at the next tier.")] = True
    target_utilization: Annotated[
        float, Field(ge=0.5, le=0.98, description="Fraction of GPU memory the micro-batch is sized to.")
    ] = 0.9
    regrow_after: Annotated[
        int | None,
        Field(
            ge=1,
            description="Steps without OOM after an in-process shrink before the larger micro-batch is tried again "
            "(at most 3 tries, the wait doubling after each); null: keep the smaller one.",
        ),
    ] = 50
    trace: Annotated[
        Literal["auto", "on", "off"],
        Field(
            description="Size the starting micro-batch from a trace of the runner's own step (fake tensors, rank 0, "
            "a process of its own) instead of the memory model's formula; probe steps verify either. auto: on a "
            "GPU, unless training.micro_batch is set.",
        ),
    ] = "auto"
    trace_seconds: Annotated[
        int,
        Field(ge=10, le=540, description="Time the trace may take before the formula's plan is kept (seconds)."),
    ] = 180


_SUB_PATH = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


def _sub_path(value: Any) -> Any:
    if isinstance(value, str):
        check_length(value, MAX_PATH_CHARS)
    if isinstance(value, str) and (not _SUB_PATH.match(value) or ".." in value.split("/")):
        raise ValueError("must be a relative path of letters, digits, '.', '_' and '-' (no '..', no leading '/')")
    return value


def _checkpoint_dir(value: Any) -> Any:
    if isinstance(value, str) and (why := object_store.control_problem(value) or object_store.problem(value)):
        raise ValueError(why)
    return value


class CheckpointSpec(Section):
    dir: Annotated[
        str,
        StringConstraints(min_length=1, max_length=MAX_PATH_CHARS),  # in the string's schema: a string's error
        BeforeValidator(_checkpoint_dir),
        Field(
            description="Run directory: checkpoints, metrics.jsonl and tier state; or `s3://bucket/prefix` "
            "(`gs://bucket/prefix`): checkpoints published to object storage (staged in `local_dir`; credentials as "
            "AWS_* variables from a Secret, or for gs:// `gcs_credentials` or workload identity).",
        ),
    ] = "/checkpoints"
    local_dir: Annotated[
        PathStr | None,
        Field(
            description="With an `s3://` or `gs://` dir: the local run directory in the pod (staging, metrics, "
            "data cache); default /checkpoints, an emptyDir."
        ),
    ] = None
    pvc: Annotated[
        DnsLabel | None,
        Field(description="PersistentVolumeClaim mounted at `dir`; without one, checkpoints die with the pod."),
    ] = None
    sub_path: Annotated[
        PathStr | None,
        BeforeValidator(_sub_path),
        Field(
            description="Directory on `pvc` that is mounted at `dir`: auto = the job name, so jobs sharing one "
            "volume never share a run directory; null mounts the volume's root."
        ),
    ] = "auto"
    every_steps: Annotated[int, Field(ge=1, description="Optimizer steps between checkpoints.")] = 200
    keep: Annotated[int, Field(ge=1, description="Checkpoints kept; older ones are deleted.")] = 2
    resume: Annotated[
        Literal["auto", "force"],
        Field(
            description="auto: continue the newest checkpoint of this same training, refuse one whose job, model, "
            "data or global batch differ; force: continue it anyway."
        ),
    ] = "auto"


class OutputSpec(Section):
    """The product of a run: a Hugging Face model directory (or a PEFT adapter) that loads without jobspec."""

    dir: Annotated[
        PathStr | None,
        Field(description="Where the exported model goes; default `<checkpoints.dir>/model`."),
    ] = None
    export: Annotated[
        bool, Field(description="Export the final checkpoint when the run ends (else: `jobspec export` later).")
    ] = True
    merge_lora: Annotated[
        bool, Field(description="LoRA runs: write merged full weights instead of a PEFT adapter directory.")
    ] = False
    dtype: Annotated[
        Literal["auto", "bf16", "fp16", "fp32"],
        Field(description="dtype of the exported weights; auto = the dtype they were trained in."),
    ] = "auto"
    max_shard_size: Annotated[
        ByteSize | None,
        Field(description="Largest safetensors file before the weights are sharded; default transformers' own."),
    ] = None


class TensorBoardSpec(Section):
    logdir: Annotated[
        PathStr | None, Field(description="Event-file directory; default `<checkpoints.dir>/tensorboard`.")
    ] = None


class WandbSpec(Section):
    project: Annotated[WordStr, Field(min_length=1, description="W&B project.")]
    entity: Annotated[WordStr | None, Field(description="W&B entity (team or user).")] = None
    api_key: Annotated[
        SecretOnly | None, Field(description="Secret holding the API key (env WANDB_API_KEY); never inline.")
    ] = None
    mode: Annotated[
        Literal["online", "offline"], Field(description="offline writes runs under the run dir to sync later.")
    ] = "online"


class MlflowSpec(Section):
    tracking_uri: Annotated[
        PathStr | None, Field(description="MLflow tracking server URI; default a file store under the run dir.")
    ] = None
    experiment: Annotated[WordStr | None, Field(description="Experiment name; default the job name.")] = None
    token: Annotated[
        SecretOnly | None, Field(description="Secret holding a token (env MLFLOW_TRACKING_TOKEN); never inline.")
    ] = None
    username: Annotated[
        SecretOnly | None, Field(description="Secret holding the user name (env MLFLOW_TRACKING_USERNAME).")
    ] = None
    password: Annotated[
        SecretOnly | None, Field(description="Secret holding the password (env MLFLOW_TRACKING_PASSWORD).")
    ] = None


def _enabled(value: Any) -> Any:
    # `tensorboard: true` is the short form of `tensorboard: {}`; false or null turns it off.
    if value is True:
        return {}
    return None if value is False else value


class TrackingSpec(Section):
    """Where metrics go besides `metrics.jsonl` (which is always written): through accelerate's trackers."""

    tensorboard: Annotated[
        TensorBoardSpec | None,
        BeforeValidator(_enabled, json_schema_input_type=TensorBoardSpec | bool | None),
        Field(description="TensorBoard: `true` or {logdir}."),
    ] = None
    wandb: Annotated[WandbSpec | None, Field(description="Weights & Biases: {project, entity, api_key}.")] = None
    mlflow: Annotated[
        MlflowSpec | None,
        BeforeValidator(_enabled, json_schema_input_type=MlflowSpec | bool | None),
        Field(description="MLflow: `true` or {tracking_uri, ...}."),
    ] = None
    run_name: Annotated[WordStr | None, Field(description="Run name in the trackers; default the job name.")] = None


_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # lm-evaluation-harness's task and group names
TASK_FILE_SUFFIXES = (".yaml", ".yml")


def _benchmark(value: Any) -> Any:
    if isinstance(value, str):
        check_length(value, MAX_PATH_CHARS)
        if not value.lower().endswith(TASK_FILE_SUFFIXES) and not _TASK_NAME.match(value):
            raise ValueError(
                "is neither an lm-evaluation-harness task name (letters, digits, '_', '.', '-', e.g. arc_easy) nor a "
                "task YAML file (a path ending in .yaml)"
            )
    return value


class EvalSpec(Section):
    """Benchmarks of the exported model with lm-evaluation-harness: at the end of the job (rank 0, after the export)
    and by `jobspec eval RUN_DIR`. Results go to metrics.jsonl as `eval/<task>/<metric>`, the trackers, the report."""

    benchmarks: Annotated[
        list[Annotated[str, BeforeValidator(_benchmark), StringConstraints(min_length=1)]],
        Field(
            max_length=64,
            description="lm-evaluation-harness task or group names (e.g. arc_easy, hellaswag: their data sets come "
            "from the hub into HF_HOME, the shared hub cache), or task YAML files (a path ending in .yaml, "
            "relative to the spec file) for tasks of your own. Needs the eval extra in the image.",
        ),
    ] = []
    limit: Annotated[
        int | None, Field(ge=1, description="Samples per task (lm-eval's --limit); null: every sample.")
    ] = None
    num_fewshot: Annotated[
        int | None, Field(ge=0, le=100, description="Few-shot examples per prompt; null: each task's own default.")
    ] = None
    batch_size: Annotated[int, Field(ge=1, le=4096, description="Requests per forward pass.")] = 8
    timeout_seconds: Annotated[
        int,
        Field(
            ge=10,
            le=7 * 24 * 3600,
            description="Time all benchmarks may take; a task still running then is stopped and the rest skipped "
            "(the results so far are kept).",
        ),
    ] = 3600


class Toleration(Section):
    key: Annotated[KeyStr | None, Field(description="Taint key.")] = None
    operator: Annotated[Literal["Exists", "Equal"], Field(description="Exists or Equal.")] = "Equal"
    value: Annotated[
        Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE_CHARS)] | None,
        Field(description="Taint value (operator Equal)."),
    ] = None
    effect: Annotated[
        Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None, Field(description="Taint effect.")
    ] = None
    toleration_seconds: Annotated[int | None, Field(ge=0, description="For NoExecute taints.")] = None

    @model_validator(mode="after")
    def _api_rules(self) -> "Toleration":  # the API server's own checks, caught before submit
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no `value`; remove it or use operator Equal")
        if self.operator == "Equal" and not self.key:
            raise ValueError("operator Equal needs a `key`; an empty key only works with operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("toleration_seconds applies only to effect NoExecute")
        return self


class SchedulingSpec(Section):
    queue: Annotated[DnsLabel | None, Field(description="Kueue LocalQueue; the Job is created suspended.")] = None
    priority_class: Annotated[
        Annotated[str, StringConstraints(max_length=MAX_SUBDOMAIN_CHARS)] | None,
        Field(description="PriorityClass name."),
    ] = None
    node_selector: Annotated[dict[KeyStr, TextStr], Field(description="Node labels the pods require.")] = {}
    tolerations: Annotated[list[Toleration], Field(description="Tolerations for tainted GPU nodes.")] = []
    service_account: Annotated[DnsLabel | None, Field(description="ServiceAccount the pods run as.")] = None
    ttl_seconds_after_finished: Annotated[
        int | None, Field(ge=0, description="Delete the finished Job after this many seconds.")
    ] = 7 * 24 * 3600
    backoff_limit: Annotated[
        int, Field(ge=0, le=100, description="Pod failures allowed per node (index); a tier step-down costs one, "
                   "as does a tier retried with 8-bit Adam moments (training.optimizer auto).")
    ] = 6
    active_deadline_seconds: Annotated[int | None, Field(ge=1, description="Wall-clock limit of the Job.")] = None
    termination_grace_seconds: Annotated[
        int, Field(ge=15, description="Time to checkpoint after SIGTERM before the kill.")
    ] = 120
    heartbeat_timeout_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=3600,
            description="Several ranks: a rank silent this long (a frozen or unreachable node) is lost, and the "
            "others exit with the code the Job retries, to resume together from the newest checkpoint; 0 turns "
            "the heartbeat off.",
        ),
    ] = 30
    node_loss_toleration_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=300,
            description="How long a pod stays bound to a node Kubernetes marks unreachable or not-ready before it "
            "is evicted and its index replaced (NoExecute tolerations; Kubernetes' default is 300).",
        ),
    ] = 30
    collective_timeout_seconds: Annotated[
        int,
        Field(
            ge=10,
            description="Several ranks: a collective (or the rendezvous at start) waiting longer than this fails "
            "the attempt (retried by the Job) instead of hanging.",
        ),
    ] = 600
    labels: Annotated[dict[KeyStr, TextStr], Field(description="Extra labels on every object.")] = {}
    annotations: Annotated[dict[KeyStr, TextStr], Field(description="Extra annotations on every object.")] = {}
    network_policy: Annotated[
        bool,
        Field(
            description="Render a NetworkPolicy: only this job's pods may connect to its pods (any TCP port; "
            "egress stays open). false where the CNI enforces no policies or an admin manages them."
        ),
    ] = True


def _hex40_counts(name: str) -> bool:
    # 40 hex digits are a W&B key, or a git commit: a revision's name says which.
    return not re.search(r"(^|_)(REVISION|COMMIT|SHA|HASH|DIGEST|REF|VERSION)(_|$)", name, re.I)


def _env_text(value: Any) -> Any:
    # YAML reads `false` and `8` as bool and int; an env var is text, spelled the way YAML spells it.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (int, float)) else value


EnvValue = Annotated[
    TextStr | SecretRef, BeforeValidator(_env_text, json_schema_input_type=str | int | float | bool | SecretRef)
]


class JobSpec(Section):
    """One fine-tuning job."""

    name: Annotated[JobName, Field(description="Job name (DNS-1123 label, at most 50 characters).")]
    namespace: Annotated[DnsLabel, Field(description="Kubernetes namespace.")] = "default"
    image: Annotated[ImageSpec, Field(description="Container image.")] = ImageSpec()
    model: Annotated[ModelSpec, Field(description="What to fine-tune.")]
    data: Annotated[DataSpec, Field(description="Training data.")] = DataSpec()
    training: Annotated[TrainingSpec, Field(description="Optimisation: batch, learning rate, length, precision.")]
    hardware: Annotated[HardwareSpec, Field(description="Accelerators, nodes and pod resources.")] = HardwareSpec()
    memory: Annotated[MemorySpec, Field(description="Memory tier and OOM fallback.")] = MemorySpec()
    checkpoints: Annotated[CheckpointSpec, Field(description="Where and how often to checkpoint.")] = CheckpointSpec()
    scheduling: Annotated[SchedulingSpec, Field(description="Cluster scheduling.")] = SchedulingSpec()
    output: Annotated[OutputSpec, Field(description="The exported model (Hugging Face format).")] = OutputSpec()
    tracking: Annotated[TrackingSpec, Field(description="Metrics to TensorBoard, W&B or MLflow.")] = TrackingSpec()
    eval: Annotated[
        EvalSpec, Field(description="Benchmarks of the exported model (lm-evaluation-harness).")
    ] = EvalSpec()
    env: Annotated[
        dict[KeyStr, EnvValue],
        Field(description="Environment: NAME: value, or NAME: {secret, key} for credentials (never inline)."),
    ] = {}
    env_from_secrets: Annotated[list[DnsLabel], Field(description="Secrets whose keys all become env vars.")] = []
    gcs_credentials: Annotated[
        SecretOnly | None,
        Field(
            description="For gs:// locations: a Google service-account key (its JSON) by Secret reference, "
            "`{secret, key}`, mounted read-only into the pod and named by GOOGLE_APPLICATION_CREDENTIALS; unset: "
            "the pod's workload identity (GKE) or the node's service account."
        ),
    ] = None

    @field_validator("env")
    @classmethod
    def _no_inline_secrets(cls, env: dict[str, str | SecretRef]) -> dict[str, str | SecretRef]:
        problems: list[tuple[str, str, str | None]] = []
        for key, value in env.items():
            if not _ENV_NAME.match(key):
                problems.append((f"env.{key}", "not a valid variable name", "use letters, digits and '_'"))
            elif credential_kind(key):
                problems.append((f"env.{key}", "the variable's name is a credential (not shown)", "name it: HF_TOKEN"))
            elif key.startswith(RESERVED_ENV_PREFIX):
                reserved = f"names starting with {RESERVED_ENV_PREFIX} are set by jobspec"
                problems.append((f"env.{key}", reserved, "rename it"))
            elif isinstance(value, SecretRef) and (credential_kind(value.key) or credential_kind(value.secret)):
                what = "the Secret reference holds a credential itself (not shown)"
                problems.append((f"env.{key}", what, "name the Secret and its key: `{secret: hf, key: token}`"))
            elif isinstance(value, str) and _ENV_REF.match(value):
                continue  # `$(HF_TOKEN)`: Kubernetes fills it from another variable (a secretKeyRef), no value here
            elif isinstance(value, str) and (is_secret_name(key) or credential_kind(value, hex40=_hex40_counts(key))):
                kind = credential_kind(value, hex40=_hex40_counts(key))
                what = f"inline secret value ({kind})" if kind else "inline secret value"
                problems.append(
                    (f"env.{key}", f"{what}: never written to a manifest or a log", SECRET_REF_HINT.format(name=key))
                )
        if problems:
            raise CrossFieldError(problems)
        return env

    @model_validator(mode="after")
    def _check(self) -> "JobSpec":
        problems = cross_field_problems(self) + inline_credentials(self.model_dump(exclude={"env"}))
        hint = "use a value a setting can take"  # e.g. steps: '99999999999999999999' (a string YAML left as text)
        problems += [(".".join(map(str, loc)), msg, hint) for loc, msg in out_of_range(self.model_dump())]
        if problems:
            raise CrossFieldError(problems)
        return self

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    @property
    def checkpoint_sub_path(self) -> str | None:
        """The directory of `checkpoints.pvc` mounted at `checkpoints.dir` (None: the volume's root)."""
        sub = self.checkpoints.sub_path
        return self.name if sub == "auto" else sub

    @property
    def run_dir(self) -> str:
        """The local run directory: `checkpoints.dir`, or `checkpoints.local_dir` when that is an object store."""
        return object_store.run_dir(self.checkpoints.dir, self.checkpoints.local_dir)

    @property
    def remote_dir(self) -> object_store.ObjectUrl | None:
        """The object-store location of `checkpoints.dir` (`s3://...`), or None for a directory."""
        return object_store.parse(self.checkpoints.dir)

    @property
    def export_dir(self) -> str:
        """Where the exported model goes: `output.dir`, else `<run dir>/model` (with an object store, uploaded
        to `<checkpoints.dir>/model` too)."""
        return self.output.dir or f"{self.run_dir.rstrip('/')}/model"

    def to_yaml_dict(self) -> dict[str, Any]:
        """The spec as plain data that `load_spec` reads back to an equal spec."""
        # Defaults left out keep the ConfigMap short; explicit nulls that override a default stay.
        return self.model_dump(mode="json", exclude_defaults=True)

    def spec_hash(self) -> str:
        canonical = json.dumps(self.to_yaml_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
