"""The runtime, once per call: what the ops do.  :class:`~.state.OffloadState` drives the
slots of one model (wait, start, join, first fill, restore) over its parts, one folder a
concern:

* :mod:`.memory`: host blocks, device slots, what each slot holds, compressed copies;
* :mod:`.copies`: the copies into the slots (the ops', the call hook's, the circular one);
* :mod:`.ownership`: who holds the true weights, what the user changed, the public API;
* :mod:`.experts`: routed MoE experts (gathered, cached, fetched ahead, on the host);

and beside the state: :mod:`.hooks` keeps eager calls and ``state_dict`` right,
:mod:`.turns` and :mod:`.interrupts` hold one call at a time, :mod:`.phase` is the state's
life."""
