"""What users pick today, for the benchmark: a forward-hook prefetcher in the monkeypatching
style, and accelerate's ``cpu_offload``.  Both run the model eagerly, as their users do."""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.host_memory import HostBlock


class HookPrefetcher:
    """Offloaded layers share one device slot per parameter; a layer's forward pre-hook waits
    for its copy, its forward hook starts the next offloaded layer's copy on a side stream
    (the pattern of hand-written offloaders that patch ``forward``)."""

    def __init__(self, layers: nn.ModuleList, offloaded: list[int], device):
        self.device = torch.device(device)
        self.order = list(offloaded)
        self.stream = torch.cuda.Stream(self.device)
        self.blocks, self.done = {}, {}
        first = layers[self.order[0]]
        self.slot = {n: torch.empty_like(p) for n, p in first.named_parameters()}
        for i in self.order:
            params = dict(layers[i].named_parameters())
            self.blocks[i] = HostBlock(params)
            with torch.no_grad():
                for name, p in params.items():
                    p.data = self.slot[name]
            layers[i].register_forward_pre_hook(self._pre(i))
            layers[i].register_forward_hook(self._post(i))
        self._copy(self.order[0])
        torch.cuda.synchronize(self.device)

    def _copy(self, i):
        for name, master in self.blocks[i].views.items():
            self.slot[name].copy_(master, non_blocking=True)

    def _pre(self, i):
        def hook(module, args):
            event = self.done.pop(i, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        return hook

    def _post(self, i):
        nxt = self.order[(self.order.index(i) + 1) % len(self.order)]

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
