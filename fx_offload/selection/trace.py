"""The planner's graph before any weight is on the device.

``memory_budget`` weighs the costs of the model's first graph, and at compile time that
graph comes with the call.  :func:`fx_offload.place` must choose before the weights move,
from example inputs, on a model whose weights may be on the meta device or in host memory
too large to run.  So the graph is traced from a *twin*: a ``copy.deepcopy`` of the model in
which every parameter and buffer is a meta tensor of the same shape (the copy allocates and
reads nothing), run by Dynamo on meta copies of the example inputs.  The planner needs shapes
and the graph's structure only; the model is not touched and nothing runs on a device.
"""
from __future__ import annotations

import copy
import inspect
import logging

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import OffloadError
from ..graph_inputs import read_graph_inputs
from ..options import OffloadOptions
from . import budget
from .stack import find_layer_stack, first_runs, in_run_order

log = logging.getLogger("fx_offload")
REASON_CHARS = 300              # of the failed trace's message


def _takes(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _offload_error_in(err: BaseException) -> OffloadError | None:
    """The OffloadError that ``err`` wraps, if any (its cause, or Dynamo's inner one)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OffloadError):
            return err
        seen.add(id(err))
        err = getattr(err, "inner_exception", None) or err.__cause__
    return None


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def plan_from_example(model: nn.Module, options: OffloadOptions, example_inputs,
                      device: torch.device) -> tuple[budget.PlannerResult, tuple[str, ...]]:
    """The planner's result for ``model`` on ``device``, from a trace of its twin on
    ``example_inputs`` (a tuple of positional arguments or a dict of keyword arguments), and
    the layer lists' paths in the order the trace ran them."""
    if example_inputs is None:
        raise OffloadError(
            "memory_budget weighs the model's graph: pass example_inputs=(input_ids,) (a tuple "
            "of positional arguments or a dict of keyword arguments, as the model is called) "
            "so that place() can trace it", where="fx_offload.place")
    args, kwargs = ((), dict(example_inputs)) if isinstance(example_inputs, dict) \
        else (tuple(example_inputs), {})
    if "use_cache" not in kwargs and _takes(model, "use_cache"):
        # a KV cache made on the meta device fails the trace; the plan weighs the weights
        kwargs["use_cache"] = False
    twin = meta_twin(model)
    found = []

    def capture(gm, inputs):
        if not found:
            gi = read_graph_inputs(gm, inputs)
            if gi.root is twin and gi.params:
                stack = find_layer_stack(twin, options.layers)
                stack = in_run_order(stack, first_runs(stack, gm, gi))
                found.append((budget.plan_for(twin, stack, options, (gm, gi), False, device),
                              stack.paths))
        return gm.forward

    on_meta = tree_map(lambda v: torch.empty_like(v, device="meta")
                       if isinstance(v, torch.Tensor) else v, (args, kwargs))
    log.info("fx_offload: tracing %s on the meta device to plan memory_budget %s",
             type(model).__name__, options.memory_budget)
    try:
        with torch.no_grad():
            torch.compile(twin, backend=capture, dynamic=True)(*on_meta[0], **on_meta[1])
    except OffloadError:
        raise
    except Exception as err:
        ours = _offload_error_in(err)       # the planner's own (a budget too small), which
        if ours is not None:                # Dynamo wraps as the backend's failure
            raise ours.with_traceback(None) from None
        reason = (str(err).strip().splitlines() or [""])[0][:REASON_CHARS]
        raise OffloadError(
            f"memory_budget plans from a trace of {type(model).__name__} on the meta device, "
            f"and that trace failed ({type(err).__name__}: {reason}). Give example_inputs the "
            "model runs with on the meta device, or give group_size/num_in_group/prefetch_step "
            "instead", where="fx_offload.place"
        ) from err
    if not found:
        raise OffloadError(
            f"tracing {type(model).__name__} on example_inputs gave no graph that reads the "
            "model's parameters from its forward; give memory_budget at compile time instead "
            "(move the model to the device, then torch.compile it)", where="fx_offload.place")
    return found[0]
