"""A norm and the fused product after it at one row, each way exlnb could run them; JSON out.

    python -m benchmarks norm-product-sweep [--dependent-launch [1|early]] [--out DIR]

On an H200 the ExLlamaV2 engine's 7B step spent 0.174 ms on 65 RMS-norm launches, 0.883 ms on q, k and v (one
cuBLAS batched product a layer over an input-major stack, 3.22 GB at 85 % of copy bandwidth) and 1.429 ms on gate
and up (the same, 5.77 GB at 94 %) (benchmarks/results/speed-nvidia-h200-2026-11-29-c). 1.3x the floor needs about
0.12 ms more than the MLP and attention tails give, which is about what a norm folded into the q, k and v product
at 89 % would save. For each group (an attention's q, k and v: 4096 -> 3 x 4096; an MLP's gate and up: 4096 ->
2 x 11008) this replays 32 layers of the norm and the product from one CUDA graph, each way:
- `norm_then_bmm_kn`: the RMS norm (exllamav2's kernel where it is installed, else torch's ops), then `torch.bmm`
  over the input-major stack, as the fused group runs it today;
- `norm_then_gemv_nk`: the same norm, then exlnb's GEMV over output-major weights;
- `normed_nk_bnB_bkK_wW_sS`: one Triton kernel (exlnb/engines/normed_gemv.py) whose every program computes the
  row's RMS itself, then reads rows of the output-major weights; with `_once`, the row read once, beside the
  weights, each program scaling its sums by the inverse RMS at the end (one pass) instead of a first pass over it;
- `normed_kn_bnB_bkK_wW_sS`: the same over the fused group's input-major stack as it lies, each program a block of
  contiguous outputs of one product: no weight laid out again (two passes).
For gate and up, the MLP's activation after them too:
- `norm_then_bmm_then_silu_kn`: the norm, the batched product, then `gated_activation.silu_times`, as the MLP tail
  runs them without a folded norm;
- `normed_gated_nk_bnB_bkK_wW_sS`: one kernel (`normed_gated_row`), the norm, both products over output-major
  weights and the activation as it writes them, B outputs of each a program (`_once`: in one pass).
For q, k and v, RoPE on q and k as they are written:
- `normed_roped_nk_bnB_bkK_wW_sS`: one kernel (`normed_roped_rows`), B rows of a head's first half and their
  partners a program (`_once`: in one pass), heads of 128.
With `--dependent-launch` exlnb's kernels are launched dependent on the kernel before them
(EXLNB_DEPENDENT_LAUNCH=1, or `early`, exlnb/engines/dependent_launch.py): the record says how, and against a
sweep without it shows what each launch boundary of 32 layers gains. Median and best of 20 replays, the weights'
bytes over the median, and each way's largest difference from the first way of its outputs (the products; the
activation), over its largest output. CUDA only (the kernels run in Triton's interpreter for the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gemv import copy_bytes_per_s
from benchmarks.gemv_sweep import timed
from benchmarks.harness import device_slug, environment, new_result_path, write_json

TRITON = importlib.util.find_spec("triton") is not None
LAYERS, HIDDEN, EPS = 32, 4096, 1e-5
GROUPS = {"qkv": (3, 4096), "gate_up": (2, 11008)}  # the fused group's products, and the outputs of each
# (outputs a program, inputs a tile, warps, stages); the output-major kernels each in two passes and in one
OUTPUT_MAJOR = [(16, 1024, 8, 3), (16, 512, 4, 3), (32, 512, 8, 3), (8, 1024, 4, 3), (16, 256, 4, 4), (8, 2048, 4, 3)]
INPUT_MAJOR = [(64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (256, 32, 8, 3), (32, 128, 4, 3), (64, 128, 8, 4)]
# the paired kernels' rows: B outputs of each of two sets a program; (4, 1024, 4, 3) reads the 8 rows a program in
# the tiles and stages of the plain kernel's fastest (8, 1024, 4, 3)
GATED = [
    (8, 256, 4, 4),
    (16, 256, 4, 4),
    (4, 512, 4, 4),
    (4, 1024, 4, 3),
    (2, 1024, 4, 3),
    (8, 1024, 4, 3),
    (4, 2048, 4, 3),
]
ROPED = [(8, 256, 4, 4), (4, 512, 4, 4), (8, 1024, 4, 3), (4, 1024, 4, 3), (2, 1024, 4, 3), (4, 2048, 4, 3)]
HEAD_DIM, POSITION = 128, 1000  # a 7B Llama's heads, and the position the RoPE rows rotate to


def rms_norm(x: torch.Tensor, norm: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """exllamav2's RMS norm kernel where it is installed (as the engine runs it), else the same in torch's ops."""
    if importlib.util.find_spec("exllamav2") is not None and x.is_cuda:
        from exllamav2.ext import exllamav2_ext as ext_c

        out = torch.empty_like(x)
        ext_c.rms_norm(x.view(1, -1), norm, out.view(1, -1), eps)
        return out
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * scale * norm.float()).half()


def ways(x, norm, stacks: list, output_major: list) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Each way of running every layer's norm and fused products: name -> a call returning the layers' outputs.
    Each layer's weights as the (P, K, N) stack the fused group holds, and as one output-major (PN, K) matrix."""
    from exlnb.engines.gated_activation import silu_times
    from exlnb.engines.gemv import row_times_matrix
    from exlnb.engines.normed_gemv import normed_gated_row, normed_product, normed_roped_rows

    def bmm(stack):
        return torch.bmm(rms_norm(x, norm).view(1, 1, -1).expand(len(stack), -1, -1), stack).view(-1)

    found = {
        "norm_then_bmm_kn": lambda: [bmm(stack) for stack in stacks],
        "norm_then_gemv_nk": lambda: [row_times_matrix(rms_norm(x, norm), w, torch.half) for w in output_major],
    }
    for layout, weights, configs, passes in (
        ("nk", output_major, OUTPUT_MAJOR, (False, True)),
        ("kn", stacks, INPUT_MAJOR, (False,)),
    ):
        for config in configs:
            for once in passes:
                name = "normed_{}_bn{}_bk{}_w{}_s{}".format(layout, *config) + "_once" * once
                found[name] = lambda c=(*config, once), ws=weights: [normed_product(x, norm, w, c, EPS) for w in ws]
    if len(stacks[0]) == 2:  # gate and up: the activation after them
        found["norm_then_bmm_then_silu_kn"] = lambda: [silu_times(*bmm(stack).view(2, -1)) for stack in stacks]
        views = [w.view(2, -1, w.shape[1]).transpose(1, 2) for w in output_major]  # (2, K, N) views of (2, N, K)
        for config in GATED:
            for once in (False, True):
                name = "normed_gated_nk_bn{}_bk{}_w{}_s{}".format(*config) + "_once" * once
                found[name] = lambda c=(*config, once): [
                    normed_gated_row(x, norm, EPS, view, (0, 1), c) for view in views
                ]
    if len(stacks[0]) == 3:  # q, k and v: RoPE on q and k as they are written
        head_dim = min(HEAD_DIM, stacks[0].shape[2])
        angles = torch.rand(1, 1, POSITION + 1, head_dim, device=x.device) * 6.3
        sin, cos, at = angles.sin().half(), angles.cos().half(), torch.tensor([POSITION], device=x.device)
        views = [w.view(3, -1, w.shape[1]).transpose(1, 2) for w in output_major]  # (3, K, N) views of (3, N, K)
        for config in ROPED:
            for once in (False, True):
                name = "normed_roped_nk_bn{}_bk{}_w{}_s{}".format(*config) + "_once" * once
                found[name] = lambda c=(*config, once): [
                    normed_roped_rows(x, norm, EPS, view, (0, 1), sin, cos, at, c) for view in views
                ]
    return found


