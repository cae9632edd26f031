import atexit
import os
import shutil
import tempfile

import pytest
import torch
import torch._dynamo
import torch._inductor.config


@pytest.hookimpl(optionalhook=True)     # xdist's hook: `-p no:xdist` runs without it
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the README's test command): a worker per core on a CPU machine, a few at
    most; none on a GPU machine, whose tests time copies against compute and share one
    device."""
    if torch.cuda.is_available():
        return 0
    return max(1, min(os.cpu_count() or 1, 8))


# each worker's share of the cores for torch's own threads, not every core each
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# Inductor compiles its kernels in the worker itself: a pool of compile subprocesses per
# xdist worker costs more than the few small kernels a test builds (the Inductor tests of
# test_correctness.py took 60 s with the pool, 31 s without, on 2 cores)
torch._inductor.config.compile_threads = 1
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")     # the CLI tests' subprocesses


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# the planner's device-rate cache goes to a throwaway folder, not the user's home, removed
# when the run ends (each xdist worker makes its own)
if "FX_OFFLOAD_CACHE_DIR" not in os.environ:
    _rates = tempfile.mkdtemp(prefix="fx_offload_rates_")
    os.environ["FX_OFFLOAD_CACHE_DIR"] = _rates
    atexit.register(shutil.rmtree, _rates, ignore_errors=True)
