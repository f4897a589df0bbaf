"""`jobspec init`: a first spec, commented, with the tier and micro-batch `jobspec plan` chooses, or a refusal that
names the smallest change that would fit.

The model is a preset, a local directory with a config.json, or a hub id whose config.json is in this machine's
Hugging Face cache or in a file given with `--config` (no network here: the planner needs the model's shape). A hub
model's config.json is written into the spec as `model.architecture`, so `jobspec plan` reads it as it would read the
local file. The spec is built as text, parsed by the same loader as any spec file and planned by `plan_spec`; what
is written is what `jobspec plan` then says.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from jobspec.catalog import gpus as gpu_catalogue
from jobspec.catalog.presets import PRESETS, ModelShape
from jobspec.errors import ConfigError
from jobspec.plan.planner import PlanReport, plan_spec
from jobspec.spec.hub import is_hub_id
from jobspec.spec.loader import parse_spec

GiB = 1024**3
MAX_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Request:
    """What `jobspec init` was asked for."""

    model: str
    gpus: str  # TYPE:COUNT, e.g. A100-80GB:2
    data: str
    objective: str = "sft"
    name: str | None = None
    nodes: int = 1
    lora: bool = False
    max_seq_len: int = 2048
    global_batch: int | None = None
    file: str | None = None  # where the spec is written (-o): its header's commands name it
    config: str | None = None  # a hub model's config.json, as a local file (--config): the hub cache's otherwise
    data_format: str | None = None  # data.format (text: raw documents, continued pretraining)
    quantize: str | None = None  # model.quantize with LoRA (nf4: QLoRA)


def hub_config(repo: str) -> Path | None:
    """The config.json of `repo` in this machine's Hugging Face cache (the newest snapshot), or None."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    hub = Path(os.environ.get("HF_HUB_CACHE") or home / "hub")
    snapshots = hub / f"models--{repo.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


# Keys of a config.json that describe the files and tools rather than the model (what the trace drops too)
_NOT_SHAPE = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path")


def _model_lines(model: str, config_file: str | None = None) -> tuple[list[str], ModelShape, int | None]:
    """The `model:` section's lines for a preset, a local directory or a hub model (its config.json from `config_file`
    or the hub cache), its shape (the LoRA targets' names) and its positions (the longest sequence it takes)."""
    from jobspec.catalog.model_config import read_config, read_config_file, shape_from_config

    local = Path(model).expanduser()
    if config_file and (model in PRESETS or local.exists() or not is_hub_id(model)):
        raise ConfigError(f"--config {config_file}: only for a hub id (org/name); --model {model} is a preset or a "
                          "local path, whose config jobspec reads itself: remove --config")  # fmt: skip
    if model in PRESETS:
        preset = PRESETS[model]
        return [f"  preset: {model}  # built from its config: no download"], preset, preset.max_positions
    if (local / "config.json").is_file():
        shape = shape_from_config(read_config(local), where=str(local / "config.json"))
        lines = [f"  path: {local}  # local model directory (config.json, weights, tokenizer)"]
        return lines, shape, shape.max_positions
    if local.exists():
        raise ConfigError(f"--model {model}: {local} has no config.json: name a Hugging Face model directory")
    if not is_hub_id(model):
        raise ConfigError(
            f"--model {model}: not a preset ({', '.join(PRESETS)}), a local model directory or a hub id (org/name)"
        )
    if config_file:
        config, source = Path(config_file).expanduser(), f"--config {config_file}"
        if config.is_dir():
            config = config / "config.json"
        if not config.is_file():
            raise ConfigError(f"--config {config_file}: no such file: give the model's config.json, downloaded from "
                              f"huggingface.co/{model}/blob/main/config.json")  # fmt: skip
    else:
        found = hub_config(model)
        if found is None:
            presets = "" if "/" in model else f"not a preset ({', '.join(PRESETS)}), and as a hub id "
            raise ConfigError(
                f"--model {model}: {presets}its config.json is not on this machine, and the plan needs the model's "
                f"shape: `hf download {model} config.json`, or download "
                f"huggingface.co/{model}/blob/main/config.json elsewhere and pass it with --config FILE"
            )
        config, source = found, f"snapshot {found.parent.name[:12]}'s config.json"
    cfg = read_config_file(config)
    shape = shape_from_config(cfg, where=str(config))
    lines = [
        f"  path: {model}  # downloaded by the pod into the hub cache (model.hub_cache)",
        f"  # Its config.json ({source}), read by `jobspec plan` as a local one is:",
        "  architecture:",
        *(f"    {_yaml_key(key)}: {_yaml_value(value)}" for key, value in cfg.items() if key not in _NOT_SHAPE),
    ]
    return lines, shape, shape.max_positions