def same_outputs(name: str, out: torch.Tensor) -> tuple[int, bool]:
    """Which ways' outputs a way's must equal: those of as many numbers, rotated (RoPE) or not."""
    return out.numel(), "roped" in name


def output_major_of(stacks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each (P, K, N) stack as one output-major (PN, K) matrix, the first product's rows first (copies)."""
    return [stack.transpose(1, 2).reshape(-1, stack.shape[1]).contiguous() for stack in stacks]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks norm-product-sweep", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--dependent-launch", nargs="?", const="1", choices=("1", "early"), help="launch exlnb's kernels dependent"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not TRITON:
        parser.exit(2, "python -m benchmarks norm-product-sweep needs a CUDA GPU and triton\n")
    from exlnb.engines.dependent_launch import VARIABLE, dependent_launch

    if args.dependent_launch:
        os.environ[VARIABLE] = args.dependent_launch  # read at each launch: every kernel this process launches
    record = {
        "environment": environment(),
        "copy_bandwidth_bytes_per_s": copy_bytes_per_s(cuda=True),
        "dependent_launch": dependent_launch(torch.device("cuda")),
    }
    path = new_result_path(args.out, f"norm-product-sweep-{device_slug(record['environment'])}")
    for group, (products, outputs) in GROUPS.items():
        torch.manual_seed(0)
        stacks = [torch.randn(products, HIDDEN, outputs, device="cuda").half() * 0.02 for _ in range(LAYERS)]
        x, norm = torch.randn(HIDDEN, device="cuda").half(), (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).half()
        results = record.setdefault(group, {"weight_bytes": LAYERS * products * HIDDEN * outputs * 2})
        references = {}  # the first way's outputs of each kind (same_outputs): the products, rotated, the activation
        for name, fn in ways(x, norm, stacks, output_major_of(stacks)).items():
            timed(results, name, fn, results["weight_bytes"])
            if "error" in results[name]:  # a configuration triton refuses is recorded as such, and not run again
                continue
            first = fn()[0].float()
            reference = references.setdefault(same_outputs(name, first), first)
            results[name]["max_rel_diff"] = float((first - reference).abs().max() / reference.abs().max())
        del stacks
        torch.cuda.empty_cache()
        write_json(path, record, indent=1)
    print(f"wrote {path}")
    return record
