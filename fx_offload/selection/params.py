"""Which parameters of the chosen layers are offloaded (all, or those ``offload_params``
names; a parameter shared with anything else stays resident)."""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Iterable

import torch
from torch import nn

from .. import dtensor, subclass
from ..errors import OffloadError
from .stack import LayerStack

log = logging.getLogger("fx_offload")
NAMES_SHOWN = 8                 # parameter names an error quotes as examples


def matches_segments(name: str, patterns: Iterable[str]) -> bool:
    """True if ``name`` contains one of ``patterns`` as whole dotted segments:
    ``w13_weight`` matches ``mlp.experts.w13_weight``, not ``mlp.experts.w13_weight_scale``."""
    segments = name.split(".")
    for pattern in patterns:
        want = pattern.split(".")
        for start in range(len(segments) - len(want) + 1):
            if segments[start:start + len(want)] == want:
                return True
    return False


@dataclasses.dataclass
class OffloadedParam:
    name: str            # full dotted name from the model root
    suffix: str          # name inside its layer ("mlp.fc1.weight"), its key in the slot
    param: nn.Parameter
    owner: nn.Module     # the module whose attribute it is
    attr: str            # its attribute name there ("weight")
    inner: tuple[str, ...] = ()     # a tensor subclass's inner tensors (fx_offload.subclass)
    host: torch.Tensor | None = None    # its twin between calls where the host is elsewhere
    _twin_base: tuple[int, ...] = ()    # the twin's version counters when it was made
    _device_of: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    _device_read: torch.device | None = dataclasses.field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts().values())

    def parts(self, value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Key in the host block and the slot -> plain tensor holding bytes of ``value`` (the
        parameter by default): itself, or a tensor subclass's inner tensors."""
        return subclass.parts(self.param if value is None else value, self.suffix, self.inner)

    def point_at(self, views: dict[str, torch.Tensor], value: torch.Tensor | None = None):
        """Make the parameter (or ``value``) hold ``views`` (keyed as :meth:`parts`): its
        ``.data``, or its inner tensors' ``.data``; the object itself stays."""
        if not self.inner:              # every call, every parameter: the short way
            (self.param if value is None else value).data = views[self.suffix]
            return
        target = self.param if value is None else value
        for n, key in zip(self.inner, self._inner_keys):    # read anew: one may be set anew
            getattr(target, n).data = views[key]
        if value is None:
            self.owner._parameters[self.attr] = self._holder_of(views)

    @functools.cached_property
    def _inner_keys(self) -> tuple[str, ...]:
        return tuple(f"{self.suffix}{subclass.PART}{n}" for n in self.inner)

    @property
    def _device(self) -> torch.device:
        """The weight object's device, read once per object: a tensor subclass's attributes
        go through its ``__torch_function__``, which costs microseconds at every call."""
        if self._device_of is not self.param:
            self._device_of, self._device_read = self.param, self.param.device
        return self._device_read

    def _holder_of(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """The object the owner holds while the parameter's bytes are ``views``.  A wrapper
        subclass's device is fixed when it is made, so on a GPU the weight (``param``) cannot
        hold its host block without saying ``cuda`` of bytes in host memory (``detach``,
        hence ``state_dict``, then fails); between calls the owner holds ``host``, the same
        kind of tensor made around the host block, and ``param`` (its inner tensors pointed
        at the host block too) comes back for each call, as the compiled graph saw it."""
        if next(iter(views.values())).device == self._device:
            return self.param
        return self.twin(views)

    def twin(self, masters: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The host twin around ``masters`` (made once), where the weight is a tensor
        subclass on another device than its host block; else None."""
        if self.host is None and self.inner and \
                next(iter(masters.values())).device != self._device:
            made = subclass.rebuild(self.param, {n: masters[key]
                                                 for n, key in zip(self.inner, self._inner_keys)})
            self.host = nn.Parameter(made, requires_grad=self.param.requires_grad)
            self._twin_base = self.versions(self.host)
        return self.host

    def value_in(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """The parameter's value as ``views`` (a host block's, a slot's) hold it."""
        if not self.inner:
            return views[self.suffix]
        return subclass.rebuild(self.param, {n: views[f"{self.suffix}{subclass.PART}{n}"]
                                             for n in self.inner})

    # Called for every parameter at every call: a plain parameter takes the short way.
    def ptrs(self, value: torch.Tensor | None = None) -> tuple[int, ...]:
        """Where the bytes of ``value`` (the parameter by default) are."""
        value = self.param if value is None else value
        if not self.inner:
            return (value.data_ptr(),)
        return tuple(t.data_ptr() for t in self.parts(value).values())

    def ptrs_in(self, views: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """Where ``views`` (a host block's, a slot's) hold this parameter's bytes."""
        if not self.inner:
            return (views[self.suffix].data_ptr(),)
        return tuple(views[key].data_ptr() for key in self.parts())

    def versions(self, value: torch.Tensor | None = None) -> tuple[int, ...]:
        """Autograd's version counters of ``value`` (the parameter by default): an in-place
        write moves one.  A tensor subclass's own counter moves when it is written through
        its API (``copy_``, ``load_state_dict``), which writes its inner tensors below
        autograd (their counters stay); theirs move when they are written directly."""
        if value is None and self.inner:    # a write through the host twin counts too
            return self.versions(self.param) + self._twin_versions()
        value = self.param if value is None else value
        if not self.inner:
            return (value._version,)
        return (value._version,) + tuple(t._version for t in self.parts(value).values())

    def _twin_versions(self) -> tuple[int, ...]:
        """The host twin's counters, counted from its making (zeros before): a layer's
        versions keep their length and value when the twin is made."""
        if self.host is None:
            return (0,) * (1 + len(self.inner))
        return tuple(a - b for a, b in zip(self.versions(self.host), self._twin_base))

    def fits(self, value: torch.Tensor | None, views: dict[str, torch.Tensor]) -> bool:
        """``value`` can take the place ``views`` (a host block's) have for the parameter:
        the same shape and dtype, and for a tensor subclass the same kind with inner tensors
        alike.  (Not the parameter object itself: ``.to(dtype)`` changes it in place.)"""
        if value is None:
            return False
        if not self.inner:
            # a tensor subclass (a quantized weight) in a plain weight's place holds its
            # bytes in inner tensors of other sizes: the layer is laid out anew
            view = views[self.suffix]
            return value.shape == view.shape and value.dtype == view.dtype and \
                not subclass.is_subclass(value)
        if type(value) is not type(self.param):
            return False
        return all(t.shape == views[k].shape and t.dtype == views[k].dtype
                   for k, t in self.parts(value).items())

    def current(self) -> nn.Parameter | None:
        """The parameter the owner holds now (``load_state_dict(assign=True)`` or an
        assignment may have put another one there); a DTensor's local shard; ``param`` where
        the owner holds its host twin."""
        held = dtensor.local(self.owner._parameters.get(self.attr))
        return self.param if held is not None and held is self.host else held

    def retwin(self, masters: dict[str, torch.Tensor]) -> torch.Tensor:
        """Point the host twin at ``masters`` again (an inner tensor of it was set anew);
        one moved to another device (``model.to`` swaps a subclass's whole contents) is made
        anew.  Returns the twin."""
        if self.host.device != next(iter(masters.values())).device:
            self.host = None
            return self.twin(masters)
        self.point_at(masters, self.host)
        return self.host

    def untwin(self) -> None:
        """Drop the host twin (the state detached); an owner holding it holds ``param``
        again (one holding a value the user gave keeps it)."""
        if self.host is not None and self.owner._parameters.get(self.attr) is self.host:
            self.owner._parameters[self.attr] = self.param
        self.host = None


def layer_bytes(params: dict[int, list[OffloadedParam]]) -> dict[int, int]:
    """Offloaded bytes of each layer."""
    return {layer: sum(p.nbytes for p in ps) for layer, ps in params.items()}


def trains_adapters(stack: LayerStack) -> bool:
    """The layers are in training mode and some of their parameters are frozen
    (``requires_grad=False``) while some are not: the trainable ones (adapters, norms) are
    then kept resident and only the frozen ones offloaded (``fx_offload.training``).  Where
    none is frozen (a model as built, used for inference under ``no_grad``), or in eval mode
    (a quantized model's weights are frozen, its biases not), every parameter may be
    offloaded."""
    if not any(layer.training for layer in stack.modules):
        return False
    grads = {p.requires_grad for layer in stack.modules for p in layer.parameters()}
    return grads == {True, False}


def select_params(root: nn.Module, stack: LayerStack, layers: Iterable[int],
                  patterns: tuple[str, ...] | None) -> dict[int, list[OffloadedParam]]:
    """Layer index -> its offloaded parameters among ``layers``: those matching ``patterns``
    (an ``offload_params`` value; None: all); layers left with none are skipped."""
    wanted = set(layers)
    owners: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)

    chosen: dict[int, list[OffloadedParam]] = {}
    any_match = False
    training = trains_adapters(stack)
    trained_whole = []      # layers kept resident: every parameter of them trains
    for index, layer in enumerate(stack.modules):
        if index not in wanted:
            continue
        path = stack.layer_path(index)
        picked = []
        for suffix, p in layer.named_parameters(remove_duplicate=False):
            if patterns is not None and not matches_segments(suffix, patterns):
                continue
            any_match = True
            if training and p.requires_grad:    # trained: stays on the device
                continue
            names = owners.get(id(p), [])
            if len(names) > 1:
                log.info("fx_offload: not offloading %s.%s: the parameter is shared with %s",
                         path, suffix, [n for n in names if n != f"{path}.{suffix}"])
                continue
            where, _, attr = suffix.rpartition(".")
            owner = layer.get_submodule(where) if where else layer
            # a DTensor parameter (tensor parallelism): this rank's shard is what moves
            local = dtensor.local(p)
            if local is not p and subclass.is_subclass(local):
                raise OffloadError(
                    f"parameter {path}.{suffix} is a DTensor around a tensor subclass "
                    f"({type(local).__qualname__}): offloading it is not supported; keep "
                    "it resident with offload_params naming the other parameters")
            picked.append(OffloadedParam(f"{path}.{suffix}", suffix, local, owner, attr,
                                         subclass.inner_names(local, f"{path}.{suffix}")))
        if picked:
            chosen[index] = picked
        elif training:
            trained_whole.append(path)
        else:
            log.debug("fx_offload: layer %s has no parameter to offload; skipped", path)
    if trained_whole:   # one line, so a user training the whole model sees why
        log.info("fx_offload: %d layer(s) kept resident, every parameter of them requires "
                 "grad (trained): %s", len(trained_whole), trained_whole)
    if patterns is not None and not any_match:
        sample = [n for n, _ in stack.modules[0].named_parameters()][:NAMES_SHOWN]
        raise OffloadError(
            f"option 'offload_params'={list(patterns)} matches no parameter of the selected "
            f"layers; parameter names inside a layer look like {sample}")
    return chosen

