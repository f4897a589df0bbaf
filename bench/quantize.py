"""4-bit frozen bases for LoRA on this machine: torchao's NF4Tensor against bitsandbytes' Linear4bit (nf4).

`python -m bench.quantize [--size 4096] [--tokens 2048]` prints, for each library that is installed: bytes a
parameter as held, the dequantized weight's error against the 16-bit one (relative Frobenius norm), the seconds of a
forward and backward of one linear layer (bf16 input, CPU), whether FSDP2's `fully_shard` takes the layer and
trains it (one gloo rank), and whether the layer runs on FakeTensors (what the memory trace needs). The figures
chose torchao for `model.quantize: nf4` (runner/model/quantize.py).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable
from importlib.metadata import version
from importlib.util import find_spec

import torch
from torch import nn


def torchao_layer(weight: torch.Tensor) -> nn.Module:
    from torchao.quantization import to_nf4

    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    layer.weight = nn.Parameter(to_nf4(weight, 64, 256), requires_grad=False)
    return layer


def torchao_bytes(layer: nn.Module) -> int:
    w = layer.weight
    return sum(t.numel() * t.element_size() for t in (w.quantized_data, w.quantized_scalers, w.quantization_factor))


def torchao_dequant(layer: nn.Module) -> torch.Tensor:
    return layer.weight.get_original_weight()


def bnb_layer(weight: torch.Tensor) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], bias=False, compute_dtype=weight.dtype,
                              quant_type="nf4")  # fmt: skip
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
    layer.weight = layer.weight._quantize("cpu") if hasattr(layer.weight, "_quantize") else layer.weight
    return layer


def bnb_bytes(layer: nn.Module) -> int:
    w, state = layer.weight, layer.weight.quant_state
    held = [w.data, state.absmax, *(getattr(state.state2, "absmax", None),)]
    if state.nested:
        held.append(state.offset)
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))


def bnb_dequant(layer: nn.Module) -> torch.Tensor:
    import bitsandbytes.functional as F

    return F.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def step_seconds(layer: nn.Module, x: torch.Tensor, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        xi = x.clone().requires_grad_(True)
        start = time.perf_counter()
        layer(xi).float().square().mean().backward()
        best = min(best, time.perf_counter() - start)
    return best


def _fsdp2_rank(rank: int, backend: str, size: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        weight = (torch.randn(size, size) * 0.02).to(torch.bfloat16)
        layer = BACKENDS[backend][0](weight)
        model = nn.Sequential(layer, nn.Linear(size, 8, dtype=torch.bfloat16))
        fully_shard(model)
        model(torch.randn(4, size, dtype=torch.bfloat16, requires_grad=True)).float().mean().backward()
        shard = model[0].weight.to_local() if hasattr(model[0].weight, "to_local") else model[0].weight
        found = f"trains, rank 0 holds {shard.shape[0]} of {size} rows"
    except Exception as err:  # the finding is the failure itself
        found = f"fails: {type(err).__name__}: {str(err).splitlines()[0][:90]}"
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            f.write(found)


def fsdp2(backend: str, size: int) -> str:
    """FSDP2's fully_shard over two gloo ranks (one rank takes a shortcut that drops an NF4 tensor's other parts)."""
    import tempfile

    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    with tempfile.NamedTemporaryFile(suffix=".txt") as f:
        mp.spawn(_fsdp2_rank, args=(backend, size, f.name), nprocs=2)
        return open(f.name).read()


def fake(make: Callable[[torch.Tensor], nn.Module], weight: torch.Tensor, x: torch.Tensor) -> str:
    from runner import internals

    try:
        with internals.fake_mode():  # as the memory trace runs the step
            layer = make(torch.empty_like(weight))
            layer(torch.empty_like(x)).float().mean()
        return "runs"
    except Exception as err:
        return f"fails: {type(err).__name__}: {str(err).splitlines()[0][:90]}"


BACKENDS = {
    "torchao NF4Tensor": (torchao_layer, torchao_bytes, torchao_dequant),
    "bitsandbytes Linear4bit": (bnb_layer, bnb_bytes, bnb_dequant),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    weight = (torch.randn(args.size, args.size) * 0.02).to(torch.bfloat16)
    x = torch.randn(args.tokens, args.size, dtype=torch.bfloat16)
    backends = {k: v for k, v in BACKENDS.items() if find_spec(k.split()[0]) is not None}
    print(f"{args.size} x {args.size} bf16 linear, {args.tokens} tokens, torch {torch.__version__}, CPU")
    for key in BACKENDS.keys() - backends.keys():  # said, not skipped in silence
        package = key.split()[0]
        print(f"{key}: not measured, {package} is not installed (pip install {package}; torchao is the offload "
              "extra's: pip install 'jobspec-k8s[offload]')")  # fmt: skip
    if not backends:
        raise SystemExit("nothing to compare: install torchao and bitsandbytes")
    for key, (make, nbytes, dequant) in backends.items():
        name = f"{key} {version(key.split()[0])}"
        layer = make(weight)
        err = (dequant(layer).float() - weight.float()).norm() / weight.float().norm()
        print(f"{name}: {nbytes(layer) / weight.numel():.4f} bytes a parameter, error {err:.4f}, "
              f"forward+backward {step_seconds(layer, x):.3f} s (bf16 nn.Linear: "
              f"{step_seconds(nn.Linear(args.size, args.size, bias=False, dtype=torch.bfloat16), x):.3f} s), "
              f"FSDP2 (2 ranks) {fsdp2(key, args.size)}, FakeTensor {fake(make, weight, x[:4])}")  # fmt: skip


if __name__ == "__main__":
    main()
