"""What the offloaded parameters' version counters say: autograd moves a tensor's counter at
every in-place write, so a layer whose counters moved since its copy holds stale bytes in
its slot (reloaded as a call begins), and a fill of the ring of :mod:`.ahead` begun before
is not used.  A mixin of :class:`~.ownership.Ownership`, which sets ``_call_versions`` (the
memo of one call), ``_dtensor_params``, ``_saved``, ``_copied`` and ``_taken_up``."""
from __future__ import annotations

import logging

from .. import dtensor

log = logging.getLogger("fx_offload")


class ParamVersions:
    """The version counters of each offloaded layer's parameters (a mixin)."""

    def _versions(self, layer: int) -> tuple:
        """The version counters of ``layer``'s parameters.  Inside a call they are read once
        (each start and load of a chunk records them: for a quantized layer that is a walk
        of every inner tensor): nothing writes the parameters while the graph runs, and a
        call's look at what the user changed begins the memo afresh."""
        if (memo := self._call_versions) is None:
            return self._read_versions(layer)
        if layer not in memo:
            memo[layer] = self._read_versions(layer)
        return memo[layer]

    def _reload_stale(self, layers: set[int]) -> None:
        """Reload what a slot holds of a layer changed since its copy (or in ``layers``);
        chunks overwritten since are forgotten: copied afresh anyway."""
        self._copied = {k: v for k, v in self._copied.items() if k in self.contents.slot(k[0])}
        for (layer, index), seen in list(self._copied.items()):
            if layer in layers or seen != self._versions(layer):
                log.debug("fx_offload: layer %d changed since its chunk %d was copied; "
                          "reloading it", layer, index)
                self._load_now(layer, self.contents.chunks(layer, index)[0])

    def _changed_since(self, layer: int, versions) -> bool:
        """``layer``'s weights changed since its version counters read ``versions`` (or
        the call's look copied new values into its host block)."""
        return layer in self._taken_up or versions != self._versions(layer)

    def _read_versions(self, layer: int) -> tuple:
        if not self.dtensor_params:          # every call: plain parameters stay cheap
            return tuple(p.versions() for p in self.params[layer])
        # a DTensor parameter's own counter too: a write through it leaves its shard's
        # alone; and the counters of the DTensors state_dict gave for it (saved_dtensor)
        return tuple((p.versions(), dtensor.version(p.owner, p.attr),
                      _saved_version(self._saved.get(p.name))) for p in self.params[layer])

    def saved_dtensor(self, p, param, truth):
        """What ``state_dict`` gives for the offloaded DTensor parameter ``param`` whose true
        shard is ``truth``: a DTensor around it, the same one while the truth is the same
        tensor.  A write through that DTensor moves only its own version counter (not its
        shard's, not the parameter's), so it is kept here, and the counters read at each
        call include it: the next call then loads the layer anew, as after a write through
        the parameter."""
        entry = self._saved.get(p.name)
        if entry is None or entry[1] is not truth or \
                entry[0]._local_tensor.data_ptr() != truth.data_ptr():
            # a truth replaced (a load with assign=True, another thread's call): its
            # writes so far stay counted
            retired = _saved_version(entry)
            entry = self._saved[p.name] = (dtensor.as_saved(param, truth), truth, retired)
        return entry[0]

    @property
    def dtensor_params(self) -> list:
        """(owner, attribute) of the offloaded DTensor parameters, found once."""
        if self._dtensor_params is None:
            self._dtensor_params = [
                (p.owner, p.attr) for ps in self.params.values() for p in ps
                if dtensor.is_dtensor(p.owner._parameters.get(p.attr))]
        return self._dtensor_params

    def rewrap(self) -> None:
        """DTensor parameters describe their shards' storage again (see ``dtensor``)."""
        for owner, attr in self.dtensor_params:
            dtensor.rewrap(owner, attr)


def _saved_version(entry) -> int:
    """Writes through the DTensors ``state_dict`` gave for one parameter (its entry in
    ``saved_dtensor``'s table, or None)."""
    return 0 if entry is None else entry[0]._version + entry[2]
