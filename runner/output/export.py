"""Export: a checkpoint -> a Hugging Face model directory, or a PEFT adapter, that loads without jobspec.

    python -m runner.output.export CHECKPOINT [--out DIR] [--merge] [--base PATH] [--dtype D]   (= jobspec export)

CHECKPOINT is a `step-N` directory or a run directory (its newest complete checkpoint). Every
checkpoint carries the spec it was trained with (`spec.yaml`), so a copied directory is enough. The
model is rebuilt on the CPU from that spec (preset config, or `model.path`'s config and weights), the
checkpoint's weights are read into it with torch.distributed.checkpoint in one process (DCP reshards
on load, so zero2, zero3 and minimal checkpoints of any world size read the same way, and no GPU is
involved), then transformers and peft write the result:

    full fine-tune     config.json, generation_config.json, model*.safetensors (sharded like
                       save_pretrained), tokenizer files
    LoRA               adapter_config.json + adapter_model.safetensors (peft), tokenizer files; a
                       preset's base model (not loadable from anywhere else) is written to base/
    LoRA, --merge      merged full weights, as a full fine-tune
    always             jobspec_export.json (spec hash, step, loss, tier, source) and a short README.md

The directory is written beside its destination and renamed into place (atomic on one filesystem);
an older jobspec export there is replaced, any other existing directory is refused.

The checkpoint is not trusted: it must verify (runner/checkpoint/store.py `verify`: manifest, signature
when JOBSPEC_CHECKPOINT_KEY is set, and its pickles read without running code), its files are read as
regular files within a bound, and DCP loads through the same restricted reader as a resume. A forged,
linked or piped file is a damaged checkpoint: exit 2 naming the file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from jobspec import __version__, shared_dir
from jobspec.contract import EXIT_OK
from jobspec.errors import ConfigError, JobspecError, see
from jobspec.spec import object_store, safe_yaml
from jobspec.spec.hub import hub_origin
from jobspec.spec.loader import parse_spec
from jobspec.spec.models import JobSpec
from jobspec.untrusted import json_loads, read_bounded
from runner.checkpoint import files, store, unpickle

log = logging.getLogger("jobspec.runner")
PROVENANCE = "jobspec_export.json"
PROVENANCE_MAX_BYTES = 2**20  # a page of JSON
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve(path: str | Path) -> Path:
    """The intact checkpoint `path` names (a step dir, or a run dir's newest); ConfigError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such checkpoint directory (give a step-N directory or a run directory)")
    if store.is_step_dir(path):
        if not (path / store.DONE).is_file():
            raise ConfigError(
                f"{path}: incomplete checkpoint (no {store.DONE} marker: its writer stopped before finishing); "
                f"export an older one, e.g. {_newest_hint(path.parent)}"
            )
        ckpt = path
    else:
        ckpt = store.latest(path)
        if ckpt is None:
            done = store.DONE
            raise ConfigError(f"{path}: no complete checkpoint (step-N directory with a {done} marker) in it")
    problem = store.verify(ckpt)  # sizes and checksums against its manifest.json
    if problem is not None:
        raise ConfigError(f"{ckpt}: damaged checkpoint ({problem}); export an intact one, e.g. {_intact_hint(ckpt)}")
    return ckpt


def _newest_hint(run_dir: Path) -> str:
    newest = store.latest(run_dir)
    return str(newest) if newest else "none is complete in this run directory"


def _intact_hint(damaged: Path) -> str:
    older = [p for _, p in store.complete(damaged.parent) if p != damaged and store.verify(p) is None]
    return str(older[-1]) if older else "none in this run directory verifies"


def checkpoint_spec(ckpt: Path) -> JobSpec:
    """The spec the checkpoint was trained with (written beside its weights)."""
    spec_file = ckpt / store.SPEC
    if not os.path.lexists(spec_file):
        raise ConfigError(f"{ckpt}: no {store.SPEC} (written by an older jobspec); it cannot be exported")
    try:
        text = files.read_bytes(spec_file, safe_yaml.MAX_BYTES, "job spec").decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{spec_file}: damaged checkpoint ({err}); export an intact one") from None
    return parse_spec(text, str(spec_file))


def _with_base(spec: JobSpec, base: str | None) -> JobSpec:
    """The spec with model.path replaced by `base` (the fine-tuned model's origin moved or was copied)."""
    if base is None:
        return spec
    if spec.model.path is None:
        raise ConfigError(f"--base {base}: the checkpoint's model is the preset {spec.model.preset!r}, not a path")
    return spec.model_copy(update={"model": spec.model.model_copy(update={"path": base})})


def _precision(ckpt: Path) -> str:
    """The precision the checkpoint was trained at (a LoRA preset's frozen base was held at that width)."""
    return str((store.read_meta(ckpt).get("plan") or {}).get("precision", "fp32"))


def load_trained(spec: JobSpec, ckpt: Path) -> tuple[torch.nn.Module, Any]:
    """(model on the CPU with the checkpoint's weights, tokenizer): the training model, rebuilt and loaded."""
    from jobspec.plan.planner import model_shape
    from runner.data.tokenizer import load_tokenizer
    from runner.model.build import build_model

    tokenizer = load_tokenizer(spec.model.path, model_shape(spec).vocab)
    model = build_model(spec, bos=getattr(tokenizer, "BOS", tokenizer.eos_id), eos=tokenizer.eos_id,
                        vocab=tokenizer.vocab_size, precision=_precision(ckpt))  # fmt: skip
    lora = spec.model.lora is not None
    wanted = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad or not lora}
    state = {k: v for k, v in model.state_dict().items() if k in wanted}
    try:
        reader = unpickle.reader(ckpt)  # `.metadata` read without running code from it, and checked
    except (OSError, ValueError) as err:
        raise ConfigError(f"{ckpt}: damaged checkpoint ({err}); export an intact one") from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:  # in place into the model's tensors
            dcp.load({"model": state}, storage_reader=reader, planner=unpickle.SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as err:  # a missing key or shard (CheckpointException is a
            # BaseException that wraps the cause)
            raise ConfigError(f"{ckpt}: cannot read the model weights ({unpickle.load_failure(err)})") from None
    return model, tokenizer


def _hf_tokenizer(tokenizer: Any) -> Any:
    return tokenizer.to_hf() if hasattr(tokenizer, "to_hf") else tokenizer.tok


def _generation_ready(model: torch.nn.Module, tokenizer: Any) -> None:
    """use_cache back on (training turned it off) and the special ids generate() needs."""
    from transformers import GenerationConfig

    model.config.use_cache = True
    bos = getattr(tokenizer, "BOS", getattr(getattr(tokenizer, "tok", None), "bos_token_id", None))
    ids = {"bos_token_id": bos, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    for key, value in ids.items():
        setattr(model.config, key, value)
    gen = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
    for key, value in ids.items():
        if getattr(gen, key, None) is None:
            setattr(gen, key, value)
    model.generation_config = gen


def _cast(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    return model if dtype == "auto" else model.to(DTYPES[dtype])


def _save_kwargs(spec: JobSpec) -> dict[str, Any]:
    size = spec.output.max_shard_size
    return {"max_shard_size": size} if size else {}


def _set_json(path: Path, **values: Any) -> None:
    """`values` set in the JSON file `path` of the export being written (read bounded, written whole: never through a
    link, jobspec.shared_dir)."""
    record = json_loads(read_bounded(path, 64 << 20, what="export file", follow=False))
    shared_dir.write_atomic(path, (json.dumps({**record, **values}, indent=2) + "\n").encode(), fsync=False)


def as_trained(model: torch.nn.Module, plan: dict[str, Any]) -> None:
    """The base the adapters trained on, for a merge: a run whose plan held it in 4 bits (`model.quantize`) saw the
    dequantized NF4 weights, not the 16-bit ones, so the base goes through the same quantization (the same blocks
    over the same ranks) and back before the adapters are merged in. The adapter export keeps the 16-bit base."""
    from runner.model.quantize import round_trip

    if plan.get("quantize"):
        round_trip(model, str(plan["quantize"]), shards=int(plan.get("world_size") or 1),
                   dtype=DTYPES.get(str(plan.get("precision"))))  # fmt: skip


def _base_spec(spec: JobSpec) -> JobSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(update={"lora": None})})


def write_export(spec: JobSpec, ckpt: Path, out: Path, *, final: Path, merge: bool, dtype: str) -> dict[str, Any]:
    """Write the export of `ckpt` into the empty directory `out` (renamed to `final` later); returns provenance."""
    from transformers.utils import logging as hf_logging

    from runner.model.build import build_model, frozen_base_width

    hf_logging.disable_progress_bar()  # "Writing model shards" bars are noise in pod logs
    meta = store.read_meta(ckpt)
    model, tokenizer = load_trained(spec, ckpt)
    hf_tokenizer = _hf_tokenizer(tokenizer)
    kind = "full" if spec.model.lora is None else "merged" if merge else "adapter"
    if kind == "merged":
        as_trained(model, meta.get("plan") or {})
        model = model.merge_and_unload()
    if kind == "adapter":
        cfg = model.peft_config["default"]
        origin = hub_origin(spec.model.path)  # a hub model trained from its snapshot in the pod's cache: the adapter
        cfg.base_model_name_or_path = origin[0] if origin else spec.model.path  # names the hub id, loadable anywhere
        if origin:
            cfg.revision = origin[1]  # the commit trained on
        if spec.model.preset:  # the base exists nowhere else (built from config and seed): ship it beside the adapter
            base = build_model(_base_spec(spec), bos=getattr(tokenizer, "BOS", tokenizer.eos_id),
                               eos=tokenizer.eos_id, vocab=tokenizer.vocab_size)  # fmt: skip
            frozen_base_width(base, _precision(ckpt))  # as build_model held it in training
            _generation_ready(base, tokenizer)
            _cast(base, dtype).save_pretrained(out / "base", **_save_kwargs(spec))
            hf_tokenizer.save_pretrained(out / "base")
            cfg.base_model_name_or_path = str(out.resolve() / "base")  # peft reads the base's config here
        model.save_pretrained(out)
        if spec.model.preset:  # where the base will be once `out` is renamed into place
            _set_json(out / "adapter_config.json", base_model_name_or_path=str(final.resolve() / "base"))
        weights = model.get_base_model()
    else:
        _generation_ready(model, tokenizer)
        _cast(model, dtype).save_pretrained(out, **_save_kwargs(spec))
        weights = model
    hf_tokenizer.save_pretrained(out)
    formats = {"full": "transformers", "merged": "transformers (LoRA merged)", "adapter": "peft LoRA adapter"}
    record = {
        "format": formats[kind],
        "jobspec_version": __version__,
        "job": spec.name,
        "spec_hash": meta.get("spec_hash"),
        "step": meta.get("step"),
        "total_steps": meta.get("total_steps"),
        "loss": meta.get("loss"),
        "eval_loss": meta.get("eval_loss"),
        "tier": (meta.get("plan") or {}).get("tier"),
        "world_size": meta.get("world_size"),
        "source": str(ckpt.resolve()),
        "model": spec.model.preset or spec.model.path,
        "tokenizer": getattr(tokenizer, "name", None),
        "dtype": dtype if dtype != "auto" else str(next(weights.parameters()).dtype).removeprefix("torch."),
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    shared_dir.write_atomic(out / PROVENANCE, (json.dumps(record, indent=1) + "\n").encode(), fsync=False)
    shared_dir.write_atomic(out / "README.md", _card(record, kind).encode(), fsync=False)
    return record


def _card(record: dict[str, Any], kind: str) -> str:
    if kind == "adapter":
        load = (
            "from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
            'model = AutoPeftModelForCausalLM.from_pretrained("THIS_DIR")\n'
            'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")\n'
        )
    else:
        load = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'model = AutoModelForCausalLM.from_pretrained("THIS_DIR")\n'
            'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")\n'
        )
    return (
        f"# {record['job']} (step {record['step']} of {record['total_steps']})\n\n"
        f"Fine-tuned by jobspec {record['jobspec_version']} from `{record['model']}` ({record['format']}); "
        f"final train loss {record['loss']}, tier {record['tier']}. Provenance: `{PROVENANCE}`.\n\n"
        f"```python\n{load}```\n\n"
        "Chat prompts: `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`.\n"
    )


def is_export(path: Path) -> bool:
    return (path / PROVENANCE).is_file()


def read_provenance(path: Path) -> dict[str, Any] | None:
    """The provenance of the export at `path`, or None (no export there, or unreadable)."""
    try:
        record = files.read_json(path / PROVENANCE, PROVENANCE_MAX_BYTES, "provenance file")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def default_out(spec: JobSpec) -> Path:
    return Path(spec.export_dir)


def export(
    ckpt: str | Path,
    out: str | Path | None = None,
    *,
    merge: bool | None = None,
    base: str | None = None,
    dtype: str | None = None,
    spec: JobSpec | None = None,
) -> Path:
    """Export a checkpoint (see the module docstring); returns the directory written. `ckpt` may be an object-store
    URL (s3://bucket/prefix[/step-N]): its newest intact step (or step N) is downloaded and verified first
    (runner/checkpoint/remote.py), into a temporary directory removed afterwards."""
    if object_store.is_url(str(ckpt)):
        from runner.checkpoint import remote

        fetched = Path(tempfile.mkdtemp(prefix="jobspec-export-"))
        try:
            source = remote.export_source(str(ckpt), fetched)
            if out is None and not (spec or checkpoint_spec(source)).output.dir:
                raise ConfigError(f"{ckpt}: give --out DIR (the checkpoint's spec names no local output.dir)")
            return export(source, out, merge=merge, base=base, dtype=dtype, spec=spec)
        finally:
            shutil.rmtree(fetched, ignore_errors=True)
    t0 = time.perf_counter()
    ckpt = resolve(ckpt)
    spec = _with_base(spec or checkpoint_spec(ckpt), base)
    merge = spec.output.merge_lora if merge is None else merge
    if merge and spec.model.lora is None:
        raise ConfigError("--merge: this checkpoint is a full fine-tune (no model.lora); there is nothing to merge")
    out = Path(out) if out is not None else default_out(spec)
    if out.exists() and not (out.is_dir() and (is_export(out) or not any(out.iterdir()))):
        raise ConfigError(
            f"{out}: exists and is not a jobspec export; choose another --out (or output.dir) or remove it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".tmp-{out.name}-*"):  # left by an export that was killed (a link: not followed)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = shared_dir.make_temp_dir(out.parent, f".tmp-{out.name}-")  # a fresh name: nothing planted in it
    try:
        record = write_export(spec, ckpt, tmp, final=out, merge=merge, dtype=dtype or spec.output.dtype)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s (step %s, %s) to %s in %.1f s", ckpt, record["step"], record["format"], out,
             time.perf_counter() - t0)  # fmt: skip
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; a previous export at `out` is moved aside first and removed after."""
    old = out.parent / f".old-{shared_dir.temp_name(out.name)}"  # a fresh name: a rename never lands on a link
    if os.path.lexists(out):
        os.rename(out, old)
    os.rename(tmp, out)
    store.fsync_dir(out.parent)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    elif os.path.lexists(old):
        old.unlink()


def main(argv: list[str] | None = None) -> int:
    from jobspec.cli import add_export_args

    parser = argparse.ArgumentParser(prog="jobspec export", description=__doc__.splitlines()[0])
    add_export_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        out = export(args.checkpoint, args.out, merge=args.merge or None, base=args.base, dtype=args.dtype)
    except JobspecError as err:
        print(f"error: {err}", file=sys.stderr)
        print(see(err), file=sys.stderr)  # as the CLI's errors end
        return err.exit_code
    print(out)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
