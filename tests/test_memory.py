"""Memory model tests. Expected figures are worked out by hand here (arithmetic as literals), never by
calling the code under test. Units: bytes; GiB = 2**30; sequence length 1024, micro-batch 1 unless named."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobspec.catalog.presets import PRESETS
from jobspec.catalog.tiers import TIERS, divisors, next_tier
from jobspec.errors import ConfigError
from jobspec.plan.memory import (
    LoraShape,
    estimate,
    pick_tier,
    plan_all,
    plan_tier,
    trainable_params,
)

GiB = 1024**3
GPT2 = PRESETS["gpt2-small"]
QWEN18 = PRESETS["qwen-1.8b"]
QWEN05 = PRESETS["qwen-0.5b"]
P_GPT2 = 124_439_808
P_QWEN18 = 1_836_681_216


def test_parameter_counts_used_below() -> None:
    assert GPT2.params == P_GPT2
    assert QWEN18.params == P_QWEN18
    # qwen-0.5b: embed 151936*896 = 136,134,656 (tied) + 24 blocks * 14,911,232 + final norm 896
    assert QWEN05.params == 136_134_656 + 24 * 14_911_232 + 896 == 494_005_120


def test_next_tier_walks_the_ladder_and_stops() -> None:
    assert TIERS == ("fast", "zero2", "zero2_offload", "zero3", "minimal")
    assert [next_tier(t) for t in TIERS] == ["zero2", "zero2_offload", "zero3", "minimal", None]
    with pytest.raises(ConfigError, match="unknown memory tier 'zero4'"):
        next_tier("zero4")


def test_divisors() -> None:
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]  # square: 6 once
    assert divisors(13) == [1, 13]
    with pytest.raises(ValueError, match="n >= 1"):
        divisors(0)


# gpt2-small, seq 1024, mbs 1 (h=768, i=3072, L=12, V=50257, tied; largest module = wte 50257*768 = 38,597,376):
#   activations, fp32 residual (fast)   12 layers * (20*768 + 16*3072) * 1024 tokens   = 792,723,456
#                                       (autocast runs GELU's pow in fp32, as on a GPU)
#   activations, 16-bit residual        12 * (16*768 + 10*3072) * 1024                 = 528,482,304
#   checkpointed: each layer's input    12 * 2 * 1024 * 768                             =  18,874,368
#   loss: one chunk of 268,435,456 // (4*50257) = 1335 tokens, here all 1024: 1024*50257*4*1.5 = 308,779,008;
#         per token after the last block 10*768 + 16 (fp32 residual) or 6*768 + 16 (16-bit); at `fast` also the
#         output layer's fp32 gradient, which the fused loss accumulates in forward, and its bf16 copy:
#         50257*768*(4 + 2) = 231,584,256
#   gathered (zero3, minimal)           2*38,597,376 weights + 2*38,597,376 gradient       = 154,389,504
#                                       (the tied embedding lives in FSDP2's root unit: no second gather buffer;
#                                       the step peaks forward at the loss); over 8 ranks also the last block's
#                                       all-gather buffer, prefetched for backward: + 2*7,087,872 = 168,565,248
#   zero2 tiers: every weight gathered in bf16 (2P) + the largest module's bf16 gradient  2P + 77,194,752
#   overhead                            1 GiB + 5 % of everything else, integer division
GPT2_ACT, GPT2_ACT16, GPT2_CKPT, GPT2_GATHER = 792_723_456, 528_482_304, 18_874_368, 154_389_504
GPT2_GATHER8 = GPT2_GATHER + 2 * 7_087_872  # a block: 4*768*768 + 2*768*3072 + 9*768 + 3072
GPT2_LOSS = 308_779_008 + 1024 * (10 * 768 + 16) + 231_584_256  # 548,243,968
GPT2_LOSS16 = 308_779_008 + 1024 * (6 * 768 + 16)  # 313,513,984
P = P_GPT2
Z2W = 2 * P + 77_194_752  # zero2 tiers' working weights
# (tier, ranks, weights, gradients, optimizer, buckets, working weights, activations, loss, host)
GPT2_TABLE = [
    ("fast", 1, 4 * P, 4 * P, 8 * P, 0, 2 * P, GPT2_ACT, GPT2_LOSS, 0),  # autocast's bf16 copies: 2P
    ("zero2", 1, 4 * P, 4 * P, 8 * P, 0, Z2W, GPT2_ACT16, GPT2_LOSS16, 0),  # FSDP2 keeps the bf16 gather
    ("zero2_offload", 1, 4 * P, 4 * P, 0, 0, Z2W, GPT2_CKPT, GPT2_LOSS16, 16 * P),
    ("zero3", 1, 4 * P, 4 * P, 8 * P, 0, GPT2_GATHER, GPT2_CKPT, GPT2_LOSS16, 0),
    ("minimal", 1, 0, 0, 0, 0, GPT2_GATHER, GPT2_CKPT, GPT2_LOSS16, 16 * P),
    ("fast", 8, 4 * P, 4 * P, 8 * P, 4 * P, 2 * P, GPT2_ACT, GPT2_LOSS, 0),  # DDP's fp32 buckets: 4P
    ("zero2", 8, 4 * P // 8, 4 * P // 8, 8 * P // 8, 0, Z2W, GPT2_ACT16, GPT2_LOSS16, 0),
    ("zero2_offload", 8, 4 * P // 8, 4 * P // 8, 0, 0, Z2W, GPT2_CKPT, GPT2_LOSS16, 16 * P // 8),
    ("zero3", 8, 4 * P // 8, 4 * P // 8, 8 * P // 8, 0, GPT2_GATHER8, GPT2_CKPT, GPT2_LOSS16, 0),
    ("minimal", 8, 0, 0, 0, 0, GPT2_GATHER8, GPT2_CKPT, GPT2_LOSS16, 16 * P // 8),
]


@pytest.mark.parametrize(("tier", "ranks", "weights", "grads", "adam", "buckets", "working", "acts", "loss", "host"),
                         GPT2_TABLE)  # fmt: skip
def test_gpt2_small_per_tier(
    tier: str, ranks: int, weights: int, grads: int, adam: int, buckets: int, working: int, acts: int, loss: int,
    host: int,
) -> None:  # fmt: skip
    e = estimate(GPT2, tier=tier, seq_len=1024, micro_batch=1, world_size=ranks)
    assert e.breakdown() == {
        "weights": weights, "gradients": grads, "optimizer": adam, "buckets": buckets, "working_weights": working,
        "activations": acts, "logits": loss, "overhead": GiB + (weights + grads + adam + buckets + working + acts
                                                                 + loss) * 5 // 100,
    }  # fmt: skip
    assert e.host == host
    assert e.gpu_bytes == sum(e.breakdown().values())
    assert e.states == weights + grads + adam + buckets + working
    assert e.trainable_params == P_GPT2


# qwen-1.8b (llama family, h=2048, i=5504, L=24, V=151936, untied; largest = head 151936*2048 = 311,164,928),
# seq 1024, mbs 1; the loss's chunk: 268,435,456 // (4*151936) = 441 tokens of 151936 fp32 logits, x1.5
#   fast        activations 24 * (26*h + 4*q + 4*kv + 8*i) * 1024, q = kv = h (16 heads, 16 kv heads):
#               24 * (34*2048 + 8*5504) * 1024; loss 441*151936*6 + 1024*(14*2048 + 16)
#               + the head's fp32 gradient and bf16 copy 151936*2048*6
#   zero3 (8)   checkpointed 24 * 2 * 1024 * 2048 = 100,663,296. The step peaks in backward at the output layer:
#               the untied head gathered in bf16 (parameters and all-gather buffer, 2 * 2 * 311,164,928) and its
#               gradient reduce-scattered in fp32 (4 * 311,164,928), beside the loss's kept hidden states
#               1024*(10*2048 + 16) (its chunk is gone). Forward at the loss: gather + the fused loss's bf16 head
#               gradient (6 * 311,164,928) + kept + one chunk 441*151936*6 = 2,289,996,288 < 2,510,307,328.
def test_qwen_1_8b_fast_and_zero3() -> None:
    q = P_QWEN18
    fast = estimate(QWEN18, tier="fast", seq_len=1024, micro_batch=1, world_size=1)
    assert (fast.weights, fast.gradients, fast.optimizer, fast.working_weights) == (4 * q, 4 * q, 8 * q, 2 * q)
    assert fast.activations == 24 * (34 * 2048 + 8 * 5504) * 1024 == 2_793_406_464
    assert fast.logits == 441 * 151936 * 6 + 1024 * (14 * 2048 + 16) + 151936 * 2048 * 6
    z3 = estimate(QWEN18, tier="zero3", seq_len=1024, micro_batch=1, world_size=8)
    assert (z3.weights, z3.gradients, z3.optimizer) == (4 * q // 8, 4 * q // 8, 8 * q // 8)
    assert z3.working_weights == (2 + 2 + 4) * 311_164_928  # the head gathered twice in bf16, its fp32 gradient
    assert z3.activations == 24 * 2 * 1024 * 2048 == 100_663_296
    assert z3.logits == 1024 * (10 * 2048 + 16)
    assert z3.host == 0


def test_attention_kinds_and_checkpointing_override() -> None:
    def acts(**kw: object) -> int:
        return estimate(GPT2, seq_len=1024, micro_batch=1, world_size=1, **kw).activations  # type: ignore[arg-type]

    # eager keeps the scores' softmax: under autocast fp32 and a 16-bit copy, 6 bytes per head per token pair, 12
    # heads, s = 1024: per layer and token 64,512 + 6*12*1024 = 138,240; x 1024 tokens x 12 layers; without autocast
    # (FSDP2's 16-bit weights) GPT-2's softmax stays 16-bit: 2 bytes, 43,008 + 2*12*1024 = 67,584
    assert acts(tier="fast", attention="eager") == 12 * 138_240 * 1024
    assert acts(tier="zero2", attention="eager") == 12 * 67_584 * 1024
    assert acts(tier="fast", attention="flash") == acts(tier="fast", attention="sdpa") == GPT2_ACT
    assert acts(tier="fast", checkpointing=True) == 12 * 4 * 1024 * 768  # fp32 inputs under autocast
    assert acts(tier="zero3", checkpointing=False) == GPT2_ACT16
    assert acts(tier="zero3", attention="eager") == GPT2_CKPT  # checkpointed: the inputs only (the peak is the loss)
    e = estimate(GPT2, tier="fast", seq_len=512, micro_batch=4, world_size=1)
    assert e.activations == 12 * 64_512 * 2048
    # 2048 tokens: one full chunk of 1335; the head's fp32 gradient and bf16 copy
    assert e.logits == 1335 * 50257 * 6 + 2048 * (10 * 768 + 16) + 50257 * 768 * 6
    with pytest.raises(ConfigError, match="attention"):
        acts(tier="fast", attention="xformers")


def test_ddp_buckets_only_with_more_than_one_rank() -> None:
    one = estimate(GPT2, tier="fast", seq_len=1024, micro_batch=1, world_size=1)
    two = estimate(GPT2, tier="fast", seq_len=1024, micro_batch=1, world_size=2)
    assert (one.buckets, two.buckets) == (0, 4 * P_GPT2)  # fp32 buckets, like the fp32 gradients
    assert two.states - one.states == 4 * P_GPT2


def test_lora_trainable_counts() -> None:
    # PEFT prints "trainable params: 294,912" for GPT-2 small, r=8, c_attn: 12 * 8 * (768 + 2304)
    assert trainable_params(GPT2, LoraShape(8, ("c_attn",))) == 12 * 8 * (768 + 2304) == 294_912
    # Llama-3.2-1B, r=8, q_proj + v_proj (k/v width 8 heads * 64 = 512): PEFT's 851,968
    lora_qv = LoraShape(8, ("q_proj", "v_proj"))
    assert trainable_params(PRESETS["llama-1b"], lora_qv) == 16 * 8 * (2048 + 2048 + 2048 + 512) == 851_968
    # qwen-1.8b, r=16, q/k/v/o all 2048 -> 2048: 24 layers * 4 * 16 * 4096
    qkvo = LoraShape(16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert trainable_params(QWEN18, qkvo) == 24 * 4 * 16 * 4096 == 6_291_456
    # gpt2 `c_proj` names both projections (attn h->h, mlp i->h); naming the mlp one again adds nothing
    both = 12 * 4 * ((768 + 768) + (3072 + 768))  # 258,048
    assert trainable_params(GPT2, LoraShape(4, ("c_proj",))) == both
    assert trainable_params(GPT2, LoraShape(4, ("c_proj", "mlp.c_proj"))) == both
    assert trainable_params(GPT2, LoraShape(4, ("mlp.c_proj",))) == 12 * 4 * (3072 + 768)
    assert trainable_params(GPT2, None) == P_GPT2
    with pytest.raises(ConfigError, match=r"q_proj.*gpt2"):
        trainable_params(GPT2, LoraShape(8, ("q_proj",)))
    with pytest.raises(ConfigError, match="rank must be >= 1"):
        trainable_params(QWEN18, LoraShape(0, ("q_proj",)))


def test_lora_states() -> None:
    t = 6_291_456  # qwen-1.8b r=16 q/k/v/o, above
    f = P_QWEN18  # the frozen base, held in 16 bits; the adapters fp32 with fp32 grads and Adam's m, v
    qkvo = LoraShape(16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    fast = estimate(QWEN18, tier="fast", seq_len=1024, micro_batch=1, world_size=1, lora=qkvo)
    assert fast.trainable_params == t
    assert (fast.weights, fast.gradients, fast.optimizer, fast.working_weights) == (2 * f + 4 * t, 4 * t, 8 * t, 2 * t)
    assert fast.states == 2 * P_QWEN18 + 18 * t == 3_786_608_640
    z2 = estimate(QWEN18, tier="zero2", seq_len=1024, micro_batch=1, world_size=8, lora=qkvo)
    head = 2 * 311_164_928  # the untied head in bf16: its all-gather buffer at the loss (a frozen head: no gradient)
    assert z2.states == (2 * f + 4 * t) // 8 + 4 * t // 8 + 8 * t // 8 + 2 * (f + t) + head  # + the bf16 gather
    off = estimate(QWEN18, tier="zero2_offload", seq_len=1024, micro_batch=1, world_size=8, lora=qkvo)
    assert off.host == 16 * t // 8 == 12_582_912
    assert off.optimizer == 0
    assert off.states == (2 * f + 4 * t) // 8 + 4 * t // 8 + 2 * (f + t) + head == 4_151_407_104 + head
    z3 = estimate(QWEN18, tier="zero3", seq_len=1024, micro_batch=1, world_size=8, lora=qkvo)
    # the base sharded too: the head gathered twice (parameters, all-gather buffer); no block's all-gather is
    # prefetched at the loss behind a frozen untied head (traced: 2,263,457,708 B; this model 2,261,058,304, -0.11 %;
    # with the last block's buffer, 2*50,597,888 more, it was +4.4 %)
    assert z3.states == (2 * f + 4 * t) // 8 + 4 * t // 8 + 8 * t // 8 + 2 * head
    mini = estimate(QWEN18, tier="minimal", seq_len=1024, micro_batch=1, world_size=8, lora=qkvo)
    assert mini.host == 16 * t // 8 + 2 * f // 8


def test_lora_activations_and_loss() -> None:
    # LoRA on the attention (llama family, fast): the blocks 8*h + 4*q + 4*kv + 6*i, each fp32 adapter's 16-bit
    # copy of its input 2*h (q and v: 4*h); q = kv = h here: 20*h + 6*i per layer and token; 20*h + 16 after the last
    qv = LoraShape(8, ("q_proj", "v_proj"))
    e = estimate(QWEN18, tier="fast", seq_len=1024, micro_batch=1, world_size=1, lora=qv)
    assert e.activations == 24 * (20 * 2048 + 6 * 5504) * 1024
    assert e.logits == 441 * 151936 * 6 + 1024 * (20 * 2048 + 16)  # the frozen head takes no gradient
    # on the MLP too (fast): + 2*h each for k, gate and up, 2*q for o, 2*i for down: 28*h + 8*i; under FSDP2's 16-bit
    # adapters q, k and v save their one input once, gate and up theirs, o reads what SDPA keeps: 8+2+2 h + 4 q + 4 kv
    # + 6+2 i = 20*h + 8*i.
    # Checkpointed, each layer keeps its 16-bit input (the base is 16-bit)
    every = LoraShape(8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert estimate(QWEN18, tier="fast", seq_len=1024, micro_batch=1, world_size=1, lora=every).activations == (
        24 * (28 * 2048 + 8 * 5504) * 1024
    )
    zero2 = estimate(QWEN18, tier="zero2", seq_len=1024, micro_batch=1, world_size=8, lora=every)
    assert zero2.activations == 24 * (20 * 2048 + 8 * 5504) * 1024
    ckpt = estimate(QWEN18, tier="fast", seq_len=1024, micro_batch=1, world_size=1, lora=every, checkpointing=True)
    assert ckpt.activations == 24 * 2 * 1024 * 2048


def test_plan_tier_hand_checked() -> None:
    # gpt2-small, fast, 1 rank, 24 GiB, global batch 64, seq 1024. Budget int(0.9 * 24 GiB) = 23,192,823,398.
    # total(b) = body + GiB + body*5//100, body = 18P + one loss chunk 1335*50257*6 + the head's fp32 gradient and
    # bf16 copy 50257*768*6 + b*(792,723,456 + 1024*7,696) = 2,874,059,370 + b*800,604,160
    #   b=22: body 20,487,350,890, total 22,585,460,258 <= budget
    #   b=23: body 21,287,955,050, total 23,426,094,626 >  budget
    # largest divisor of 64 that is <= 22: 16; accumulation 64 / 16 = 4.
    p = plan_tier(GPT2, tier="fast", gpu_bytes=24 * GiB, global_batch=64, world_size=1, seq_len=1024)
    assert (p.fits, p.useful, p.max_micro_batch, p.micro_batch, p.grad_accum) == (True, True, 22, 16, 4)
    assert p.budget == 23_192_823_398
    assert p.estimate.micro_batch == 16
    assert p.margin == p.budget - p.estimate.gpu_bytes > 0
    # 8 ranks: per-rank batch 8, accumulation 1
    p8 = plan_tier(GPT2, tier="fast", gpu_bytes=24 * GiB, global_batch=64, world_size=8, seq_len=1024)
    assert (p8.micro_batch, p8.grad_accum) == (8, 1)
    # utilization is a documented parameter: at 0.5 the budget is 12 GiB = 12,884,901,888;
    #   b=10: total 12,497,847,842 fits; b=11: 13,338,482,210 does not
    half = plan_tier(
        GPT2, tier="fast", gpu_bytes=24 * GiB, global_batch=64, world_size=1, seq_len=1024, utilization=0.5
    )
    assert (half.max_micro_batch, half.micro_batch, half.grad_accum) == (10, 8, 8)


def test_plan_tier_reports_the_spec_micro_batch() -> None:
    # the spec's micro-batch 32 at fast: 32 > 22 (above) -> does not fit, 30,991,803,938 - 23,192,823,398 short
    p = plan_tier(GPT2, tier="fast", gpu_bytes=24 * GiB, global_batch=64, world_size=1, seq_len=1024, micro_batch=32)
    assert (p.fixed, p.fits, p.micro_batch, p.grad_accum, p.max_micro_batch) == (True, False, 32, 2, 22)
    assert p.margin == 23_192_823_398 - 30_991_803_938
    assert "micro-batch 32 (spec)" in p.reason and "short" in p.reason and "largest that fits: 22" in p.reason
    ok = plan_tier(GPT2, tier="fast", gpu_bytes=24 * GiB, global_batch=64, world_size=1, seq_len=1024, micro_batch=4)
    assert (ok.fits, ok.micro_batch, ok.grad_accum, ok.reason) == (True, 4, 16, "")
    # auto picks the first tier where the spec's micro-batch fits: zero2_offload checkpoints, fast cannot
    plans = plan_all(GPT2, gpu_bytes=24 * GiB, global_batch=64, world_size=1, seq_len=1024, micro_batch=64)
    picked = pick_tier(plans)
    assert picked is not None and picked.tier == "zero2_offload" and picked.micro_batch == 64
    with pytest.raises(ConfigError, match="does not divide"):
        plan_tier(GPT2, tier="fast", gpu_bytes=GiB, global_batch=64, world_size=1, seq_len=8, micro_batch=5)


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="global_batch 10 must be a positive multiple of world_size 4"):
        plan_tier(GPT2, tier="fast", gpu_bytes=GiB, global_batch=10, world_size=4, seq_len=128)
    with pytest.raises(ConfigError, match="utilization"):
        plan_tier(GPT2, tier="fast", gpu_bytes=GiB, global_batch=8, world_size=1, seq_len=128, utilization=1.5)
    with pytest.raises(ConfigError, match="seq_len 0"):
        estimate(GPT2, tier="fast", seq_len=0, micro_batch=1, world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        estimate(GPT2, tier="fast", seq_len=8, micro_batch=1, world_size=1).states = 0  # type: ignore[misc]


def test_one_rank_skips_sharding_only_tiers() -> None:
    # gpt2-small on one rank: fast needs 3.663 GiB, zero3 (checkpointed) 3.621, zero2_offload 2.664.
    # A budget of 3.64 GiB fits zero3 but not fast; auto must still not pick zero3 (no sharding gain).
    plans = plan_all(GPT2, gpu_bytes=int(3.64 * GiB / 0.9), global_batch=8, world_size=1, seq_len=1024)
    by = {p.tier: p for p in plans}
    assert [p.tier for p in plans] == list(TIERS)
    assert not by["fast"].fits
    assert by["zero3"].fits
    assert not by["zero2"].useful
    assert not by["zero3"].useful
    assert "one rank" in by["zero3"].reason
    assert by["zero2_offload"].useful
    assert by["minimal"].useful
    picked = pick_tier(plans)
    assert picked is not None
    assert picked.tier == "zero2_offload"
    multi = plan_all(GPT2, gpu_bytes=80 * GiB, global_batch=64, world_size=8, seq_len=1024)
    assert all(p.useful and p.fits and p.reason == "" for p in multi)


# The seeds' ladder (note 002, DeepSpeed, one GPU, a 0.2-0.5B chat model): >12 GB ZeRO-2 class,
# 6-12 GB stage2_offload, 4-6 GB stage3, <4 GB minimal. Our qwen-0.5b (P = 494,005,120), seq 1024, global batch 16,
# micro-batch 1 (loss chunk 441*151936*6 = 402,022,656; tied embedding: the head's gradient, 136,134,656 params):
#   fast          18P = 8,892,092,160 + activations 24*(32*896 + 8*4864)*1024 = 1,660,944,384 + loss 402,022,656
#                 + 1024*(14*896 + 16) + the head's fp32 gradient and bf16 copy 6*136,134,656 = 1,231,692,032
#                 + GiB + 5 % = 13,447,706,828 (12.52 GiB): fits 0.9 * 14 GiB, not 0.9 * 12 GiB
#   zero2_offload 10P + 2*136,134,656 (the embedding's bf16 gradient) + 24*2*1024*896 = 44,040,192
#                 + loss 402,022,656 + 1024*(10*896 + 16) + GiB + 5 % = 7,024,695,347 (6.54 GiB): fits 8 GiB
#                 (budget 7,730,941,132), not 4
#   minimal       2*2*136,134,656 + 44,040,192 + 411,214,080 + GiB + 5 % = 2,123,524,364 (1.98 GiB): fits 4 GiB
# Where we differ: one rank skips stage3 (it shards nothing; the seeds' stage3 gain was its activation
# checkpointing, which our zero2_offload also has), so 4-6 GiB cards land on minimal; and the traced step of
# `fast` (autocast's bf16 weight copies, fp32 residual activations, the head's gradient) moves its edge to 13.9 GiB.
SEEDS_CARDS = [(4, "minimal"), (8, "zero2_offload"), (12, "zero2_offload"), (14, "fast"), (20, "fast"), (80, "fast")]


@pytest.mark.parametrize(("gib", "tier"), SEEDS_CARDS)
def test_seeds_tier_table(gib: int, tier: str) -> None:
    picked = pick_tier(plan_all(QWEN05, gpu_bytes=gib * GiB, global_batch=16, world_size=1, seq_len=1024))
    assert picked is not None
    assert picked.tier == tier


def test_bigger_card_never_picks_a_slower_tier() -> None:
    order, last = [], len(TIERS)  # index of the tier picked; len(TIERS) = nothing fits
    for half_gib in range(2, 161):  # 1 to 80 GiB in 0.5 GiB steps
        picked = pick_tier(plan_all(QWEN05, gpu_bytes=half_gib * GiB // 2, global_batch=16, world_size=1, seq_len=1024))
        index = TIERS.index(picked.tier) if picked else len(TIERS)
        assert index <= last, f"{half_gib / 2} GiB picks {picked} after a slower tier"
        order.append(index)
        last = index
    assert order[0] == len(TIERS)
    assert order[-1] == 0
    assert {TIERS[i] for i in order if i < len(TIERS)} == {"fast", "zero2_offload", "minimal"}


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(PRESETS)),
    tier=st.sampled_from(TIERS),
    world=st.integers(1, 16),
    per_rank=st.integers(1, 256),
    gpu_gib=st.integers(1, 160),
    seq=st.integers(16, 4096),
    ckpt=st.sampled_from([None, True, False]),
)
def test_plan_keeps_the_effective_batch(
    name: str, tier: str, world: int, per_rank: int, gpu_gib: int, seq: int, ckpt: bool | None
) -> None:
    shape, global_batch = PRESETS[name], per_rank * world
    p = plan_tier(
        shape,
        tier=tier,
        gpu_bytes=gpu_gib * GiB,
        global_batch=global_batch,
        world_size=world,
        seq_len=seq,
        checkpointing=ckpt,
    )

    def need(b: int) -> int:  # one micro-batch a step (b = the per-rank batch): no gradients beside the activations
        return estimate(shape, tier=tier, seq_len=seq, micro_batch=b, world_size=world, checkpointing=ckpt,
                        grad_accum=1 if b == per_rank else 2).gpu_bytes  # fmt: skip

    assert need(p.max_micro_batch + 1) > p.budget  # max_micro_batch is the largest that fits
    if p.fits:
        assert per_rank % p.micro_batch == 0
        assert p.grad_accum * p.micro_batch * world == global_batch
        assert p.micro_batch <= p.max_micro_batch
        assert need(p.micro_batch) <= p.budget
        assert p.estimate.gpu_bytes == need(p.micro_batch)
        bigger = [d for d in range(p.micro_batch + 1, min(per_rank, p.max_micro_batch) + 1) if per_rank % d == 0]
        assert not bigger  # no larger divisor of the per-rank batch fits
    else:
        assert (p.micro_batch, p.grad_accum, p.max_micro_batch) == (0, 0, 0)
        assert need(1) > p.budget


def test_fp32_widens_the_activations() -> None:
    shape = PRESETS["gpt2-small"]
    # 16-bit autocast: 12 layers x (20*768 + 16*3072) x 1024 tokens; fp32 training (traced): 32*768 + 20*3072
    half = estimate(shape, tier="fast", seq_len=1024, micro_batch=1, world_size=1)
    full = estimate(shape, tier="fast", seq_len=1024, micro_batch=1, world_size=1, precision="fp32")
    assert (half.activations, full.activations) == (792_723_456, 12 * 86_016 * 1024)
    assert full.states == half.states
    with pytest.raises(ConfigError, match="precision"):
        estimate(shape, tier="fast", seq_len=1024, micro_batch=1, world_size=1, precision="fp8")  # type: ignore[arg-type]
