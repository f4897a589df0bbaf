"""The startup check of packing (runner/model/packing.py): packing stays on only where the model confines attention
to each record, and otherwise goes off for the run with a log line saying why."""

from __future__ import annotations

import contextlib
import logging
from unittest import mock

import pytest
import torch

from jobspec.catalog.presets import PRESETS
from runner.model.build import preset_config
from runner.model.packing import check_packing, confine_packing, packed_inputs, small_config
from tests.runner.train_helpers import tiny_spec, train_in_process

CPU = torch.device("cpu")


def _positionless(module, query, key, value, attention_mask, **kwargs):
    """An attention kernel that ignores the mask transformers built from the position ids (plain causal)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


@pytest.fixture(scope="module")
def positionless() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register("positionless_test", _positionless)
    return "positionless_test"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "qwen-0.5b", "llama-1b"])
def test_the_check_passes_where_transformers_confines_packed_records(preset, attention):
    result = check_packing(preset_config(PRESETS[preset], bos=0, eos=1), attention, CPU)
    assert result.problem is None, result
    assert result.leak < 1e-4 < 1 < result.unconfined  # a clear verdict either way


def test_the_small_model_keeps_the_architecture():
    big = preset_config(PRESETS["llama-1b"], bos=0, eos=1)
    small = small_config(big)
    assert small.model_type == big.model_type and small.num_hidden_layers == 2 and small.hidden_size == 64
    ratio = big.num_attention_heads // big.num_key_value_heads
    assert small.num_attention_heads // small.num_key_value_heads == min(ratio, 4)
    assert big.num_hidden_layers == PRESETS["llama-1b"].layers  # the real config is left as it was


def test_a_kernel_that_ignores_position_ids_fails_the_check(positionless):
    result = check_packing(preset_config(PRESETS["llama-tiny"], bos=0, eos=1), positionless, CPU)
    assert result.problem is not None and "does not confine attention" in result.problem
    assert result.leak > 1


@contextlib.contextmanager
def ignored_positions():
    """A transformers whose attention ignores packed position ids: its search finds no packed sequences, and the
    runner has no search to answer (runner/internals/states.py `packed_search` finds none, as on transformers 4.x)."""
    from runner.internals import states

    with mock.patch("transformers.masking_utils.find_packed_sequence_indices", return_value=None), \
            mock.patch.object(states, "_masking_utils", lambda: None):  # fmt: skip
        yield


def test_packing_goes_off_with_the_reason_where_the_check_fails(tmp_path, caplog):
    """transformers before packed-sequence detection (or a model that ignores position ids): no per-record masks."""
    spec = tiny_spec(tmp_path / "run", data={"packing": True})
    with ignored_positions(), caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        off = confine_packing(spec, CPU)
    assert spec.data.packing and not off.data.packing
    assert off.model_copy(update={"data": spec.data}) == spec  # nothing else changed
    assert any("data.packing turned off" in r.getMessage() and "does not confine" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert confine_packing(spec, CPU) is spec  # where it holds, the spec is kept as it is


def test_another_ranks_failure_turns_packing_off_here_too(tmp_path):
    spec = tiny_spec(tmp_path / "run", data={"packing": True})
    assert not confine_packing(spec, CPU, any_rank=lambda failed: True).data.packing


def test_a_check_that_cannot_run_turns_packing_off(tmp_path, caplog):
    spec = tiny_spec(tmp_path / "run", data={"packing": True})
    broken = mock.patch("runner.model.packing.small_config", side_effect=ValueError("no such layer kind"))
    with broken, caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        assert not confine_packing(spec, CPU).data.packing
    assert "could not run (ValueError: no such layer kind)" in caplog.text


def test_unpacked_specs_skip_the_check(tmp_path):
    spec = tiny_spec(tmp_path / "run")
    with mock.patch("runner.model.packing.check_packing") as check:
        assert confine_packing(spec, CPU) is spec
    check.assert_not_called()


def test_a_run_where_packing_fails_trains_one_record_a_row(tmp_path, caplog):
    spec = tiny_spec(tmp_path / "run", data={"packing": True}, training={"steps": 2, "warmup_steps": 1})
    with ignored_positions(), caplog.at_level(logging.INFO, logger="jobspec.runner"):
        code, worker = train_in_process(spec)
    assert code == 0 and not worker.spec.data.packing
    assert worker.data.collate(worker.step_ids(0)).position_ids is None  # rows of one record, numbered by the model
    assert "data.packing turned off for this run" in caplog.text


def test_flash_kernels_get_the_batch_as_one_row():
    """flash-attention's varlen path needs a batch of one row: packed batches are flattened for it, not for sdpa."""
    x = torch.arange(12).view(2, 6)
    y, p = x + 100, torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    for kernel, shape in (("sdpa", (2, 6)), ("flash_attention_2", (1, 12))):
        model = mock.Mock(spec=["config"], config=mock.Mock(_attn_implementation=kernel))
        xs, ys, ps = packed_inputs(model, x, y, p)
        assert xs.shape == ys.shape == ps.shape == shape
        assert ps.flatten().tolist() == p.flatten().tolist() and ys.flatten().tolist() == y.flatten().tolist()


@pytest.mark.parametrize("name", ["llama-4-scout", "gemma-3-4b", "qwen3-8b", "mixtral-8x7b", "deepseek-v3",
                                  "deepseek-v2-lite", "glm-4.5", "gpt-oss-20b", "gemma-2-2b", "phi-4", "olmo-2-7b"])
def test_the_check_runs_on_published_configs_whatever_their_token_ids(name):
    """The small model is built from the published config.json (vocabularies of 150-260 k tokens, special ids such as
    Llama 4's pad 200018 beyond the small one's 128 rows; DeepSeek's latent attention widths): the check runs and
    passes. It used to fail to build, which turned packing off for every Llama 4 and DeepSeek-V3 run."""
    from transformers import AutoConfig

    from bench.families import CONFIGS, attention
    from runner.model.build import text_part

    config = text_part(AutoConfig.for_model(**CONFIGS[name]))
    result = check_packing(config, attention(name), torch.device("cpu"))  # the family's kernel (gpt-oss: eager)
    # Where transformers lets packed records see each other, the check finds it (a leak as large as no confinement at
    # all) and packing goes off with the reason: gpt-oss (eager, with its sinks) in 5.24; Llama 4 (chunked attention)
    # in 4.56, the floor
    import transformers

    leaks = {"gpt-oss-20b"} | ({"llama-4-scout"} if int(transformers.__version__.split(".")[0]) < 5 else set())
    if name in leaks:
        assert result.problem is None or "does not confine" in result.problem, result
    else:
        assert result.problem is None, result


def test_linear_attention_carries_its_state_across_packed_records_so_packing_goes_off():
    """Qwen3-Next's Gated DeltaNet layers run a recurrence along the row, which transformers' PyTorch delta rule does
    not restart at a record's first position: packed records would read each other. The check finds it (on a 2-layer
    model of the published shape's head ratio) and says why."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from bench.families import tiny

    if "qwen3_next" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no Qwen3-Next (4.57 added it; the floors leg runs 4.56)")
    config = AutoConfig.for_model(**tiny("qwen3-next-80b-a3b"))
    small = small_config(config)
    assert small.layer_types == ["linear_attention", "full_attention"]
    assert small.linear_num_value_heads == 2 * small.linear_num_key_heads  # the published 32 of 16
    result = check_packing(config, "sdpa", CPU)
    assert result.leak > 1 and result.problem is not None and "linear-attention layers carry" in result.problem
