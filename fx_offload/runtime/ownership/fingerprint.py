"""A cheap test, run as each call begins, that nothing was done to the offloaded parameters
since the last full look at them (:meth:`~.ownership.Ownership.look`).  Between calls the
user rarely touches the weights, so while the test holds the full look is skipped.

A :class:`Fingerprint` keeps, per parameter, the object its module holds, its storage
address, autograd's version counter (every in-place write moves it) and its shape.  A
tensor subclass (a quantized weight) is fingerprinted by its inner tensors (the objects
its attributes hold, their storage, version and shape) and by its own version counter,
which is what moves when it is written through its API (torchao's ``copy_`` writes the
inner tensors below autograd), and so is its host twin (``OffloadedParam.host``), which
the module holds between calls on a GPU.  A DTensor's shard is written around the counters
this reads, so a model with DTensor parameters always takes the full look.  Why the look's
host time matters: docs/routed_experts.md, the paragraph "One host cost was ours".
"""
from __future__ import annotations


class Fingerprint:
    """What the offloaded parameters of one model were when last looked at in full."""

    def __init__(self, params: dict):
        self._plain = []        # (the module's parameters, the name there, the parameter)
        self._held = []         # (the module's parameters, the name there) of a subclass
        self._inner = []        # (a subclass, an inner tensor's name): read anew each look,
        self._wrappers = []     # as one may be set anew; subclasses whose counter is watched
        for ps in params.values():
            for p in ps:
                if not p.inner:
                    self._plain.append((p.owner._parameters, p.attr, p.param))
                    continue
                self._held.append((p.owner._parameters, p.attr))
                for w in (p.param,) if p.host is None else (p.param, p.host):
                    self._wrappers.append(w)
                    self._inner += [(w, n) for n in p.inner]
        self._seen = self._now()

    @staticmethod
    def applies(params: dict, special: bool) -> bool:
        """A fingerprint can stand for the full look (``special``: some parameters are
        DTensors, or others are handed over)."""
        return not special

    def _now(self) -> tuple:
        # comprehensions, no calls of ours: this runs at every call
        return ([(id(owned.get(attr)), t.data_ptr(), t._version, t.shape)
                 for owned, attr, t in self._plain],
                [id(owned.get(attr)) for owned, attr in self._held],
                [(id(t), t.data_ptr(), t._version, t.shape)
                 for w, n in self._inner for t in (getattr(w, n),)],
                [w._version for w in self._wrappers])

    def unchanged(self) -> bool:
        """Every parameter is the object, storage, version and shape last seen."""
        return self._now() == self._seen
