"""Hooks on an offloaded model's layers, so that a layer called outside the compiled graph
(eagerly, or compiled on its own after a graph break) computes with its own weights, and
``state_dict`` reads the truth even while another thread's call holds the slots.

Each hook is an instance of a module-level class naming its state by token, so a model
keeps its hooks through ``copy.deepcopy`` and ``pickle``; a hook whose state is not live
(the copy's, or in another process) does nothing, and offloading the copy replaces it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import dtensor, registry
from ..errors import GradModeError, OffloadError
from .phase import Phase


def refuse_grad(state, args, layer_call: bool = False) -> None:
    """With grad enabled: an offloaded weight that requires grad is refused (a slot cannot
    hold what its gradient updates), and so is an offloaded layer called eagerly on its own
    (``layer_call``) with inputs that require grad: autograd would save its slot contents
    for a backward that no graph streams them back for (``fx_offload.training``)."""
    if not torch.is_grad_enabled():
        return
    from ..training import trained_offloaded_error
    trained = [p.name for ps in state.params.values() for p in ps
               if getattr(p.owner._parameters.get(p.attr), "requires_grad", False)]
    if trained:
        raise trained_offloaded_error(f"{state.model_name} was called", trained)
    if layer_call and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise GradModeError(
            f"trains only through the compiled model: an offloaded layer of "
            f"{state.model_name} was called on its own with grad enabled and inputs that "
            "require grad; autograd would save its slot contents for a backward that no "
            "graph streams them back for. Call the compiled model, or call the layer under "
            "torch.no_grad()")


# torch.export of an offloaded model: its offloaded weights live in host blocks that this
# process's offload state streams into slots, which an exported program cannot carry (its
# graph would hold this process's ops, or weights split between the host and the device)
EXPORT_REFUSED = (
    "an exported program cannot carry weights that this process streams from host memory. "
    "Call fx_offload.restore(model) first and export the plain model (then "
    "fx_offload.place(model, device, <the same options>) to offload it anew: a torch.compile "
    "with the same options reuses the graph Dynamo holds, whose ops do nothing after a "
    "restore)")


def exporting() -> bool:
    """torch.export is tracing (its flag, read as a plain global: Dynamo folds it to False
    under torch.compile; torch 2.11's Dynamo folds ``torch.compiler.is_exporting()`` itself
    to True, and a call of the refusal below in a traced hook breaks the model's graph at
    every layer)."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


# disabled: torch.export(strict=True) traces the hooks with Dynamo, which then stops here
# and names the reason
@torch._dynamo.disable(reason=f"fx_offload: an offloaded model: {EXPORT_REFUSED}")
def refuse_export(module: nn.Module) -> None:
    """Refuse ``torch.export`` (which traces the model with fake tensors) of an offloaded
    model, or of a copy of one, before anything of it changes."""
    if exporting():
        raise OffloadError(
            f"torch.export of {type(module).__name__}, which is offloaded (or a copy of an "
            f"offloaded model, which offloads itself at its first call): {EXPORT_REFUSED}; "
            "the model is unchanged", where="fx_offload")


class OurHook:
    """What every hook fx_offload installs is (so a copy's are found and removed)."""

    at_root = False     # the model's call hooks (placement.EnterCall, LeaveCall)


class LayerEnter(OurHook):
    """Forward pre-hook of an offloaded layer: called on its own, the layer begins a call
    (the parameters point at their slots); then it waits for (or loads) its weights.  It
    calls the op itself, so it is right both eagerly and when Dynamo traces it into a graph;
    the pass drops such a traced wait where it places the layer's own."""

    def __init__(self, token: str, handle: int, layer: int):
        self.token, self.handle, self.layer = token, handle, layer

    def __call__(self, module, args):
        if exporting():
            refuse_export(module)
        if not torch.compiler.is_compiling():
            state = registry.state_for_token(self.token)
            if state is None:
                return None
            refuse_grad(state, args, layer_call=True)
            state.enter(root=False)
        acts = [a for a in args if isinstance(a, torch.Tensor)]
        torch.ops.fx_offload.wait_prefetch(acts, self.handle, self.layer)
        return None


class LayerLeave(OurHook):
    """Forward hook (always called) of an offloaded layer: ends what :class:`LayerEnter`
    began."""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, module, args, output):
        if not torch.compiler.is_compiling():
            state = registry.state_for_token(self.token)
            if state is not None:
                state.leave()
        return None


