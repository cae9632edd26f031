"""Computing on the host's CPU cores where offloaded weights live, when that beats copying
them over the link: routed experts and linear layers reading host weights in place
(:mod:`.kernels`)."""
from .kernels import host_threads, linear, routed_experts

__all__ = ["host_threads", "linear", "routed_experts"]
