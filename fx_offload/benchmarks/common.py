"""What the benchmarks share: their common flags, the argparse check of a count, the
Hugging Face models they build with random weights, and the host's read rate."""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def unavailable(benchmark: str, needs: str = "") -> int:
    """2 with a message where ``benchmark`` cannot run here (``needs``: a module it imports,
    such as transformers; a GPU always), else 0."""
    import importlib.util
    import sys
    if needs and importlib.util.find_spec(needs) is None:
        print(f"error: the {benchmark} benchmark needs {needs}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"error: the {benchmark} benchmark needs a GPU", file=sys.stderr)
        return 2
    return 0


def add_flags(parser: argparse.ArgumentParser, flags) -> None:
    """``(flag, default, help)`` each: a store_true flag where the default is False, an int
    where it is an int, else a string (the benchmarks' comma-separated lists of row values)."""
    for flag, default, text in flags:
        if default is False:
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, default=default, help=text,
                                type=int if type(default) is int else str)


def add_generate_arguments(parser: argparse.ArgumentParser, *, layers: int, new_tokens: int,
                           fewest: int, timed: str) -> None:
    """The flags of the benchmarks that time Hugging Face ``generate`` (``generate`` and
    ``moe``): ``fewest`` new tokens at least, decode timed as ``timed`` says."""
    parser.add_argument("--layers", type=int, default=layers, help="decoder layers")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=at_least(fewest, "tokens generated per timed "
                                                      f"generate ({timed})"),
                        default=new_tokens, help="tokens generated per timed generate")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates of each row")
    parser.add_argument("--methods", default="resident,fx_offload,accelerate",
                        help="comma-separated among resident, fx_offload, accelerate")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="decode through transformers' own compile route instead: a static "
                             "cache and CompileConfig (reduce-overhead: CUDA graphs), naming "
                             "fx_offload.backend(...) for the fx_offload rows; prefill then runs "
                             "eagerly")


def at_least(minimum: int, what: str):
    """An argparse ``type``: an int no smaller than ``minimum``, else an error naming
    ``what``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what}: an int >= {minimum}, got {text!r}")
        return value
    return parse


def graphs_route(configured) -> dict:
    """``generate``'s keywords for transformers' compile route (a static cache, CUDA graphs),
    compiling with ``configured`` (an fx_offload backend) or, for ``None``, Inductor."""
    from transformers import CompileConfig
    config = CompileConfig() if configured is None else CompileConfig(backend=configured)
    return dict(cache_implementation="static", compile_config=config)


def build_random(model_class, config):
    """A Hugging Face causal LM of ``config`` on the GPU, bf16 weights drawn normal(0, 0.02)
    (as trained weights are scaled), generating always the full length."""
    with torch.device("meta"):
        model = model_class(config).to(torch.bfloat16)     # no float32 copy on the GPU
    model = model.to_empty(device="cuda").eval()
    gen = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda").mul_(0.02))
        model.model.rotary_emb.__init__(config, device="cuda")
    model.generation_config.eos_token_id = None     # always the full length
    model.generation_config.pad_token_id = 0
    return model


def with_accelerate(build, layers):
    """``build()``'s model with accelerate's ``cpu_offload`` on the layers ``layers(model)``
    names, or None (said in a line) where accelerate is not installed."""
    try:
        from accelerate import cpu_offload
    except ImportError:
        print("  accelerate not installed: skipped")
        return None
    model = build()
    for layer in layers(model):
        cpu_offload(layer, execution_device=torch.device("cuda"))
    return model


def plain_read_rate(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s the host's cores read summing ``gib`` GiB of fp32 (page-locked where CUDA is
    present, as offloaded weights are), the median of ``reps`` sums after one unmeasured."""
    a = torch.empty(int(gib * 2 ** 30) // 4, dtype=torch.float32,
                    pin_memory=torch.cuda.is_available())
    a.uniform_(-1, 1)       # written: an untouched page reads as the zero page
    a.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - start)
    return a.numel() * 4 / statistics.median(times)


def fastest_host_read(rates, plain: float) -> float:
    """The fastest the host was seen reading its memory: ``host_compute``'s probe alone or
    beside the link (``rates``, a ``HostRates``) or a plain sum (``plain`` bytes/s).  A
    bound at a slower rate is no floor: on one machine the probe read 49 GB/s while the
    model's own host jobs read over 60."""
    return max(rates.read_rate, rates.read_beside_link, plain)


SETTLE_TOKENS = 33      # new tokens of each generate that settle_trials runs


def settle_trials(model, prompt, extra=None, most: int = 6) -> int:
    """``generate`` (of ``SETTLE_TOKENS`` new tokens) on ``model`` until ``host_compute="auto"`` has kept a plan at each call
    size it times (:mod:`fx_offload.host_compute.trial`), at most ``most`` times: the timed
    calls then measure the plan kept, not the trial.  Returns the generates run."""
    from .. import registry
    for run in range(most):
        state = registry.state_for_model(model)      # (built at the first call)
        timer = getattr(getattr(state, "host_experts", None), "timer", None)
        if state is not None:
            if not hasattr(timer, "trials") or (run and not timer.trials):
                return run          # no trial: not "auto", or no call size timed
            if timer.trials and all(t.best is not None for t in timer.trials.values()):
                return run
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=SETTLE_TOKENS, min_new_tokens=SETTLE_TOKENS,
                           do_sample=False, **(extra or {}))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return most
