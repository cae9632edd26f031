"""The host kernels (fx_offload.host_compute) against a float64 reference, every path.

Tolerances, relative to the largest output magnitude: the fp32-accumulating paths get 1e-4
(a sum of a few hundred fp32-rounded products drifts by about sqrt(n) * 2**-24 of the
largest term, far below 1e-4); ``native`` rounds each matmul's output to the weights' dtype
before the next (bf16 keeps 8 bits: 2**-8 = 0.4% per rounding), so it gets 2e-2 for 16-bit
weights and 1e-4 for fp32 ones."""
import pytest
import torch
import torch.nn.functional as F

from fx_offload.errors import OffloadError
from fx_offload.host_compute import host_threads, kernels, linear, routed_experts

E, H, I = 10, 64, 32
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the paths that compile nothing but the small C kernel; inductor's (a compile of tens of
# seconds per shape here) has a test of its own
EXPERT_PATHS = [p for p in kernels.EXPERT_PATHS if p != "inductor"]


def reference(x, ids, gates, gate_up, down):
    """The routed experts in float64, one token and one slot at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up.shape[0]:
                continue
            g, u = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(gates[t, j]) * (down[e].double() @ (F.silu(g) * u))
    return out


def weights(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * 0.1).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) * 0.1).to(dtype)
    return gate_up, down


def routing(tokens, k, seed=1, x_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, E, generator=gen).topk(k, dim=1).indices
    gates = torch.rand(tokens, k, generator=gen).softmax(-1)
    return torch.randn(tokens, H, generator=gen).to(x_dtype), ids, gates


def tolerance(path, dtype):
    return 2e-2 if path == "native" and dtype != torch.float32 else 1e-4


def close(got, want, tol):
    assert got.dtype == torch.float32 and got.shape == want.shape
    if want.numel() == 0:
        return
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} over {tol} x {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_every_expert_path_equals_the_float64_reference(path, dtype):
    gate_up, down = weights(dtype)
    for tokens in (0, 1, 8):
        for k in (1, 8):
            x, ids, gates = routing(tokens, k)
            got = routed_experts(x, ids, gates, gate_up, down, path=path)
            close(got, reference(x, ids, gates, gate_up, down), tolerance(path, dtype))


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_an_expert_serving_more_tokens_than_the_kernel_holds_at_once(path):
    """loops serves an expert in pieces of 64 (token, slot) pairs: 200 tokens with
    k=8 of 10 experts give each about 160; linear takes rows of x 64 at a time."""
    gate_up, down = weights(torch.bfloat16)
    x, ids, gates = routing(200, 8)
    close(routed_experts(x, ids, gates, gate_up, down, path=path),
          reference(x, ids, gates, gate_up, down), tolerance(path, torch.bfloat16))
    w = down[0]
    close(linear(x[:150, :I], w, path=path), x[:150, :I].double() @ w.double().t(),
          tolerance(path, torch.bfloat16))


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_bf16_activations_and_the_chosen_path(path):
    gate_up, down = weights(torch.bfloat16)
    x, ids, gates = routing(8, 4, x_dtype=torch.bfloat16)
    want = reference(x, ids, gates, gate_up, down)
    close(routed_experts(x, ids, gates, gate_up, down, path=path), want,
          tolerance(path, torch.bfloat16))
    close(routed_experts(x, ids, gates, gate_up, down), want, 2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sizes_that_are_no_multiple_of_a_vector_take_their_tails_too(dtype):
    """loops reads 8 or 16 weights at a time; hidden 70 and inner 21 leave tails."""
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(5, 42, 70, generator=gen) * 0.1).to(dtype)
    down = (torch.randn(5, 70, 21, generator=gen) * 0.1).to(dtype)
    x = torch.randn(3, 70, generator=gen)
    ids, gates = torch.tensor([[0, 4], [2, 2], [4, 1]]), torch.rand(3, 2, generator=gen)
    for path in EXPERT_PATHS:
        close(routed_experts(x, ids, gates, gate_up, down, path=path),
              reference(x, ids, gates, gate_up, down), tolerance(path, dtype))
    for path in kernels.LINEAR_PATHS:
        close(linear(x, gate_up[1], path=path), x.double() @ gate_up[1].double().t(),
              tolerance(path, dtype))


def test_the_inductor_path_equals_the_reference_and_drops_sentinel_ids(monkeypatch):
    gate_up, down = weights(torch.bfloat16)
    x, ids, gates = routing(4, 2)
    ids[0, 1], ids[3, 0] = E, -1
    got = routed_experts(x, ids, gates, gate_up, down, path="inductor")
    close(got, reference(x, ids, gates, gate_up, down), tolerance("inductor", torch.bfloat16))
    # another token count is one more graph of the same function: past Dynamo's recompile
    # limit (lowered here to 1 so that the second count meets it) it must not be an error
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    x, ids, gates = routing(7, 2)
    got = routed_experts(x, ids, gates, gate_up, down, path="inductor")
    close(got, reference(x, ids, gates, gate_up, down), tolerance("inductor", torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_sized_weights_and_inputs_give_torchs_answer(dtype):
    """No rows to split among the threads: torch's empty or zero result, not a crash of the
    process (the C kernel once divided by zero there)."""
    for x_shape, w_shape in [((2, 32), (0, 32)), ((2, 0), (5, 0)), ((0, 32), (5, 32))]:
        x, w = torch.randn(*x_shape), torch.randn(*w_shape).to(dtype)
        bias = torch.randn(w_shape[0])
        assert torch.equal(linear(x, w), F.linear(x, w.float()))
        assert torch.equal(linear(x, w, bias), F.linear(x, w.float(), bias))
    x, ids, gates = routing(3, 2)
    empty = routed_experts(x, ids, gates, torch.zeros(E, 0, H, dtype=dtype),
                           torch.zeros(E, H, 0, dtype=dtype))
    assert torch.equal(empty, torch.zeros(3, H))


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_sentinel_and_out_of_range_ids_contribute_nothing(path):
    gate_up, down = weights(torch.float32)
    x, ids, gates = routing(4, 3)
    bad = ids.clone()
    bad[0, 1], bad[1, 0], bad[2, 2] = E, -1, 1000
    bad[3] = E                                  # a token routed nowhere: a zero row
    got = routed_experts(x, bad, gates, gate_up, down, path=path)
    close(got, reference(x, bad, gates, gate_up, down), 1e-4)   # which drops those slots
    assert torch.count_nonzero(got[3]) == 0
    assert torch.count_nonzero(got[:3]) > 0


@pytest.mark.parametrize("path", EXPERT_PATHS)
def test_non_contiguous_activations_and_routing_are_handled(path):
    gate_up, down = weights(torch.float32)
    x, ids, gates = routing(6, 2)
    xt = x.t().contiguous().t()                  # same values, column-major
    got = routed_experts(xt, ids.t().contiguous().t(), gates.t().contiguous().t(),
                         gate_up, down, path=path)
    close(got, reference(x, ids, gates, gate_up, down), 1e-4)
    close(routed_experts(x[::2], ids[::2], gates[::2], gate_up, down, path=path),
          reference(x[::2], ids[::2], gates[::2], gate_up, down), 1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", kernels.LINEAR_PATHS)
def test_every_linear_path_equals_the_float64_reference(path, dtype):
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(48, H, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(48, generator=gen)
    for shape in ((0, H), (1, H), (3, H), (8, H), (2, 3, H)):
        x = torch.randn(shape, generator=gen)
        for b in (None, bias):
            want = x.double() @ w.double().t() + (0 if b is None else b.double())
            close(linear(x, w, b, path=path), want, tolerance(path, dtype))
    xt = torch.randn(H, 5, generator=gen).t()    # non-contiguous x
    close(linear(xt, w, path=path), xt.double() @ w.double().t(), tolerance(path, dtype))


def test_a_call_from_another_thread_gives_the_same_result():
    """The runtime may call the kernels from a thread of its own, to overlap the GPU."""
    import threading
    gate_up, down = weights(torch.bfloat16)
    x, ids, gates = routing(8, 8)
    want = routed_experts(x, ids, gates, gate_up, down, path="loops")
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault(
        "y", routed_experts(x, ids, gates, gate_up, down, path="loops")))
    worker.start()
    worker.join()
    assert torch.equal(got["y"], want)


def test_a_job_the_stream_runs_gives_the_kernels_result_counts_its_experts_and_times_itself():
    """The job a CUDA stream runs as a host function (cuLaunchHostFunc), run here by the
    caller: its arguments packed as the C struct reads them, from a thread of its own (the
    driver's, there), sentinel ids skipped; its record holds its start and end on the clock
    ``time.monotonic_ns`` reads (the report's host jobs line)."""
    import ctypes
    import threading
    import time
    from fx_offload.host_compute import native
    lib = native.library()
    if lib is None:
        pytest.skip("no C compiler: the runtime computes without queued jobs")
    gate_up, down = weights(torch.bfloat16)
    x, ids, gates = routing(3, 4)
    ids[1, 2] = E                               # a sentinel: routes nowhere
    want = routed_experts(x, ids, gates, gate_up, down, path="loops")
    floats, ints = native.scratch_sizes(ids.numel(), H, I, E)
    y = torch.full((3, H), float("nan"))
    record, job = native.JobRecord(-1, -1, -1), native.ExpertsJob()
    scratch = torch.empty(floats), torch.empty(ints, dtype=torch.int64)   # alive till it ran
    native.fill_job(job, gate_up, down, "silu", x, ids, gates, *scratch, y, record, 2)
    assert job.done == 0
    before = time.monotonic_ns()
    worker = threading.Thread(target=lib.fx_experts_run, args=(ctypes.addressof(job),))
    worker.start()
    worker.join()
    after = time.monotonic_ns()
    assert torch.equal(y, want)
    valid = ids[(ids >= 0) & (ids < E)]
    assert record[0] == valid.unique().numel() and job.done == 1
    assert before <= record[1] <= record[2] <= after


def test_host_threads_is_torchs_pool():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert host_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert host_threads() == before and kernels.physical_cores() >= 1


def test_bad_shapes_dtypes_and_devices_get_an_offload_error_saying_what_to_change():
    """docs/errors.md row 86."""
    gate_up, down = weights(torch.bfloat16)
    x, ids, gates = routing(2, 2)
    bad = [
        (dict(x=x[:, :-1]), r"x must be a \(tokens, 64\) float tensor"),
        (dict(x=x.long()), r"x must be a \(tokens, 64\) float tensor"),
        (dict(ids=ids.float()), r"ids must be a \(2, k\) integer tensor"),
        (dict(ids=ids[:1]), r"ids must be a \(2, k\) integer tensor"),
        (dict(gates=gates[:, :1]), "gates must be a float tensor of ids' shape"),
        (dict(gate_up=gate_up.to(torch.int8)), "gate_up must be bf16, fp16 or fp32"),
        (dict(gate_up=gate_up[:, :-1].contiguous()), "disagree"),
        (dict(down=down.float()), "must share a dtype"),
        (dict(down=down.transpose(1, 2).contiguous().transpose(1, 2)), "not contiguous"),
        (dict(gate_up=gate_up[0]), "gate_up must have 3 dimensions"),
        (dict(act="swish"), "act must be one of"),
        (dict(path="fast"), "path must be None"),
        (dict(x=x.to("meta")), "these kernels compute on the host"),
    ]
    args = dict(x=x, ids=ids, gates=gates, gate_up=gate_up, down=down)
    for change, message in bad:
        with pytest.raises(OffloadError, match=message) as caught:
            routed_experts(**{**args, **change})
        assert str(caught.value).startswith("fx_offload.host_compute.routed_experts:")
    w = down[0]                                  # (64, 32)
    for call, message in [(lambda: linear(x, w), r"x must be a float tensor \(\.\.\., 32\)"),
                          (lambda: linear(x[:, :H], w.t()), "not contiguous"),
                          (lambda: linear(torch.ones(1, I), w, torch.ones(3)),
                           r"bias must be a float tensor of shape \(64,\)"),
                          (lambda: linear(torch.ones(1, I), "w"), "w must be a tensor")]:
        with pytest.raises(OffloadError, match=message):
            call()


def test_the_host_benchmark_runs_quick_on_the_cpu(capsys):
    from fx_offload.tools import cli
    paths = ",".join(sorted(set(EXPERT_PATHS) | set(kernels.LINEAR_PATHS)))
    assert cli.main(["host", "--quick", "--threads", "1", "--paths", paths, "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "| host read (fp32 sum) |" in out and "pinned" not in out or torch.cuda.is_available()
    for path in EXPERT_PATHS:
        assert out.count(f"| experts {path} |") == 2          # T=1 and T=8
    for path in kernels.LINEAR_PATHS:
        assert out.count(f"| dense mlp {path} |") == 2 and out.count(f"| dense qkvo {path} |") == 2
    assert out.count("| attention torch sdpa |") == 2 and "failed" not in out
    from fx_offload.host_compute import attention
    assert out.count("| attention kernel |") == (2 if attention.library() else 0)
