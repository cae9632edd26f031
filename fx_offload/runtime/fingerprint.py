"""A cheap test, run as each call begins, that nothing was done to the offloaded parameters
since the last full look at them.

:meth:`~.ownership.Ownership._take_up_changes` looks at every parameter as a call begins
(new storage, an in-place write, a new object, a new shape): a few function calls each,
about 6 microseconds a parameter on a slow host.  A 48-layer MoE has over 500 of them, and
under CUDA graphs the device waits for that host time between decode steps.  Between calls
the user rarely touches the weights, so the full look leaves a :class:`Fingerprint` of what
it saw: per parameter, the object its module holds, its storage address, autograd's version
counter (every in-place write moves it) and its shape.  While the fingerprint taken now is
the same, the full look would find nothing to do, and is skipped.

Only plain parameters are fingerprinted: a tensor subclass's inner tensors and a DTensor's
shard are written around the counters this reads, so a model with either always takes the
full look.
"""
from __future__ import annotations


class Fingerprint:
    """What the offloaded parameters of one model were when last looked at in full."""

    def __init__(self, params: dict):
        self._entries = [(p.owner._parameters, p.attr, p.param)
                         for ps in params.values() for p in ps]
        self._seen = self._now()

    @staticmethod
    def applies(params: dict, special: bool) -> bool:
        """A fingerprint can stand for the full look: plain parameters only (``special``:
        some are DTensors, or other parameters are handed over)."""
        return not special and not any(p.inner for ps in params.values() for p in ps)

    def _now(self) -> list:
        # one comprehension, no calls of ours: this runs at every call
        return [(id(owned.get(attr)), t.data_ptr(), t._version, t.shape)
                for owned, attr, t in self._entries]

    def unchanged(self) -> bool:
        """Every parameter is the object, storage, version and shape last seen."""
        return self._now() == self._seen