def _yaml_key(key: str) -> str:
    return key if key.isidentifier() else json.dumps(key)


def _yaml_value(value: object) -> str:
    """One config.json value as a YAML flow scalar or collection that reads back as the JSON value (YAML 1.1 reads
    json.dumps' `1e-05` as a string: PyYAML writes `1.0e-05`)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000, allow_unicode=False)
    return text.removesuffix("\n...\n").removesuffix("\n")


def lora_targets(shape: ModelShape) -> str:
    """The attention projections of the model's block, as LoRA targets (peft's module names)."""
    if shape.family == "gpt2":
        return "[c_attn]"
    if shape.fused_projections:  # Phi-3: one q/k/v projection
        return "[qkv_proj, o_proj]"
    if shape.mla:  # DeepSeek-V2: q (or its low-rank pair), the k/v latent and its expansion
        q = "q_a_proj, q_b_proj" if shape.mla[0] else "q_proj"
        return f"[{q}, kv_a_proj_with_mqa, kv_b_proj, o_proj]"
    if shape.linear:  # Qwen3-Next: the linear-attention layers' projections too (3 of 4 layers hold no q_proj)
        return "[q_proj, k_proj, v_proj, o_proj, in_proj_qkvz, in_proj_ba, out_proj]"
    return "[q_proj, k_proj, v_proj, o_proj]"


def _text(req: Request, name: str, seq: int, lora: bool, gpus: str, nodes: int, tier: str, note: list[str]) -> str:
    gpu = gpu_catalogue.lookup(gpus.partition(":")[0])
    cpu = gpus.partition(":")[0].lower() == "cpu"  # --gpus cpu:N: N processes on this machine's CPUs
    vendor = "cpu" if cpu else gpu.vendor if gpu else "cuda"
    dpo = req.objective != "sft"
    grpo = req.objective == "grpo"
    batch = req.global_batch or (16 if grpo else 32 if dpo else 64)  # GRPO: prompts, each of 8 completions
    lr = "5.0e-7" if dpo and not lora else ("2.0e-4" if lora else "2.0e-5")
    if grpo:  # TRL's GRPOConfig: 1e-6 (full); adapters take ten times it
        lr = "1.0e-5" if lora else "1.0e-6"
    model_lines, shape, positions = _model_lines(req.model, req.config)
    where = gpus + (f" x {nodes} nodes" if nodes > 1 else "")
    file = shlex.quote(req.file) if req.file and req.file.isprintable() else f"{name}.yaml"
    lines = [
        f"# Written by `jobspec init`: {req.objective} of {req.model} on {where}. Check it with",
        f"#   jobspec validate {file} && jobspec plan {file}",
        f"# Made by: {command(req)}",
        f"name: {name}",
        "model:",
        *model_lines,
    ]
    if lora:
        lines += [
            "  lora:  # train adapters; the base stays frozen (16 bytes only per adapter weight)",
            "    rank: 16",
            "    alpha: 32",
            f"    targets: {lora_targets(shape)}",
        ]
        if req.quantize:
            lines.append(f"  quantize: {req.quantize}  # the frozen base's block weights in 4 bits (QLoRA)")
    capped = (
        f"  # the model's positions (--max-seq-len {req.max_seq_len} is longer)"
        if seq == positions < req.max_seq_len
        else ""
    )
    records = ("{prompt, completion, label: true|false} (unpaired; or pairs, split)" if req.objective == "kto" else
               "{prompt, answer} (prompt-only; every other field goes to the rewards)" if grpo else
               "{prompt, chosen, rejected} pairs" if dpo else "{prompt, response} or {messages: [...]}")  # fmt: skip
    fmt = ["  # records: " + records]
    if req.data_format:
        what = "raw documents {text}: loss on every token, packed" if req.data_format == "text" else "its layout"
        fmt = [f"  format: {req.data_format}  # {what}"]
    lines += [
        "data:",
        f"  path: {req.data}",
        *fmt,
        f"  max_seq_len: {seq}" + capped,
        "training:",
        f"  objective: {req.objective}",
        *([
            "  grpo:",
            "    num_generations: 8  # completions sampled per prompt (TRL's default); a step trains batch x 8",
            f"    max_completion_length: {min(512, seq // 2)}  # the prompt keeps the rest of max_seq_len",
            "    rewards:  # summed by weight; your own: {kind: python, file: rewards.py, function: NAME}",
            "      - kind: accuracy  # 1 when the completion's final answer equals the record's `answer`",
            "        column: answer",
        ] if grpo else []),
        f"  global_batch: {batch}  # the effective batch: fixed, whatever micro-batch fits",
        f"  micro_batch: auto  # the runner verifies the plan's micro-batch {'here' if cpu else 'on the GPU'} (see "
        "below)",
        f"  learning_rate: {lr}",
        "  epochs: 1",
        "hardware:",
        f"  vendor: {vendor}",
        f"  gpus: {gpus.partition(':')[2]}  # processes (runs on this machine: jobspec run)" if cpu else
        f"  gpus: {gpus}  # type:count per node",
    ]
    if nodes > 1:
        lines.append(f"  nodes: {nodes}")
    lines += ["memory:", *(f"  # {n}" for n in note), f"  tier: {tier}"]
    # A cluster job's run directory is a claim; a CPU spec's local run writes under runs/<name> (jobspec/local_paths.py)
    lines += ["checkpoints:", f"  pvc: {name}-checkpoints"] if not cpu else []
    return "".join(_aligned(line) + "\n" for line in lines)


def command(req: Request) -> str:
    """The `jobspec init` command line that writes this spec again (the header says it)."""
    args = ["jobspec", "init", "--model", req.model, "--gpus", req.gpus, "--data", req.data]
    args += ["--objective", req.objective] if req.objective != "sft" else []
    args += ["--config", req.config] if req.config else []
    args += ["--format", req.data_format] if req.data_format else []
    args += ["--lora"] if req.lora else []
    args += ["--quantize", req.quantize] if req.quantize else []
    args += ["--nodes", str(req.nodes)] if req.nodes > 1 else []
    args += ["--max-seq-len", str(req.max_seq_len)] if req.max_seq_len != 2048 else []
    args += ["--name", req.name] if req.name else []
    args += ["-o", req.file] if req.file else []
    return " ".join(shlex.quote(a if a.isprintable() else ascii(a)) for a in args)  # one line, whatever it holds


def _aligned(line: str, column: int = 34) -> str:
    """`key: value   # comment` with the comments of value lines in one column."""
    code, sep, comment = line.partition("  # ")
    if not sep or not code.strip():
        return line
    return f"{code.rstrip():<{column - 2}}  # {comment.strip()}"


def _plan(text: str) -> PlanReport:
    spec = parse_spec(text, "<init>")
    return plan_spec(spec, host_share(spec.world_size) if spec.hardware.vendor == "cpu" else None, rows=1000)


def host_share(processes: int) -> str:
    """A CPU spec's memory to plan against: this machine's memory, shared by its processes."""
    import os

    return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // max(processes, 1) // 2**20}Mi"


def _explain(report: PlanReport) -> list[str]:
    run = report.runs
    assert run is not None
    world = report.spec.world_size
    used, budget = run.estimate.gpu_bytes / GiB, run.budget / GiB
    cpu = report.spec.hardware.vendor == "cpu"
    where = f"this machine's memory, {report.gpu_bytes / GiB:.1f} GiB a process" if cpu else report.gpu_label
    lines = [
        f"`jobspec plan` on {where}: tier {run.tier} fits at micro-batch {run.micro_batch} x "
        f"{run.grad_accum} accumulation x {world} rank(s) = global batch {report.spec.training.global_batch},",
        f"{used:.1f} of {budget:.1f} GiB a {'process' if cpu else 'GPU'} (the budget is "
        f"{report.spec.memory.target_utilization:.0%} of it).",
    ]
    order = [p.tier for p in report.plans]
    faster = [p.tier for p in report.plans if p.useful and not p.fits and order.index(p.tier) < order.index(run.tier)]
    if faster:
        lines.append(f"Faster tiers do not fit: {', '.join(faster)}. On an OOM the runner steps down from here.")
    else:
        lines.append("It is the fastest tier that fits; on an OOM the runner shrinks the micro-batch or steps down.")
    if run.note:
        lines.append(run.note)
    return lines


def _fits(text: str) -> PlanReport | None:
    try:
        report = _plan(text)
    except ConfigError:
        return None
    return report if report.runs is not None else None


def init_spec(req: Request) -> str:
    """The commented spec; ConfigError (exit 2) with the smallest change that fits when nothing does."""
    count_text = req.gpus.partition(":")[2] or "1"
    cpu = req.gpus.partition(":")[0].lower() == "cpu"
    if not count_text.isdigit() or not (cpu or gpu_catalogue.lookup(req.gpus.partition(":")[0])):
        names = ", ".join(gpu_catalogue.known_names())
        raise ConfigError(f"--gpus {req.gpus}: expected TYPE:COUNT of a known GPU type ({names}), e.g. A100-80GB:2, "
                          "or cpu:N (N processes on this machine)")  # fmt: skip
    gpu_type, count = ("cpu" if cpu else req.gpus.partition(":")[0]), int(count_text)
    name = req.name or _name(req.model, req.objective)
    if req.quantize and not req.lora:
        raise ConfigError(f"--quantize {req.quantize}: quantizes the frozen base LoRA trains on: add --lora")
    positions = _model_lines(req.model, req.config)[2]  # a longer sequence than the model takes is capped, and said
    first_seq = min(req.max_seq_len, positions or req.max_seq_len)

    def build(seq: int = first_seq, lora: bool = req.lora, n: int = count, nodes: int = req.nodes) -> str:
        return _text(req, name, seq, lora, f"{gpu_type}:{n}", nodes, "auto", [])

    spec = parse_spec(build(), "<init>")  # a bad value of the request fails here, named by the loader
    try:
        report: PlanReport | None = plan_spec(spec, host_share(count) if cpu else None, rows=1000)
    except ConfigError as err:  # the model fits no GPU of the catalogue at any tier (capacity.check)
        report, why = None, str(err)
    if report is not None and report.runs is not None:
        return _text(req, name, first_seq, req.lora, f"{gpu_type}:{count}", req.nodes, report.runs.tier,
                     _explain(report))  # fmt: skip
    if report is not None:
        smallest = min(report.plans, key=lambda p: p.estimate.gpu_bytes)
        why = (
            f"the smallest tier, {smallest.tier}, needs {smallest.estimate.gpu_bytes / GiB:.1f} GiB a GPU at "
            f"micro-batch 1 against a budget of {smallest.budget / GiB:.1f} GiB"
        )
    where = f"{gpu_type}:{count}" + (f" x {req.nodes} nodes" if req.nodes > 1 else "")
    head = f"{req.model} ({req.objective}) does not fit {where}: {why}"
    raise ConfigError(_refusal(req, head, build, gpu_type, count, first_seq))


def _refusal(req: Request, head: str, build, gpu_type: str, count: int, seq: int) -> str:  # type: ignore[no-untyped-def]
    """Nothing fits: the changes that would, smallest first (more GPUs of the same type, LoRA, a shorter sequence)."""
    fixes: list[str] = []
    n = count
    while n < MAX_GPUS_PER_NODE and not fixes:
        n = min(n * 2, MAX_GPUS_PER_NODE)
        if _fits(build(n=n)):
            fixes.append(f"--gpus {gpu_type}:{n} (sharded tiers divide the model's states by the rank count)")
    nodes = req.nodes
    while not fixes and count == MAX_GPUS_PER_NODE and nodes < 8:
        nodes *= 2
        if _fits(build(nodes=nodes)):
            fixes.append(f"--nodes {nodes}")
    if not req.lora and _fits(build(lora=True)):
        fixes.append("--lora (train rank-16 adapters: the base's gradients and optimizer states go away)")
    while seq > 256:
        seq //= 2
        if _fits(build(seq=seq)):
            fixes.append(f"--max-seq-len {seq} (activations shrink with the sequence)")
            break
    if not fixes:
        return head + "; no single change found (more GPUs, LoRA, a shorter sequence) fits: `jobspec plan --gpus any`"
    return (
        head + ". The smallest change that fits: " + fixes[0] + ("; or " + "; or ".join(fixes[1:]) if fixes[1:] else "")
    )


def _name(model: str, objective: str) -> str:
    """A DNS label from the model's last path part and the objective: Qwen/Qwen2.5-0.5B -> qwen2-5-0-5b-sft."""
    base = Path(model.rstrip("/")).name.lower()
    cleaned = "".join(c if c.isalnum() else "-" for c in base).strip("-")[:40].strip("-")
    return f"{cleaned or 'job'}-{objective}"
