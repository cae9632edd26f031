"""What fx_offload did and would do, for people: ``report``, ``explain`` and the normalized
graph text that goldens and ``inspect`` print."""
