"""``python -m fx_offload train``: a LoRA fine-tuning step on a frozen base whose layers are
offloaded, timed side by side in one process against the same step resident and against what
users run today.

The model is a Hugging Face Llama built from a config (Llama-3-8B layer shapes by default,
random bf16 weights, ``--layers`` decoder layers) with a PEFT LoRA of rank ``--rank`` on
q/k/v/o; the base is frozen.  A step is forward, backward and ``torch.optim.AdamW`` on the
adapters over one batch of ``--seq`` tokens.  Rows:

* ``resident``: every weight on the device, the model compiled with Inductor;
* ``fx_offload``: ``backend="prefetch_offload"`` (Inductor inside), of each ``--group-size``
  layers the last ``--num-in-group`` offloaded (three quarters by default); the frozen
  weights cross the link twice a step, once for the forward and once for the input
  gradients of the backward;
* ``fsdp2``: torch's ``fully_shard`` with ``CPUOffloadPolicy`` on the same layers, one rank
  (parameters on the host, copied in per layer for forward and backward, eager);
* ``accelerate``: accelerate's ``cpu_offload`` hooks on the same layers (eager).

``copied GiB``: for ``fx_offload`` what its last timed step copied (``report``'s
``copied_bytes_last_call``, forward and backward: the layers a slot still holds where the
backward begins, or the next forward, are not copied again); for the other offloaded rows the
frozen weights of the offloaded layers, twice (forward, and backward for the input gradients).

Each row prints the median step time of ``--steps`` timed steps after two warm-up steps, the
peak device memory, and the bound: the larger of the resident step and the row's copied
bytes over the pinned host-to-device rate measured in the same process.  The adapters'
gradients after the first step are compared with the resident row's.  ``--device cpu
--quick`` is a smoke run of seconds (a tiny model, ``aot_eager``, no bound).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from .. import report, restore
from .common import at_least

METHODS = ("resident", "fx_offload", "fsdp2", "accelerate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=16, help="decoder layers")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per training sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank on q/k/v/o")
    parser.add_argument("--group-size", type=int, default=4, help="group_size of the offload")
    parser.add_argument("--num-in-group", type=int, default=3,
                        help="num_in_group: offloaded layers of each group")
    parser.add_argument("--steps", type=at_least(1, "timed steps"), default=5,
                        help="timed steps of each row (after two warm-up steps)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated among " + ", ".join(METHODS))
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model (with --device cpu: a smoke run of seconds)")


def _config(args):
    from transformers import LlamaConfig
    if args.quick:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=args.layers,
                           vocab_size=256, max_position_embeddings=max(args.seq, 64))
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, num_hidden_layers=args.layers, vocab_size=128256,
                       max_position_embeddings=max(args.seq, 8192), rope_theta=500000.0)


def _build(args, device):
    """The LoRA model on ``device`` (bf16 base on a GPU, fp32 on the CPU), same weights for
    every row (a fixed seed)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        base = LlamaForCausalLM(_config(args)).to(dtype)
    base = base.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device).mul_(0.02))
    with torch.device(device):      # the rotary table is a buffer to_empty left unset
        base.model.rotary_emb = type(base.model.rotary_emb)(base.config)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, lora)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:       # nonzero, so the first step's gradients reach lora_A too
            with torch.no_grad():
                p.normal_(0, 0.02)
    return model.train()


def _offloaded(args) -> list[int]:
    g, n = args.group_size, args.num_in_group
    return [i for i in range(args.layers) if i % g >= g - n]


def _prepare(method, model, args, device):
    """The step's callable model for ``method`` (the model itself, changed in place)."""
    layers = model.base_model.model.model.layers
    inner = "inductor" if device.type == "cuda" else "aot_eager"
    if method == "resident":
        return torch.compile(model, backend=inner)
    if method == "fx_offload":
        return torch.compile(model, backend="prefetch_offload", options=dict(
            group_size=args.group_size, num_in_group=args.num_in_group, inner_backend=inner))
    if method == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        if not torch.distributed.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            torch.distributed.init_process_group(
                "nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (1,))
        for i in _offloaded(args):
            fully_shard(layers[i], mesh=mesh,
                        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
        return model
    if method == "accelerate":
        from .baselines import accelerate_offload
        if not accelerate_offload(layers, _offloaded(args), device):
            return None
        return model
    raise SystemExit(f"unknown method {method!r}: one of {', '.join(METHODS)}")


def _step(run, model, opt, ids):
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _adapter_grads(run, model, ids):
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad and p.grad is not None and "lora" in n:
            g = p.grad.detach()
            g = g.full_tensor() if hasattr(g, "full_tensor") else g    # FSDP2's DTensors
            grads[n] = g.float().cpu().clone()
    model.zero_grad(set_to_none=True)
    return grads


def _row(method, args, device, ids, reference):
    model = _build(args, device)
    layers = model.base_model.model.model.layers
    copied = 0 if method == "resident" else 2 * sum(
        p.numel() * p.element_size() for i in _offloaded(args)
        for p in layers[i].parameters() if not p.requires_grad)
    run = _prepare(method, model, args, device)
    if run is None:
        return dict(method=method, note="not installed")
    grads = _adapter_grads(run, model, ids)
    diff = None
    if reference is not None and grads:
        diff = max((grads[n] - reference[n]).abs().max().item() /
                   max(reference[n].abs().max().item(), 1e-30) for n in reference if n in grads)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(2):
        _step(run, model, opt, ids)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        _step(run, model, opt, ids)
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    if method == "fx_offload":
        rep = report(model)
        if 2 * rep.offloaded_bytes != copied:
            print(f"note: fx_offload offloaded {rep.offloaded_bytes} bytes, the frozen weights "
                  f"of the layers asked for are {copied // 2}")
        # what the last step copied (its forward and backward): a layer still in its slot
        # where backward begins, or where the next forward begins, is not copied again
        copied = rep.copied_bytes_last_call or copied
        restore(model)
    out = dict(method=method, ms=1e3 * statistics.median(times), peak=peak, copied=copied,
               grads=grads, diff=diff)
    del run, model, opt
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu --quick for a smoke run")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ids = torch.randint(0, _config(args).vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(2)).to(device)
    link = None
    if device.type == "cuda":
        from .bench import h2d_bandwidth
        link = h2d_bandwidth(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f", {args.layers} layers, LoRA r={args.rank} on q/k/v/o, seq {args.seq} x batch "
          f"{args.batch}, offloaded layers {_offloaded(args)}"
          + (f", pinned H2D {link / 1e9:.1f} GB/s" if link else ""))
    print("| method | step ms | x bound | bound ms | copied GiB | peak GiB | adapter grads vs "
          "resident (max rel) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    reference = resident = None
    for method in methods:          # each row printed as it is measured
        r = _row(method, args, device, ids, reference)
        if method == "resident" and "grads" in r:
            reference, resident = r["grads"], r["ms"]
        if "ms" not in r:
            print(f"| {r['method']} | {r['note']} | - | - | - | - | - |", flush=True)
            continue
        bound = None
        if resident is not None:
            bound = max(resident, 1e3 * r["copied"] / link if link and r["copied"] else 0.0)
        ratio = "-" if bound is None else f"{r['ms'] / bound:.3f}"
        bound_ms = "-" if bound is None else f"{bound:.1f}"
        diff = "-" if r["diff"] is None else f"{r['diff']:.2e}"
        print(f"| {r['method']} | {r['ms']:.1f} | {ratio} | {bound_ms} | "
              f"{r['copied'] / 2**30:.2f} | {r['peak'] / 2**30:.2f} | {diff} |", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0
