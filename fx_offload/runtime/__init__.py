"""The runtime, once per call: what the ops do.  :class:`~.state.OffloadState` drives the
slots of one model (wait, start, join, first fill, restore); :mod:`.slots` holds its memory
and copies; :mod:`.routed` and :mod:`.gather` move only the experts a router picked;
:mod:`.hooks` keeps eager calls and ``state_dict`` right; :mod:`.hook_copies` begins each
call's entry refills from the model's call hook; :mod:`.weights` is the public API
on the true weights."""
