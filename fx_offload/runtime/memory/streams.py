"""Which CUDA stream the host is issuing to, asked cheaply: the ops ask on every ``start``
and ``wait``, and ``torch.cuda``'s own helpers check availability (which reads the
environment) and the device on every call, several times the cost of the query.

    capturing()          the current stream is being captured into a CUDA graph
    current_stream(i)    torch.cuda.current_stream(i), for an initialized device index i
    on_stream(s)         torch.cuda.stream(s); the cheap way where s is on the current device
"""
from __future__ import annotations

import torch


def capturing() -> bool:
    """The current stream is being captured into a CUDA graph.  (No capture runs before
    CUDA is initialized.)"""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def current_stream(index: int) -> torch.cuda.Stream:
    """The current stream of CUDA device ``index`` (CUDA initialized: a copy stream exists)."""
    stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(index)
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index,
                             device_type=device_type)


class on_stream:
    """``with on_stream(s):`` issues to ``s``, then to the stream current before.  Where
    ``s`` is on another device than the current one, ``torch.cuda.stream`` does it (that
    switches the current device and back)."""

    __slots__ = ("stream", "before", "other")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def __enter__(self) -> None:
        index = self.stream.device_index
        self.other = torch._C._cuda_getDevice() != index
        if self.other:
            self.before = torch.cuda.stream(self.stream)
            self.before.__enter__()
            return
        self.before = current_stream(index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        if self.other:
            self.before.__exit__(*exc)
        else:
            torch.cuda.set_stream(self.before)