class TruthInStateDict(OurHook):
    """State-dict hook of a module owning offloaded parameters: while a call holds the slots
    (another thread's), ``state_dict`` still returns the true weights."""

    def __call__(self, module, state_dict, prefix, local_metadata):
        for name, param in module._parameters.items():
            found = registry.owner_of_param(param) if param is not None else None
            key = prefix + name
            if found is None or key not in state_dict:
                continue
            state, layer = found
            if state.phase is not Phase.ON_SLOTS and not dtensor.is_dtensor(param):
                continue
            for p in state.params[layer]:
                if p.param is dtensor.local(param):
                    truth = state.truth_of(layer, p) if state.phase is Phase.ON_SLOTS \
                        else p.param
                    state_dict[key] = state.versions.saved_dtensor(p, param, truth) \
                        if dtensor.is_dtensor(param) else truth
        return state_dict


class LoadTakesTurn(OurHook):
    """Load-state-dict pre-hook of a module owning offloaded parameters: the values must
    land in the host blocks, not in a slot another thread's call is using, so the load waits
    for that call to end and holds the slots until :class:`LoadGivesBack` (the module's
    post-hook, after its children's loads)."""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, module, *args):
        state = registry.state_for_load(self.token)
        while state is not None:
            state.turns.begin_load(module)
            if state.phase is not Phase.RESTORED:
                state.begin_write(module)   # from inside a call: into the truth (.in_call)
                return
            # offloaded anew while this waited: the new state's turn (its post-hook, on
            # the module by then, gives it back), or none for a restored model
            state.turns.end_load(module)
            state = registry.live_state(state)


class LoadGivesBack(OurHook):
    """Load-state-dict post-hook: ends what :class:`LoadTakesTurn` began."""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, module, incompatible_keys):
        state = registry.state_for_load(self.token)
        if state is not None:
            state.end_write(module)
            state.turns.end_load(module)


def call_hooks(model: nn.Module) -> list[RemovableHandle]:
    """Handles of the call hooks on ``model``'s root, if both are there.  A model offloaded
    anew keeps them in place: another thread's call begun meanwhile must meet them (without
    them it would run the compiled graph on no state's turn), and they look their state up
    at each call, so they serve the new state as they did the old one."""
    found = []
    for hook_dict, extra in ((model._forward_pre_hooks, [model._forward_pre_hooks_with_kwargs]),
                             (model._forward_hooks, [model._forward_hooks_with_kwargs,
                                                     model._forward_hooks_always_called])):
        for key, hook in hook_dict.items():
            if isinstance(hook, OurHook) and hook.at_root:
                handle = RemovableHandle(hook_dict, extra_dict=extra)
                handle.id = key
                found.append(handle)
    return found if len(found) == 2 else []


def strip_hooks(model: nn.Module, keep=()) -> bool:
    """Remove fx_offload's hooks from ``model``'s modules (those a copy brought along), but
    those of the handles ``keep``; whether there were any."""
    kept = {handle.id for handle in keep}
    found = False
    for module in model.modules():
        for hook_dict in (module._forward_pre_hooks, module._forward_hooks,
                          module._state_dict_hooks, module._load_state_dict_pre_hooks,
                          module._load_state_dict_post_hooks):
            # (torch wraps a load pre-hook in an object holding it as .hook)
            for key in [k for k, h in hook_dict.items()
                        if isinstance(getattr(h, "hook", h), OurHook) and k not in kept]:
                del hook_dict[key]
                for flags in (module._forward_hooks_always_called,
                              module._forward_pre_hooks_with_kwargs,
                              module._forward_hooks_with_kwargs):
                    flags.pop(key, None)
                found = True
    return found


def carries_hooks(model: nn.Module) -> bool:
    """``model`` has the call hook of an offloaded model: a copy of one, or one unpickled,
    which offloads itself at its first call."""
    return any(isinstance(h, OurHook) for h in model._forward_pre_hooks.values())


def install_layer_hooks(state) -> list:
    """Every layer hook; returns their handles (``.remove()`` undoes each)."""
    handles = []
    owners: dict[int, nn.Module] = {}
    for layer in state.layers:
        module = state.stack.modules[layer]
        handles.append(module.register_forward_pre_hook(
            LayerEnter(state.token, state.handle, layer)))
        handles.append(module.register_forward_hook(LayerLeave(state.token), always_call=True))
        for p in state.params[layer]:
            owners[id(p.owner)] = p.owner
    handles += [m._register_state_dict_hook(TruthInStateDict()) for m in owners.values()]
    # the model's own load takes the turn once for all of it: a call then sees all the new
    # weights or none (a load into a submodule takes it for that submodule's owners)
    model = state.model_ref()
    loaders = ([model] if model is not None else []) + [
        m for m in owners.values() if m is not model]
    for m in loaders:
        handles += [m._register_load_state_dict_pre_hook(LoadTakesTurn(state.token),
                                                         with_module=True),
                    m.register_load_state_dict_post_hook(LoadGivesBack(state.token))]
    return handles
