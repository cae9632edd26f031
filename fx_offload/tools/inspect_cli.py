"""``python -m fx_offload inspect TARGET``: print the plan and the rewritten graphs."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os

from .. import explain
from .models import BUILDERS


class TargetError(ValueError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help=f"a built-in model ({', '.join(sorted(BUILDERS))}), or "
                        "path/to/file.py:factory or package.module:factory, where factory() "
                        "returns (model, example_inputs)")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--num-in-group", type=int, default=1)
    parser.add_argument("--prefetch-step", type=int, default=1)
    parser.add_argument("--offload-params", default=None,
                        help="comma-separated parameter-name segments, e.g. w13_weight,w2_weight")
    parser.add_argument("--layers", default=None, help="dotted path of the layer list")
    parser.add_argument("--memory-budget", default=None,
                        help="let the planner choose (instead of the three options above): "
                             "device memory for weights, such as 3GiB or a number of bytes")
    parser.add_argument("--plan-tokens", default=None,
                        help="comma-separated token counts the planner chooses for")
    parser.add_argument("--dynamic", action="store_true", help="trace with dynamic shapes")
    parser.add_argument("--aten", action="store_true",
                        help="also print the graph after AOTAutograd (ATen ops)")


def load_target(target: str):
    """(model, example_inputs) from a built-in name or a ``file.py:factory`` /
    ``module:factory`` target."""
    if target in BUILDERS:
        return BUILDERS[target]()
    if ":" not in target:
        raise TargetError(
            f"unknown target {target!r}: give a built-in model ({', '.join(sorted(BUILDERS))}) "
            "or path/to/file.py:factory or package.module:factory")
    where, name = target.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise TargetError(f"target file {where!r} does not exist")
        spec = importlib.util.spec_from_file_location("_fx_offload_target", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise TargetError(f"cannot import module {where!r}: {err}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise TargetError(f"{where!r} has no callable {name!r}")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TargetError(f"{target} must return (model, example_inputs), got "
                          f"{type(result).__name__}")
    model, inputs = result
    return model, tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)


def run(args: argparse.Namespace) -> int:
    import sys
    try:
        model, inputs = load_target(args.target)
    except TargetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    options = {"layers": args.layers}
    if args.memory_budget is not None:
        budget = args.memory_budget
        options["memory_budget"] = int(budget) if budget.isdigit() else budget
        if args.plan_tokens:
            options["plan_tokens"] = [int(t) for t in args.plan_tokens.split(",") if t.strip()]
    else:
        options.update(group_size=args.group_size, num_in_group=args.num_in_group,
                       prefetch_step=args.prefetch_step)
    if args.offload_params:
        options["offload_params"] = [p.strip() for p in args.offload_params.split(",")
                                     if p.strip()]
    try:
        explanation = explain(model.eval(), *inputs, aten=args.aten,
                              dynamic=True if args.dynamic else None, **options)
    except Exception as err:   # Dynamo wraps what the pass raised while compiling
        inner = getattr(err, "inner_exception", err)
        if not isinstance(inner, ValueError):
            raise
        print(f"error: {inner}", file=sys.stderr)
        return 2
    print(explanation)
    return 0
