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
* ``accelerate``: accelerate's ``cpu_offload`` hooks on the same layers (eager);
* ``deepspeed``: DeepSpeed's ZeRO-3 engine with its parameters on the host (``offload_param``,
  one rank, eager), if DeepSpeed is installed.  It has no choice of layers: every parameter of
  at least 100k elements is offloaded, so it copies more than the other rows;
* ``fx_offload-graphs`` (not run unless asked): ``fx_offload`` with ``mode="reduce-overhead"``.

``copied GiB``: for ``fx_offload`` what its last timed step copied (``report``'s
``copied_bytes_last_call``, forward and backward: the layers a slot still holds where the
backward begins, or the next forward, are not copied again); for the other offloaded rows the
frozen weights of the offloaded layers, twice (forward, and backward for the input gradients);
for ``deepspeed`` every offloaded parameter twice, the embedding once.

Each row prints two times after two warm-up steps: ``step ms``, the median of ``--steps``
steps each waited for (a loop that reads the loss every step), and ``loop ms``, the mean of
``--steps`` steps timed as one stretch with no wait between them (a loop that never reads
it, as Hugging Face's ``Trainer`` between its logging steps: what a step queues runs on into
the next); the peak device memory; and the bound: the larger of the resident step and the
row's copied bytes over the pinned host-to-device rate measured in the same process.  The adapters'
gradients of the first step (the first warm-up step) are compared with the resident row's.
``--device cpu --quick`` is a smoke run (a tiny model, 4 layers, 64 tokens, one timed step,
``aot_eager``, no bound).
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

METHODS = ("resident", "fx_offload", "fsdp2", "accelerate", "deepspeed")
EXTRA_METHODS = ("fx_offload-graphs",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: 16; 4 with --quick)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per training sequence (default: 2048; 64 with --quick)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank on q/k/v/o")
    parser.add_argument("--group-size", type=int, default=4, help="group_size of the offload")
    parser.add_argument("--num-in-group", type=int, default=3,
                        help="num_in_group: offloaded layers of each group")
    parser.add_argument("--steps", type=at_least(1, "timed steps"), default=None,
                        help="timed steps of each row, each way (waited for one by one, then "
                             "as one stretch), after two warm-up steps (default: 5; 1 with "
                             "--quick)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated among " + ", ".join(METHODS + EXTRA_METHODS) +
                             " (default: all but " + ", ".join(EXTRA_METHODS) + ")")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, 4 layers, 64 tokens, one timed step (with --device "
                             "cpu: a smoke run of under a minute a row)")


# (layers, seq, steps) left unset: the full run's, or --quick's
DEFAULTS, QUICK = (16, 2048, 5), (4, 64, 1)


def _sizes(args) -> None:
    """Fill in the sizes the command line left unset (:data:`DEFAULTS`, or :data:`QUICK`)."""
    for name, value in zip(("layers", "seq", "steps"), QUICK if args.quick else DEFAULTS):
        if getattr(args, name) is None:
            setattr(args, name, value)


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
    if method in ("fx_offload", "fx_offload-graphs"):
        graphs = dict(mode="reduce-overhead") if method == "fx_offload-graphs" else {}
        return torch.compile(model, backend="prefetch_offload", options=dict(
            group_size=args.group_size, num_in_group=args.num_in_group, inner_backend=inner,
            **graphs))
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
    raise SystemExit(f"unknown method {method!r}: one of {', '.join(METHODS + EXTRA_METHODS)}")


