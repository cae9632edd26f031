"""What users pick today, for the benchmark: a forward-hook prefetcher in the monkeypatching
style, and accelerate's ``cpu_offload``.  Both run the model eagerly, as their users do."""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.memory.host_memory import HostBlock


class HookPrefetcher:
    """Offloaded layers share ``slots`` device slots (one tensor per parameter each, used
    circularly); a layer's forward pre-hook waits for its copy, its forward hook starts the
    copy of the layer that takes its slot next on a side stream (the pattern of hand-written
    offloaders that patch ``forward``: a whole layer copied at the point a hook sees)."""

    def __init__(self, layers: nn.ModuleList, offloaded: list[int], device, slots: int = 1):
        self.device = torch.device(device)
        self.order = list(offloaded)
        self.k = min(slots, len(self.order))
        self.stream = torch.cuda.Stream(self.device)
        self.blocks, self.done = {}, {}
        first = layers[self.order[0]]
        self.slots = [{n: torch.empty_like(p) for n, p in first.named_parameters()}
                      for _ in range(self.k)]
        for pos, i in enumerate(self.order):
            params = dict(layers[i].named_parameters())
            self.blocks[i] = HostBlock(params)
            with torch.no_grad():
                for name, p in params.items():
                    p.data = self.slots[pos % self.k][name]
            layers[i].register_forward_pre_hook(self._pre(i))
            layers[i].register_forward_hook(self._post(pos))
        for i in self.order[:self.k]:
            self._copy(i)
        torch.cuda.synchronize(self.device)

    def _copy(self, i):
        slot = self.slots[self.order.index(i) % self.k]
        for name, master in self.blocks[i].views.items():
            slot[name].copy_(master, non_blocking=True)

    def _pre(self, i):
        def hook(module, args):
            event = self.done.pop(i, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        return hook

    def _post(self, pos):
        nxt = self.order[(pos + self.k) % len(self.order)]
        if nxt == self.order[pos]:
            return lambda module, args, output: None      # alone in its slot

        def hook(module, args, output):
            fork = torch.cuda.Event()
            fork.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(fork)
            with torch.cuda.stream(self.stream):
                self._copy(nxt)
                done = torch.cuda.Event()
                done.record(self.stream)
            self.done[nxt] = done
        return hook


def accelerate_offload(layers: nn.ModuleList, offloaded: list[int], device) -> bool:
    """accelerate's ``cpu_offload`` on each offloaded layer; False if accelerate is missing."""
    try:
        from accelerate import cpu_offload
    except ImportError:
        return False
    for i in offloaded:
        cpu_offload(layers[i], execution_device=torch.device(device))
    return True


# DeepSpeed keeps a parameter of fewer elements than this on the device (its default for
# ``stage3_param_persistence_threshold``, set here so the copied bytes can be counted).
DEEPSPEED_RESIDENT_BELOW = 100_000


def deepspeed_zero3(model: nn.Module, batch: int, device):
    """DeepSpeed's ZeRO-3 engine over ``model``, every parameter of at least
    ``DEEPSPEED_RESIDENT_BELOW`` elements offloaded to pinned host memory (``offload_param``,
    the ZeRO-Infinity path; one rank) and gathered onto the device per module for forward and
    backward; torch's AdamW over the trainable parameters.  None if DeepSpeed is missing.
    ZeRO-3 has no choice of layers: it offloads the whole model it wraps."""
    try:
        import deepspeed
    except ImportError:
        return None
    import os
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(name, value)
    deepspeed.init_distributed(dist_backend="nccl" if torch.device(device).type == "cuda"
                               else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "stage3_param_persistence_threshold": DEEPSPEED_RESIDENT_BELOW,
        },
        # torch's AdamW, as every other row (DeepSpeed's own Adam is a compiled extension)
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def deepspeed_full_grad(param):
    """The whole gradient of a ZeRO-3 parameter after backward (each rank holds a part)."""
    from deepspeed.utils import safe_get_full_grad
    return safe_get_full_grad(param)
