import os
import tempfile

import pytest
import torch
import torch._dynamo


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


# the planner's device-rate cache goes to a throwaway folder, not the user's home
os.environ.setdefault("FX_OFFLOAD_CACHE_DIR", tempfile.mkdtemp(prefix="fx_offload_rates_"))
