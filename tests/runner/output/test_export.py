"""Export: a trained run becomes a Hugging Face directory (or a PEFT adapter) that loads without jobspec.

Real runs of the tiny preset; the exported directories are loaded by transformers and peft alone, in a
fresh interpreter that never imports jobspec, and their logits are compared with the trained model's.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from runner.data.dataset import BUNDLED, flatten
from runner.data.tokenizer import ByteTokenizer
from runner.output import export
from tests.runner.train_helpers import (
    CHAT,
    ROOT,
    run_supervisor,
    save_test_tokenizer,
    timeout_s,
    tiny_spec,
    tiny_spec_dict,
    train_in_process,
    write_jsonl,
    write_spec,
)

PROMPT = torch.tensor([[257, 260, *b"What is 2 + 3?", 261]])  # <bos> <user> ... <assistant>


def trained_logits(worker, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    model = worker.accelerator.unwrap_model(worker.model)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def load_adapter_outside(run, tmp_path, *, auto: bool = False) -> tuple[dict, list[torch.Tensor]]:
    """The run's adapter on its base (peft's PeftModel; with `auto` AutoPeftModelForCausalLM too) and its merged export,
    loaded outside jobspec: (their JSON: the base's parameter types and dtype, whether the merged model holds LoRA
    keys; the fp32 logits of PROMPT by the adapted, the merged and the auto-loaded model)."""
    adapter = run / "model"
    merged = export.export(run, tmp_path / "merged", merge=True)
    torch.save(PROMPT, tmp_path / "prompt.pt")
    auto_line = f"b = AutoPeftModelForCausalLM.from_pretrained({str(adapter)!r}).eval()" if auto else "b = None"
    got = load_outside(
        f"""
        from peft import AutoPeftModelForCausalLM, PeftModel
        from transformers import AutoModelForCausalLM
        x = torch.load("prompt.pt")
        base = AutoModelForCausalLM.from_pretrained({str(adapter / "base")!r})
        plain = {{type(p).__name__ for p in base.parameters()}}
        dtype = str(next(base.parameters()).dtype)
        a = PeftModel.from_pretrained(base, {str(adapter)!r}).eval()
        {auto_line}
        m = AutoModelForCausalLM.from_pretrained({str(merged)!r}).eval()
        with torch.no_grad():
            torch.save([n(input_ids=x).logits for n in (a, m, b) if n is not None], "out.pt")
        print(json.dumps({{"types": sorted(plain), "dtype": dtype,
                           "merged_has_lora": any("lora" in k for k in m.state_dict())}}))
        """,
        tmp_path,
    )
    return got, [t.float() for t in torch.load(tmp_path / "out.pt")]


def load_outside(script: str, tmp_path) -> dict:
    """Run `script` in a fresh interpreter outside the repository; returns its JSON. Fails if jobspec got imported."""
    prelude = textwrap.dedent(
        """
        import json, sys
        import torch
        """
    )
    epilogue = "\nassert not any(m.split('.')[0] in ('jobspec', 'runner') for m in sys.modules), 'jobspec imported'\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script) + epilogue],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout_s(),
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    code, worker = train_in_process(tiny_spec(run, training={"steps": 8}))
    assert code == EXIT_OK
    return run, trained_logits(worker)


def test_a_finished_run_exports_a_transformers_model_that_loads_without_jobspec(full_run, tmp_path):
    run, logits = full_run
    out = run / "model"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"} <= names
    prov = json.loads((out / export.PROVENANCE).read_text())
    assert prov["step"] == 8 and prov["tier"] == "fast" and prov["format"] == "transformers" and prov["spec_hash"]
    assert prov["loss"] is not None
    torch.save(PROMPT, tmp_path / "prompt.pt")
    got = load_outside(
        f"""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(out)!r})
        tok = AutoTokenizer.from_pretrained({str(out)!r})
        ids = tok.apply_chat_template([{{"role": "user", "content": "What is 2 + 3?"}}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits
        torch.save(logits, "logits.pt")
        gen = model.generate(x, max_new_tokens=5, do_sample=False)
        print(json.dumps({{"ids": ids, "new": gen.shape[1] - x.shape[1], "text": tok.decode(gen[0][len(ids):])}}))
        """,
        tmp_path,
    )
    assert got["ids"] == PROMPT[0].tolist()  # the exported tokenizer's chat template = the training tokenizer's
    assert 1 <= got["new"] <= 5 and isinstance(got["text"], str)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), logits, rtol=1e-4, atol=1e-4)


def test_a_copied_checkpoint_exports_on_its_own_and_replaces_an_older_export(full_run, tmp_path):
    run, _ = full_run
    copy = tmp_path / "elsewhere" / "step-8"
    shutil.copytree(run / "step-8", copy)
    out = export.export(copy.parent, tmp_path / "out")  # a run dir: its newest complete checkpoint
    first = (out / "model.safetensors").read_bytes()
    assert export.export(copy, tmp_path / "out") == out  # again over the old export: replaced atomically
    assert (out / "model.safetensors").read_bytes() == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_large_weights_are_sharded_like_save_pretrained(full_run, tmp_path):
    run, _ = full_run
    spec = export.checkpoint_spec(run / "step-8")
    spec = spec.model_copy(update={"output": spec.output.model_copy(update={"max_shard_size": 400_000})})
    out = export.export(run / "step-8", tmp_path / "sharded", spec=spec)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(out).state_dict()
    b = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_exports_exit_2_with_the_reason(full_run, tmp_path, capsys):
    run, _ = full_run
    broken = tmp_path / "run" / "step-8"
    shutil.copytree(run / "step-8", broken)
    (broken / "DONE").unlink()
    assert export.main([str(broken), "--out", str(tmp_path / "o")]) == EXIT_CONFIG
    assert "incomplete checkpoint" in capsys.readouterr().err
    assert export.main([str(tmp_path / "nope")]) == EXIT_CONFIG
    assert "no such checkpoint directory" in capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert export.main([str(run / "step-8"), "--out", str(mine)]) == EXIT_CONFIG
    assert "is not a jobspec export" in capsys.readouterr().err and (mine / "notes.txt").is_file()
    assert export.main([str(run / "step-8"), "--out", str(tmp_path / "m"), "--merge"]) == EXIT_CONFIG
    assert "nothing to merge" in capsys.readouterr().err
    shutil.rmtree(broken)
    shutil.copytree(run / "step-8", broken)
    next(broken.glob("*.distcp")).write_bytes(b"")  # a truncated shard
    assert export.main([str(broken), "--out", str(tmp_path / "t")]) == EXIT_CONFIG
    assert "damaged checkpoint (__0_0.distcp has 0 bytes" in capsys.readouterr().err  # checkpoint.verify


def test_jobspec_export_is_a_cli_command_and_exits_2_on_bad_input(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jobspec.cli", "export", str(tmp_path / "missing")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s(),
    )
    assert result.returncode == EXIT_CONFIG and "no such checkpoint directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: the preset's frozen base is held in bf16
def test_lora_exports_a_peft_adapter_and_merge_matches_it(tmp_path, precision):
    run = tmp_path / "run"
    lora = {"rank": 4, "targets": ["c_attn", "mlp.c_proj"]}
    training = {"steps": 6, "learning_rate": 1e-2, "precision": precision}
    code, worker = train_in_process(tiny_spec(run, model={"lora": lora}, training=training))
    assert code == EXIT_OK
    logits = trained_logits(worker)
    adapter = run / "model"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert (adapter / "base" / "config.json").is_file()  # a preset's base ships with the adapter
    got, (peft_logits, merged_logits, auto_logits) = load_adapter_outside(run, tmp_path, auto=True)
    assert not got["merged_has_lora"]
    tol = {"rtol": 1e-4, "atol": 1e-4} if precision == "fp32" else {"rtol": 0.05, "atol": 0.05}  # bf16 rounding
    torch.testing.assert_close(peft_logits, logits, **tol)
    torch.testing.assert_close(auto_logits, logits, **tol)
    torch.testing.assert_close(merged_logits, logits, **tol)


def test_a_local_model_exports_with_its_own_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    base = tmp_path / "base"
    save_test_tokenizer(base)
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=128, n_embd=32, n_layer=1, n_head=2)).save_pretrained(base)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 32)
    run = tmp_path / "run"
    spec = tiny_spec(run, model={"preset": None, "path": str(base)}, data={"path": str(data)}, training={"steps": 4})
    code, worker = train_in_process(spec)
    assert code == EXIT_OK
    tok = AutoTokenizer.from_pretrained(run / "model")
    assert tok.chat_template and tok.eos_token == "<|end|>"
    x = torch.tensor([tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_dict=True)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(run / "model").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, trained_logits(worker, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tier", ["zero3", *(pytest.param(t, marks=pytest.mark.sweep) for t in ("zero2", "minimal"))])
def test_a_sharded_checkpoint_of_two_ranks_exports_the_weights_it_holds(tmp_path, tier):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = tmp_path / "run"
    spec = tiny_spec_dict(run, memory={"tier": tier}, training={"micro_batch": 2, "steps": 3})
    result = run_supervisor([str(write_spec(tmp_path / "s.yaml", spec)), "--nproc", "2"])
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert json.loads((run / "model" / export.PROVENANCE).read_text())["tier"] == tier
    dcp_to_torch_save(run / "step-3", tmp_path / "full.pt")  # DCP's own consolidation, independent of the export
    held = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    written = load_file(run / "model" / "model.safetensors")
    assert written.keys() <= held.keys() and len(written) >= len(held) - 1  # a tied head is written once
    for k, v in written.items():
        assert torch.equal(v, held[k]), k


def test_the_exported_tokenizer_matches_the_training_tokenizer_on_the_bundled_set():
    bt, hf = ByteTokenizer(), ByteTokenizer().to_hf()
    for line in BUNDLED.read_text().splitlines()[:200]:
        record = json.loads(line)
        chat = record.get("messages") or [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
        ids = hf.apply_chat_template(chat, return_dict=True)["input_ids"]
        assert ids == flatten(bt.render(chat), 10**6)[0].tolist()


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_the_exported_tokenizer_round_trips_any_text_to_the_same_bytes(text):
    hf = exported_byte_tokenizer()
    ids = hf.encode(text, add_special_tokens=False)
    if "<|" not in text:  # text that spells a special token is that token in the export (documented)
        assert ids == list(text.encode("utf-8"))
    assert hf.decode(ids) == text


@functools.cache
def exported_byte_tokenizer():
    return ByteTokenizer().to_hf()
