"""Computing on the host, beside its memory: layers whose weights stay in host memory run
there, reading them in place, and only their activations cross the link (see
docs/host_compute.md).  :mod:`.kernels` holds the host math, :mod:`.rates` the host's
measured speeds that option ``host_compute="auto"`` weighs against the link's."""
