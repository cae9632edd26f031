"""Compile the rewritten graph with the chosen inner compiler."""
from __future__ import annotations

from typing import Callable

from torch import fx

from .errors import OffloadError
from .passes.in_place import call_in_place
from .options import OffloadOptions


def compile_inner(gm: fx.GraphModule, example_inputs, options: OffloadOptions,
                  backward=None) -> Callable:
    """``backward``: a :class:`~fx_offload.training.BackwardOps` where the backward reads
    offloaded weights (training a frozen offloaded base)."""
    if options.inner_backend == "eager":
        return gm.forward
    if options.inner_backend == "aot_eager":
        if backward is not None:
            return backward.aot_eager(gm, example_inputs, _in_place_nop)
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend("aot_eager")(gm, example_inputs, fw_compiler=_in_place_nop)
    import torch._inductor.config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx
    if inductor_config.freezing:
        raise OffloadError(
            "cannot be used with Inductor freezing "
            "(torch._inductor.config.freezing=True): freezing folds weights into constants, so "
            "offloaded layers would read stale copies; turn freezing off")
    patches = dict(list_mode_options(options.mode)) if options.mode != "default" else {}
    if backward is not None:
        return backward.inductor(gm, example_inputs, patches)
    return compile_fx(gm, example_inputs, config_patches=patches)


def _in_place_nop(gm: fx.GraphModule, example_inputs):
    """aot_eager's forward compiler (it runs the ATen graph as it is), our ops called in
    place first (passes.in_place: no functional form to run at every call)."""
    from torch._dynamo.backends.debugging import boxed_nop
    call_in_place(gm)
    return boxed_nop(gm, example_inputs)
