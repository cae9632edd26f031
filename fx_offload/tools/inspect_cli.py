"""``python -m fx_offload inspect TARGET``: print the plan and the rewritten graphs."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os

from .. import explain
from .models import BUILDERS, TOOL_LAYERS


class TargetError(ValueError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help=f"a built-in model ({', '.join(sorted(BUILDERS))}), or "
                        "path/to/file.py:factory or package.module:factory, where factory() "
                        "returns (model, example_inputs); a built-in model has "
                        f"{TOOL_LAYERS} layers, as in demo")
    # None: not given (the defaults 2, 1, 1 apply; memory_budget refuses them given)
    parser.add_argument("--group-size", type=int, default=None,
                        help="option group_size (default: 2)")
    parser.add_argument("--num-in-group", type=int, default=None,
                        help="option num_in_group (default: 1)")
    parser.add_argument("--prefetch-step", type=int, default=None,
                        help="option prefetch_step (default: 1)")
    parser.add_argument("--offload-params", default=None,
                        help="comma-separated parameter-name segments, e.g. w13_weight,w2_weight")
    parser.add_argument("--layers", default=None,
                        help="option layers: the dotted path of the layer list (default: the "
                             "one found)")
    parser.add_argument("--memory-budget", default=None,
                        help="let the planner choose (instead of the three options above): "
                             "device memory for weights, such as 3GiB or a number of bytes")
    parser.add_argument("--plan-tokens", default=None,
                        help="comma-separated token counts the planner chooses for")
    parser.add_argument("--dynamic", action="store_true", help="trace with dynamic shapes")
    parser.add_argument("--graphs", action="store_true",
                        help="also print each rewritten graph (a line each without)")
    parser.add_argument("--aten", action="store_true",
                        help="also print each graph after AOTAutograd (ATen ops); implies "
                             "--graphs")


def load_target(target: str):
    """(model, example_inputs) from a built-in name or a ``file.py:factory`` /
    ``module:factory`` target."""
    if target in BUILDERS:
        return BUILDERS[target](num_layers=TOOL_LAYERS)
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
    if isinstance(inputs, dict):
        raise TargetError(f"{target} returned keyword inputs (a dict); inspect calls the model "
                          "with positional inputs: return (model, (input_ids,))")
    return model, tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)


def _options(args) -> dict:
    """The backend's options from the command line; TargetError for a bad combination."""
    hand = {"group_size": args.group_size, "num_in_group": args.num_in_group,
            "prefetch_step": args.prefetch_step}
    options = {"layers": args.layers}
    if args.memory_budget is None:
        if args.plan_tokens:
            raise TargetError("--plan-tokens applies with --memory-budget only")
        defaults = {"group_size": 2, "num_in_group": 1, "prefetch_step": 1}
        options.update({k: defaults[k] if v is None else v for k, v in hand.items()})
    else:
        given = [f"--{k.replace('_', '-')}" for k, v in hand.items() if v is not None]
        if given:
            raise TargetError(f"{', '.join(given)} and --memory-budget both decide what is "
                              "offloaded: give one or the other")
        budget = args.memory_budget
        options["memory_budget"] = int(budget) if budget.isdigit() else budget
        if args.plan_tokens:
            try:
                options["plan_tokens"] = [int(t) for t in args.plan_tokens.split(",")
                                          if t.strip()]
            except ValueError:
                raise TargetError("--plan-tokens must be comma-separated token counts, such "
                                  f"as 1,512, got {args.plan_tokens!r}") from None
    if args.offload_params:
        options["offload_params"] = [p.strip() for p in args.offload_params.split(",")
                                     if p.strip()]
    return options


def run(args: argparse.Namespace) -> int:
    import sys
    try:
        options = _options(args)
        model, inputs = load_target(args.target)
    except TargetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        explanation = explain(model.eval(), *inputs, aten=args.aten,
                              dynamic=True if args.dynamic else None, **options)
    except Exception as err:   # Dynamo wraps what the pass raised while compiling
        inner = getattr(err, "inner_exception", err)
        if not isinstance(inner, ValueError):
            raise
        print(f"error: {inner}", file=sys.stderr)
        return 2
    graphs = args.graphs or args.aten
    print(explanation.text(graphs=graphs), end="" if graphs else "(--graphs prints them)\n")
    return 0
