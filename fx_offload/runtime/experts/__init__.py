"""Routed MoE experts at run time: the picked rows gathered over the link (:mod:`.routed`,
:mod:`.gather`), the device cache of the most-picked experts (:mod:`.expert_cache`), the
other chunks of routed layers fetched ahead (:mod:`.ahead`), and the experts computed on the
host (:mod:`.host_experts`)."""
