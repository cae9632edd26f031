"""What the offloaded parameters' version counters say: autograd moves a tensor's counter at
every in-place write, so a layer whose counters moved since its copy holds stale bytes in
its slot (reloaded as a call begins), and a fill of the ring of :mod:`.ahead` begun before
is not used.  :class:`ParamVersions` is the state's ``versions``: built from the offloaded
parameters alone, it keeps the memo of one call, what each chunk in a slot was copied at,
and the layers whose values the latest look at the user's changes copied in."""
from __future__ import annotations

import logging

from ... import dtensor

log = logging.getLogger("fx_offload")


class ParamVersions:
    """The version counters of each offloaded layer's parameters (``params``: layer -> its
    ``OffloadedParam`` list)."""

    def __init__(self, params: dict):
        self.params = params
        self.memo: dict[int, tuple] | None = None   # during a call: of()'s, read once
        # (layer, chunk) -> the layer's parameters' versions when that chunk was copied: a
        # slot may hold chunks of one layer copied at different times (a refill skips those
        # it holds), so each is checked on its own
        self.copied: dict[tuple[int, int], tuple] = {}
        self.taken_up: set[int] = set()     # layers whose values the latest look copied in
        self._dtensor_params: list | None = None  # (owner, attr) of DTensor parameters
        self._saved: dict = {}  # name -> the DTensor state_dict gives for it (versions)

    def of(self, layer: int) -> tuple:
        """The version counters of ``layer``'s parameters.  Inside a call they are read once
        (each start and load of a chunk records them: for a quantized layer that is a walk
        of every inner tensor): nothing writes the parameters while the graph runs, and a
        call's look at what the user changed begins the memo afresh."""
        if (memo := self.memo) is None:
            return self.read(layer)
        if layer not in memo:
            memo[layer] = self.read(layer)
        return memo[layer]

    def note_copy(self, layer: int, index: int) -> None:
        """``layer``'s chunk ``index`` was copied into its slot now."""
        self.copied[(layer, index)] = self.of(layer)

    def reload_stale(self, layers: set[int], contents, load) -> None:
        """``load(layer, chunk)`` what a slot holds (``contents``) of a layer changed since
        its copy (or in ``layers``); chunks overwritten since are forgotten: copied afresh
        anyway."""
        self.copied = {k: v for k, v in self.copied.items() if k in contents.slot(k[0])}
        for (layer, index), seen in list(self.copied.items()):
            if layer in layers or seen != self.of(layer):
                log.debug("fx_offload: layer %d changed since its chunk %d was copied; "
                          "reloading it", layer, index)
                load(layer, contents.chunks(layer, index)[0])

    def changed_since(self, layer: int, versions) -> bool:
        """``layer``'s weights changed since its version counters read ``versions`` (or
        the call's look copied new values into its host block)."""
        return layer in self.taken_up or versions != self.of(layer)

    def read(self, layer: int) -> tuple:
        """The counters as they are now (no memo)."""
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
