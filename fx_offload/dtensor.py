"""DTensor parameters (tensor parallelism): what is offloaded is each rank's local shard.

A model sharded with ``parallelize_module`` holds ``DTensor`` parameters; the graph reads
them as DTensors, and AOTAutograd hands the inner compiler their local shards.  The backend
offloads the local shard object (``param._local_tensor``): the host block and slot hold this
rank's shard only, and pointing the shard at a slot (``.data =``) is what the compiled graph
reads at each call.  Three things keep the DTensor around it honest:

* our ops take DTensor activations: they only order the graph, so they run on the local
  tensors (a handler in DTensor's dispatcher, no sharding strategy to propagate);
* the DTensor's own metadata (storage offset, device) follows its shard's (``rewrap``):
  Dynamo fakeifies a DTensor whose offset differs from its shard's through a path that
  fails, so a recompile while the shards sit in their slots would fail;
* an in-place write through the DTensor bumps only its own version counter, and a write
  through the shard only the shard's: both are read (``version``), and so are those of the
  DTensors ``state_dict`` gives for it (``ParamVersions.saved_dtensor``).
"""
from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:          # a torch built without distributed
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The local shard of a DTensor; anything else as it is."""
    return t._local_tensor if is_dtensor(t) else t


def version(owner, attr: str) -> int:
    """The version counter of the parameter ``owner.attr`` itself (a DTensor's own)."""
    return getattr(owner._parameters.get(attr), "_version", 0)


def rewrap(owner, attr: str) -> None:
    """Make the DTensor ``owner.attr`` describe its local shard's storage again after the
    shard was pointed at a slot; the shard object stays the one the backend offloads.

    A shard on the host (between calls, on a GPU mesh) is left undescribed: the DTensor
    keeps the device its graphs were compiled for, and ``DTensor.from_local`` would copy
    the shard to the GPU (every weight, every call).  The DTensor is built around the
    shard directly for that reason."""
    outer = owner._parameters.get(attr)
    if not is_dtensor(outer):
        return
    shard = outer._local_tensor
    if shard.device.type != outer.device_mesh.device_type:
        return
    if outer.storage_offset() == shard.storage_offset() and outer.device == shard.device:
        return
    with torch.no_grad():
        outer.data = _around(shard, outer)


def _around(shard: torch.Tensor, like) -> "DTensor":
    """A DTensor with ``like``'s mesh, placements and global shape around ``shard`` itself
    (no copy, whatever its device)."""
    return DTensor(shard, like._spec, requires_grad=False)


def as_saved(param, value: torch.Tensor) -> torch.Tensor:
    """What ``state_dict`` gives for an offloaded parameter whose true shard is ``value``:
    a DTensor around it for a DTensor parameter (sharing its version counter, so that
    ``torch.distributed.checkpoint.load`` writing into it is seen), else ``value``."""
    if not is_dtensor(param):
        return value
    return _around(value.detach(), param)


def mismatch(target, value) -> str | None:
    """Why ``value`` cannot be written into the parameter ``target`` where either is a
    DTensor, or None: a DTensor parameter takes a DTensor placed as it is, or a whole
    tensor (sharded here); a plain one takes no DTensor."""
    if not is_dtensor(target):
        return "is a plain tensor, got a DTensor: give value.full_tensor()"
    if not is_dtensor(value):
        return None
    if value.device_mesh != target.device_mesh or \
            tuple(value.placements) != tuple(target.placements):
        return (f"is a DTensor placed {tuple(target.placements)} on {target.device_mesh}, got "
                f"one placed {tuple(value.placements)} on {value.device_mesh}: give "
                "value.redistribute(param.device_mesh, param.placements), or the whole "
                "tensor")
    return None


def placed_like(target, value):
    """``value`` as a DTensor placed as the DTensor ``target``: itself, or this rank's part
    of a whole tensor, cut here (every rank gives the whole tensor; nothing is sent)."""
    if is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)


def register_op_handlers(ops) -> None:
    """Run our ops on the local tensors of DTensor arguments (they read no values)."""
    if DTensor is None:
        return
    from torch.utils._pytree import tree_map_only

    def on_local(op_call, args, kwargs):
        return op_call(*tree_map_only(DTensor, local, args),
                       **tree_map_only(DTensor, local, kwargs))
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in ops:
        handlers[op] = on_local
