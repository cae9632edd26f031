"""The ops of the host KV cache, in the ``fx_offload`` namespace.

    kv_begin(anchor, keys, values, pos, h, layers)
        at the top of the graph: a new call; begin the fills of ``layers`` (each slot's
        first).  ``anchor``: an empty tensor declared mutated, read by the updates of
        ``layers``, so no compiler drops the op or moves it below them
    kv_update(anchor, key, value, index, keys, values, next, h, layer, target) -> (k, v)
        in place of the layer's two ``index_copy_`` writes: the step's tokens written at
        ``index``, the layer's full keys and values returned (fresh tensors, what the
        attention reads), and ``target``'s fill begun (``next``: its keys, values and
        valid length; -1 and ``[]``: none)
    kv_attend(anchor, query, key, value, index, keys, values, mask, h, layer, scale) -> out
        in place of the two writes and the attention that reads the cache, for a layer whose
        attention runs on the host (:mod:`.host_attention`): the tokens written at ``index``
        straight into the host cache, the attention's output returned
    kv_join(acts, h)
        before the graph's output, tied to the outputs: every write-back has landed

``keys``/``values``/``pos`` are the graph inputs of the cache (host memory, and its valid
length); the ops read them and write the host cache through the write-back, which no
compiler is told about: nothing in the graph reads the host cache after the pass.
"""
from __future__ import annotations

import threading
import weakref

import torch

_LIB = torch.library.Library("fx_offload", "FRAGMENT")
_LIB.define("kv_begin(Tensor(a0!) anchor, Tensor[] keys, Tensor[] values, Tensor[] pos, "
            "SymInt handle, SymInt[] layers) -> ()")
_LIB.define("kv_update(Tensor anchor, Tensor key, Tensor value, Tensor index, Tensor keys, "
            "Tensor values, Tensor[] next, SymInt handle, SymInt layer, SymInt target) "
            "-> (Tensor, Tensor)")
_LIB.define("kv_attend(Tensor anchor, Tensor query, Tensor key, Tensor value, Tensor index, "
            "Tensor keys, Tensor values, Tensor? mask, SymInt handle, SymInt layer, "
            "float? scale) -> Tensor")
_LIB.define("kv_join(Tensor(a0!)[] activations, SymInt handle) -> ()")

_RUNTIMES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def register(runtime) -> None:
    with _LOCK:
        _RUNTIMES[runtime.handle] = runtime


def runtimes() -> list:
    """Every live host KV runtime."""
    with _LOCK:
        return list(_RUNTIMES.values())


def runtime_for(handle: int):
    runtime = _RUNTIMES.get(int(handle))
    if runtime is None:
        raise RuntimeError(f"fx_offload: host KV cache {handle} is gone (its model was "
                           "deleted); compile the model again")
    return runtime


def _begin(anchor, keys, values, pos, handle, layers):
    runtime = runtime_for(handle)
    runtime.begin_call()
    for layer, k, v, p in zip(layers, keys, values, pos):
        runtime.start(int(layer), k, v, p)


def _update(anchor, key, value, index, keys, values, nxt, handle, layer, target):
    return runtime_for(handle).update(int(layer), int(target), key, value, index, keys,
                                      values, nxt)


def _attend(anchor, query, key, value, index, keys, values, mask, handle, layer, scale):
    return runtime_for(handle).attend(int(layer), query, key, value, index, keys, values,
                                      mask, scale)


def _join(activations, handle):
    runtime_for(handle).join()


for _name, _kernel in (("kv_begin", _begin), ("kv_update", _update), ("kv_attend", _attend),
                      ("kv_join", _join)):
    _LIB.impl(_name, _kernel, "CompositeExplicitAutograd")
torch.library.register_fake("fx_offload::kv_begin", lambda *a, **k: None, lib=_LIB)
torch.library.register_fake("fx_offload::kv_join", lambda *a, **k: None, lib=_LIB)
torch.library.register_fake(
    "fx_offload::kv_update",
    lambda anchor, key, value, index, keys, values, nxt, handle, layer, target:
        (torch.empty_like(keys, memory_format=torch.contiguous_format),
         torch.empty_like(values, memory_format=torch.contiguous_format)), lib=_LIB)

torch.library.register_fake(
    "fx_offload::kv_attend",
    lambda anchor, query, key, value, index, keys, values, mask, handle, layer, scale:
        query.new_empty((*query.shape[:-1], values.shape[-1])), lib=_LIB)

BEGIN = torch.ops.fx_offload.kv_begin.default
UPDATE = torch.ops.fx_offload.kv_update.default
ATTEND = torch.ops.fx_offload.kv_attend.default
JOIN = torch.ops.fx_offload.kv_join.default
