"""What the benchmarks read from a profiler trace (``benchmarks.trace_bench.host_view``), and
the stream helpers the ops call on every start and wait (``runtime.memory.streams``)."""
import json

import pytest
import torch

from fx_offload.benchmarks.trace_bench import host_line, host_view
from fx_offload.runtime.memory import streams


def _event(name, ts, dur, cat="cpu_op", correlation=None):
    event = {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_the_host_view_of_a_call_counts_only_the_link_idle_that_waited_for_a_launch(tmp_path):
    # a call from 1000 us to 21000: guards, a graph, three copies.  The second copy was
    # launched 500 us after the first ended (the host was late: idle for the host); the
    # third was launched early but began 300 us after the second ended (it waited for the
    # compute stream's event: idle, but not the host's)
    events = [
        _event("fx_offload_call", 0, 100, "user_annotation"),      # an earlier call
        _event("fx_offload_call", 1000, 20000, "user_annotation"),
        _event("cudaMemcpyAsync", 1100, 10, "cuda_runtime", 1),
        _event("TorchDynamo Cache Lookup", 1200, 800),
        _event("TorchDynamo Cache Lookup", 2100, 200),
        _event("## Call CompiledFxGraph abc ##", 2500, 15000),
        _event("Memcpy HtoD (Pinned -> Device)", 1120, 3000, "gpu_memcpy", 1),
        _event("cudaMemcpyAsync", 4620, 10, "cuda_runtime", 2),
        _event("Memcpy HtoD (Pinned -> Device)", 4630, 3000, "gpu_memcpy", 2),
        _event("cudaMemcpyAsync", 5000, 10, "cuda_runtime", 3),
        _event("Memcpy HtoD (Pinned -> Device)", 7930, 3000, "gpu_memcpy", 3),
        _event("cudaLaunchKernel", 18000, 10, "cuda_runtime", 4),
        _event("kernel", 19000, 1000, "kernel", 4),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    view = host_view(str(path))
    assert view["call"] == pytest.approx(20.0)
    assert view["lookup"] == pytest.approx(1.0)
    assert view["graph"] == pytest.approx(1.5)
    assert view["first_copy_issued"] == pytest.approx(0.1)
    assert view["first_copy"] == pytest.approx(0.12)
    assert view["issued_all"] == pytest.approx(17.0)
    assert view["idle_for_host"] == pytest.approx(0.5)     # not the third copy's 0.3
    assert view["after_gpu"] == pytest.approx(1.0)
    assert "guards 1.00 ms" in host_line(view)


def test_no_capture_is_reported_before_cuda_is_initialized():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this process")
    assert streams.capturing() is False


@pytest.mark.cuda
def test_the_stream_helpers_agree_with_torch_cuda_and_restore_the_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    index = torch.cuda.current_device()
    assert streams.current_stream(index) == torch.cuda.current_stream(index)
    side, before = torch.cuda.Stream(), torch.cuda.current_stream()
    with streams.on_stream(side):
        assert torch.cuda.current_stream() == side
        x = torch.ones(4, device="cuda").add_(1)     # issued to the side stream
    assert torch.cuda.current_stream() == before
    side.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 2.0))
    assert streams.capturing() is False
    with pytest.raises(ZeroDivisionError), streams.on_stream(side):
        1 / 0
    assert torch.cuda.current_stream() == before           # restored on an exception too
