"""The per-family and per-objective examples, written by `jobspec init`: `python tests/examples_gen.py` writes
examples/families/*.yaml and examples/objectives/*.yaml again (commit what changed; the plan's comments follow the
memory model).

Each hub model's config.json is its entry in bench/families.json (the keys of the hub's file at the published shape,
the same file the family benchmark reads), handed to `jobspec init --config`, as a user without network would hand
the downloaded file. The hardware of each is one that `jobspec plan` says fits, chosen by hand from its refusals.
The CI tests load, validate, plan and render every file (tests/test_loader.py, tests/test_render.py,
tests/test_schema.py), and tests/test_loader.py fails when a file is not what this writes now (the memory model
changed the plan in its comments: run this again).
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python tests/examples_gen.py`
    sys.path.insert(0, str(ROOT))

from jobspec.plan.starter import Request, init_spec  # noqa: E402

SCHEMA = "# yaml-language-server: $schema=../../jobspec/schema/jobspec.schema.json\n"
SFT, PREFS, TEXT = "/data/sft/chat.jsonl", "/data/prefs/pairs.jsonl", "/data/corpus/"
PROMPTS = "/data/math/prompts.jsonl"  # GRPO: {prompt, answer}

# file stem: (bench/families.json entry, hub id, GPUs, LoRA, quantize)
FAMILIES = {
    "llama-3.2-1b": ("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "A10G:1", False, None),
    "llama-3.1-8b-lora": ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "A100-80GB:1", True, None),
    "mistral-7b-qlora": ("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", "L4:1", True, "nf4"),
    "qwen2.5-7b-lora": ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "L40S:1", True, None),
    "qwen3-8b-qlora": ("qwen3-8b", "Qwen/Qwen3-8B", "L4:1", True, "nf4"),
    "qwen3-moe-30b-a3b-lora": ("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "H100:2", True, None),
    "qwen1.5-moe-a2.7b-lora": ("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", "A100-80GB:1", True, None),
    "mixtral-8x7b-lora": ("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1", "H100:8", True, None),
    "deepseek-v2-lite-lora": ("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", "A100-80GB:2", True, None),
    "olmoe-1b-7b": ("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", "H100:8", False, None),
    "gpt-oss-20b-lora": ("gpt-oss-20b", "openai/gpt-oss-20b", "H100:2", True, None),
    "llama-4-scout-lora": ("llama-4-scout", "meta-llama/Llama-4-Scout-17B-16E-Instruct", "H200:8", True, None),
    "qwen3-next-80b-a3b-lora": ("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", "H200:8", True, None),
    "gemma-2b-lora": ("gemma-2b", "google/gemma-2b", "L4:1", True, None),
    "gemma-2-2b-lora": ("gemma-2-2b", "google/gemma-2-2b-it", "L4:1", True, None),
    "gemma-3-1b": ("gemma-3-1b", "google/gemma-3-1b-it", "A100-40GB:1", False, None),
    "phi-3-mini-lora": ("phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", "A10G:1", True, None),
    "phi-4-qlora": ("phi-4", "microsoft/phi-4", "L40S:1", True, "nf4"),
    "olmo-2-7b-lora": ("olmo-2-7b", "allenai/OLMo-2-1124-7B-Instruct", "A100-80GB:1", True, None),
    "smollm3-3b": ("smollm3-3b", "HuggingFaceTB/SmolLM3-3B", "H100:4", False, None),
    "granite-3.1-8b-lora": ("granite-3.1-8b", "ibm-granite/granite-3.1-8b-instruct", "A100-80GB:1", True, None),
    "gpt2": ("gpt2-124m", "openai-community/gpt2", "T4:1", False, None),
}
# file stem: (bench/families.json entry, hub id, GPUs, LoRA, objective, data, data format)
OBJECTIVES = {
    "sft": ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "H100:8", False, "sft", SFT, None),
    "dpo": ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "A100-80GB:2", True, "dpo", PREFS, None),
    "simpo": ("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "A100-80GB:2", False, "simpo", PREFS, None),
    "orpo": ("mistral-7b", "mistralai/Mistral-7B-v0.3", "A100-80GB:1", True, "orpo", PREFS, None),
    "continued-pretraining": ("qwen3-8b", "Qwen/Qwen3-8B-Base", "H100:8", False, "sft", TEXT, "text"),
    "grpo": ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "H100:1", True, "grpo", PROMPTS, None),
}


def _text(out: Path, entry: str, req: Request, what: str) -> str:
    """`jobspec init` of `req` with the entry's config.json, as written to `out`: the schema line and a header
    saying how it was made."""
    configs = json.loads((ROOT / "bench" / "families.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(configs[entry]))
        text = init_spec(replace(req, config=str(config), file=str(out.relative_to(ROOT))))
        text = text.replace(str(config), "config.json")  # the command line a user runs next to the downloaded file
    made = (
        f"# Example ({what}): made by tests/examples_gen.py with the command below, config.json being\n"
        f'# bench/families.json\'s "{entry}" entry (the hub file\'s keys at the published shape).\n'
    )
    return SCHEMA + made + text


def examples() -> dict[Path, str]:
    """Every generated example's path and the text `jobspec init` writes for it now."""
    out: dict[Path, str] = {}
    for stem, (entry, hub, gpus, lora, quantize) in FAMILIES.items():
        req = Request(hub, gpus, SFT, lora=lora, quantize=quantize, name=stem.replace(".", "-"))
        path = ROOT / "examples" / "families" / f"{stem}.yaml"
        out[path] = _text(path, entry, req, f"the {entry} family")
    for stem, (entry, hub, gpus, lora, objective, data, fmt) in OBJECTIVES.items():
        req = Request(hub, gpus, data, objective=objective, lora=lora, data_format=fmt, name=stem)
        path = ROOT / "examples" / "objectives" / f"{stem}.yaml"
        out[path] = _text(path, entry, req, f"objective {objective}" + (f", data.format {fmt}" if fmt else ""))
    return out


def main() -> int:
    for path, text in examples().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
