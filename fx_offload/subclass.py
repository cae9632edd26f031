"""Tensor subclasses (torchao's quantized weights, say) as the plain tensors that hold their
bytes.

A quantized weight such as torchao's ``Int8Tensor`` is a wrapper: its logical shape and dtype
(``[4096, 4096]``, ``bfloat16``) hold no storage; its inner tensors (``qdata`` int8, ``scale``,
``zero_point``) do, and its operations read them through its own kernels.  What moves
between host and device is those inner tensors, as they are: each is a part of the weight,
laid out in the host block and the slot like a parameter of its own and keyed
``"<suffix>:<inner name>"``; the weight object stays, and its inner tensors' ``.data`` point at
the host block or the slot (:class:`~fx_offload.selection.params.OffloadedParam`).  Read
through ``__tensor_flatten__`` / ``__tensor_unflatten__``, the protocol torch.compile itself
uses for subclasses.
"""
from __future__ import annotations

import torch

from .errors import OffloadError

PART = ":"          # "<parameter suffix>:<inner tensor name>"


def is_subclass(t: torch.Tensor) -> bool:
    """True for a wrapper tensor subclass, one that keeps its bytes in inner tensors
    (``__tensor_flatten__``; a ``Parameter`` around one has the subclass's type).  A subclass
    that holds its own storage (``as_subclass``) moves as a plain tensor.  Read from the
    type alone: an operation on the wrapper (``.data`` is one) may check its inner tensors'
    devices against its own."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and \
        hasattr(type(t), "__tensor_flatten__")


def inner_names(t: torch.Tensor, name: str) -> tuple[str, ...]:
    """The inner tensors holding ``t``'s bytes; ``()`` for a plain tensor.  Raises a clear
    error for a subclass whose bytes cannot be reached this way."""
    if not is_subclass(t):
        return ()
    kind = f"{type(t).__module__}.{type(t).__qualname__}"
    names = tuple(t.__tensor_flatten__()[0])
    inner = [getattr(t, n, None) for n in names]
    if not names or any(not isinstance(x, torch.Tensor) or type(x.data) is not torch.Tensor
                        for x in inner):
        raise OffloadError(
            f"parameter {name} is a {kind}, a tensor subclass whose bytes are not plain inner "
            "tensors (subclasses within it, or none): it cannot be offloaded. Keep it "
            "resident with offload_params naming the other parameters")
    return names


def parts(t: torch.Tensor, key: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Key -> plain tensor of ``t``'s bytes: ``{key: t}``, or its inner tensors."""
    if not names:
        return {key: t}
    return {f"{key}{PART}{n}": getattr(t, n) for n in names}


def nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds: its own, or its inner tensors' (a wrapper's logical size holds
    none)."""
    if not is_subclass(t):
        return t.numel() * t.element_size()
    return sum(nbytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])


def rebuild(like: torch.Tensor, inner: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor of ``like``'s subclass and metadata around the tensors ``inner`` (name ->
    tensor): the weight's value as a host block or a slot holds it."""
    _, ctx = like.__tensor_flatten__()
    return type(like).__tensor_unflatten__(inner, ctx, like.shape, like.stride())


def mismatch(target: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why ``value`` cannot be copied into ``target`` byte for byte as a tensor subclass
    (another kind, inner tensors of other shapes or dtypes), or None where it can or neither
    is a subclass."""
    if not is_subclass(target) and not is_subclass(value):
        return None
    kind = type(target).__qualname__
    if type(value) is not type(target):
        return (f"is of kind {kind}, got {type(value).__qualname__}: give a tensor of the "
                "same kind")
    names = target.__tensor_flatten__()[0]
    for n in names:
        a, b = getattr(target, n), getattr(value, n, None)
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return (f"is of kind {kind}, its {n} {a.dtype} {tuple(a.shape)}, got "
                    f"{getattr(b, 'dtype', None)} {tuple(getattr(b, 'shape', ()))}: quantize the "
                    "new weight as the model's was")
    return None
