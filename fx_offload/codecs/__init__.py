"""The lossless codecs of ``compress="lossless"``: fx_offload's own (:mod:`.lossless`, which
decodes on the GPU and on the CPU) and nvCOMP's ANS (:mod:`.ans`, a GPU with nvCOMP
installed).  The runtime encodes each offloaded chunk's bf16 words once and decodes them
into the slot at every copy (:mod:`fx_offload.runtime.memory.compressed`); the planner samples a
codec's ratio (:mod:`fx_offload.selection.compression`).  Both import this package, never
each other."""
from __future__ import annotations

import torch

from . import ans, lossless


def codec_for(device: torch.device):
    """The codec of records copied to ``device`` (a module with ``NAME``, ``encode`` and
    ``decode``): nvCOMP's ANS on a GPU where nvCOMP is installed (:mod:`.ans`), else ours
    (:mod:`.lossless`, which also decodes on the CPU)."""
    return ans if ans.available(device) else lossless