class _Step:
    """One training step of a row, in two halves: ``backward`` (forward and backward) and
    ``update`` (the optimizer's step, gradients cleared); ``grad(p)`` reads a gradient after
    ``backward``."""

    def __init__(self, method, model, args, device, ids):
        self.ids, self.engine = ids, None
        if method == "deepspeed":
            from .baselines import deepspeed_zero3
            self.engine = deepspeed_zero3(model, args.batch, device)
            self.run = self.engine
        else:
            self.run = _prepare(method, model, args, device)
            self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                         lr=1e-4)

    def backward(self):
        loss = self.run(input_ids=self.ids, labels=self.ids).loss
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def update(self):
        if self.engine is not None:
            self.engine.step()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def grad(self, p):
        if self.engine is not None:
            from .baselines import deepspeed_full_grad
            return deepspeed_full_grad(p)
        g = p.grad
        return g.full_tensor() if hasattr(g, "full_tensor") else g     # FSDP2's DTensors


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copied(method, model, args) -> int:
    """The bytes a step copies, counted from the model before it is changed (``fx_offload``'s
    own count replaces it after the run)."""
    if method == "resident":
        return 0
    if method == "deepspeed":
        from .baselines import DEEPSPEED_RESIDENT_BELOW
        embedding = model.get_input_embeddings().weight
        return sum((1 if p is embedding else 2) * p.numel() * p.element_size()
                   for p in model.parameters() if p.numel() >= DEEPSPEED_RESIDENT_BELOW)
    layers = model.base_model.model.model.layers
    return 2 * sum(p.numel() * p.element_size() for i in _offloaded(args)
                   for p in layers[i].parameters() if not p.requires_grad)


def _row(method, args, device, ids, reference):
    model = _build(args, device)
    copied = _copied(method, model, args)
    names = [n for n, p in model.named_parameters() if p.requires_grad and "lora" in n]
    step = _Step(method, model, args, device, ids)
    if step.run is None:
        return dict(method=method, note="not installed")
    step.backward()         # the first warm-up step: its gradients are compared
    params = dict(model.named_parameters())
    grads = {}
    for n in names:
        g = step.grad(params[n])
        if g is not None:
            grads[n] = g.detach().float().cpu().clone()
    step.update()
    diff = None
    if reference is not None and grads:
        diff = max((grads[n] - reference[n]).abs().max().item() /
                   max(reference[n].abs().max().item(), 1e-30) for n in reference if n in grads)
    step.backward()
    step.update()
    _sync(device)
    if device.type == "cuda":     # what the model was built in is cached, not needed
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # each step waited for, then one stretch of steps: the copies begun as a step ends run
    # on into the next
    times = []
    for n in [1] * args.steps + [args.steps]:
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            step.backward()
            step.update()
        _sync(device)
        times.append((time.perf_counter() - start) / n)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    # CUDA graphs' private pools hold their memory as reserved, not allocated
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    if method.startswith("fx_offload"):
        rep = report(model)
        if 2 * rep.offloaded_bytes != copied:
            print(f"note: fx_offload offloaded {rep.offloaded_bytes} bytes, the frozen weights "
                  f"of the layers asked for are {copied // 2}")
        # what the last step copied (its forward and backward): a layer still in its slot
        # where backward begins, or where the next forward begins, is not copied again
        copied = rep.copied_bytes_last_call or copied
        restore(model)
    out = dict(method=method, ms=1e3 * statistics.median(times[:-1]), loop=1e3 * times[-1],
               peak=peak,
               reserved=reserved, copied=copied,
               grads=grads, diff=diff)
    del step, model
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(args) -> int:
    _sizes(args)
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
    print("| method | step ms | x bound | loop ms | x bound | bound ms | copied GiB | peak GiB "
          "| reserved GiB | adapter grads vs resident (max rel) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    reference = resident = None
    for method in methods:          # each row printed as it is measured
        r = _row(method, args, device, ids, reference)
        if method == "resident" and "grads" in r:
            reference, resident = r["grads"], r["ms"]
        if "ms" not in r:
            print(f"| {r['method']} | {r['note']} |" + " - |" * 8, flush=True)
            continue
        bound = None
        if resident is not None:
            bound = max(resident, 1e3 * r["copied"] / link if link and r["copied"] else 0.0)
        ratio = "-" if bound is None else f"{r['ms'] / bound:.3f}"
        loop_ratio = "-" if bound is None else f"{r['loop'] / bound:.3f}"
        bound_ms = "-" if bound is None else f"{bound:.1f}"
        diff = "-" if r["diff"] is None else f"{r['diff']:.2e}"
        print(f"| {r['method']} | {r['ms']:.1f} | {ratio} | {r['loop']:.1f} | {loop_ratio} | "
              f"{bound_ms} | "
              f"{r['copied'] / 2**30:.2f} | {r['peak'] / 2**30:.2f} | "
              f"{r['reserved'] / 2**30:.2f} | {diff} |", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0
