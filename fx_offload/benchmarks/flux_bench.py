"""``python -m fx_offload flux``: a Flux transformer with the real model's dimensions (fewer
blocks, so that the resident model fits for reference) timed per denoising step, side by side
in one process:

* resident, compiled with Inductor (the compute time);
* fx_offload: every double- and single-stream block offloaded, both lists in one schedule;
* diffusers' own group offloading, block level, one block per group, on a side stream
  (``enable_group_offload(..., use_stream=True)``): the same blocks, the same bytes moved.

Prints the median step time, the peak GPU memory of the timed steps, the copy bound (the
blocks' bytes over the measured pinned host-to-device bandwidth) and each output's largest
difference from the resident model.  Needs a GPU and ``diffusers``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from .. import report, restore
from .bench import h2d_bandwidth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--double", type=int, default=4, help="double-stream blocks (19 in Flux)")
    parser.add_argument("--single", type=int, default=8, help="single-stream blocks (38 in Flux)")
    parser.add_argument("--image-tokens", type=int, default=4096,
                        help="latent patches: 4096 for a 1024x1024 image")
    parser.add_argument("--text-tokens", type=int, default=512, help="prompt embedding tokens")
    parser.add_argument("--prefetch-step", type=int, default=2,
                        help="option prefetch_step of the fx_offload row")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps of each row")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():       # before diffusers' import, which takes seconds
        print("error: the flux benchmark needs a GPU", file=sys.stderr)
        return 2
    try:
        from diffusers import FluxTransformer2DModel
    except ImportError:
        print('error: the flux benchmark needs diffusers: pip install "diffusers==0.42.1"',
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    base = FluxTransformer2DModel(num_layers=args.double, num_single_layers=args.single,
                                  guidance_embeds=True).to(torch.bfloat16).eval()
    blocks = [*base.transformer_blocks, *base.single_transformer_blocks]
    blocks_bytes = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    inputs = _inputs(args.image_tokens, args.text_tokens)
    print(f"Flux transformer, real dims, {args.double} double + {args.single} single blocks "
          f"({blocks_bytes / 2**30:.2f} GiB of blocks, bf16); {args.image_tokens} image + "
          f"{args.text_tokens} text tokens; {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}", flush=True)
    rows, outputs = {}, {}

    model = copy.deepcopy(base).cuda()
    step = torch.compile(model, backend="inductor")
    rows["resident (Inductor)"], outputs["resident"] = _measure(step, inputs, args.repeats)
    del model, step

    model = copy.deepcopy(base).cuda()
    step = torch.compile(model, backend="prefetch_offload", options={
        "layers": ["transformer_blocks", "single_transformer_blocks"], "group_size": 1,
        "num_in_group": 1, "prefetch_step": args.prefetch_step})
    name = f"fx_offload, every block, {args.prefetch_step} slots (Inductor)"
    rows[name], outputs[name] = _measure(step, inputs, args.repeats)
    print(report(model))
    restore(model)
    del model, step

    model = copy.deepcopy(base)
    model.enable_group_offload(onload_device=torch.device("cuda"),
                               offload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1, use_stream=True)
    name = "diffusers group offload, block level, stream (eager)"
    rows[name], outputs[name] = _measure(model, inputs, args.repeats)

    bound = blocks_bytes / h2d_bandwidth(torch.device("cuda"), 1 << 30) * 1e3
    print(f"\ncopy bound: {blocks_bytes / 2**30:.2f} GiB of blocks per step = {bound:.1f} ms")
    print(f"{'method':58s} {'ms/step':>8s} {'x bound':>8s} {'peak GiB':>9s} {'max diff':>9s}")
    for name, (ms, peak) in rows.items():
        diff = (outputs[name] - outputs["resident"]).abs().max().item() \
            if name in outputs and name != "resident (Inductor)" else 0.0
        print(f"{name:58s} {ms:8.1f} {ms / bound:8.2f} {peak / 2**30:9.2f} {diff:9.3g}")
    return 0


def _inputs(image: int, text: int) -> dict:
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    return dict(hidden_states=torch.randn(1, image, 64, **bf16),
                encoder_hidden_states=torch.randn(1, text, 4096, **bf16),
                pooled_projections=torch.randn(1, 768, **bf16),
                timestep=torch.tensor([0.5], **bf16), guidance=torch.tensor([3.5], **bf16),
                img_ids=torch.zeros(image, 3, device="cuda"),
                txt_ids=torch.zeros(text, 3, device="cuda"), return_dict=False)


def _measure(step, inputs, repeats: int) -> tuple[tuple[float, int], torch.Tensor]:
    """((median ms, peak bytes of the timed steps), the output)."""
    times = []
    with torch.no_grad():
        for _ in range(2):                       # compile, first fill, warm-up
            step(**inputs)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = step(**inputs)[0]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return (sorted(times)[repeats // 2] * 1e3, torch.cuda.max_memory_allocated()), out.float()
