"""What ``compress="lossless"`` does to the planner's copy times: the fraction of the offloaded
bytes a copy moves, sampled from the model's own weights, and the decode's rate.

A copy of a compressed layer takes ``max(moved bytes / H2D bandwidth, raw bytes / decode
rate)``: the link and the decode run on their own streams, one chunk apart
(:mod:`fx_offload.runtime.memory.compressed`, decoding with :mod:`fx_offload.codecs`).
"""
from __future__ import annotations

import torch

from ..codecs import ans, codec_for, lossless
from .stack import LayerStack

# measured on normal(0, 0.02) bf16 weights of Llama-3-8B shape, per codec (the measurements:
# docs/notes/2026-11-24-lossless-compression.md):
# what a sample of weights that are not there yet (on the meta device) is taken to give
ASSUMED_RATIO = {lossless.NAME: 0.752, ans.NAME: 0.691}
# bytes of bf16 written per second: the decodes on the H200, chunk by chunk as the copies
# decode (the same notes); the CPU's torch-ops decode measured here
DECODE_RATE = {lossless.NAME: 5.9e11, ans.NAME: 4.9e11, "cpu": 1.3e11}
SAMPLE_WORDS = 1 << 20


def copy_fraction(stack: LayerStack, compress: str, device: torch.device) -> float:
    """Bytes a copy moves per offloaded byte of ``stack``'s layers: 1.0 uncompressed; else the
    bf16 share at the ratio of a sample of the largest bf16 weight (a record of its first
    ``SAMPLE_WORDS`` words, by the codec of ``device``'s copies), the rest raw."""
    if compress != "lossless":
        return 1.0
    bf16 = other = 0
    largest = None
    for layer in stack.modules:
        for p in layer.parameters():
            nbytes = p.numel() * p.element_size()
            if type(p.data) is torch.Tensor and p.dtype == torch.bfloat16:
                bf16 += nbytes
                if largest is None or p.numel() > largest.numel():
                    largest = p
            else:
                other += nbytes
    if not bf16:
        return 1.0
    codec = codec_for(device)
    ratio = ASSUMED_RATIO[codec.NAME]
    if largest.device.type != "meta":
        words = largest.detach().reshape(-1)[:SAMPLE_WORDS].cpu().contiguous()
        made = codec.encode(words.view(torch.uint8),
                            device if device.type == "cuda" else None)
        ratio = 1.0 if made is None else made[1].nbytes / made[1].raw_nbytes
    return (bf16 * ratio + other) / (bf16 + other)


def decode_rate(device: torch.device) -> float:
    return DECODE_RATE["cpu"] if device.type != "cuda" else DECODE_RATE[codec_for(device).NAME]
