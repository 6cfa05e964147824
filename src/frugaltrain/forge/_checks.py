"""Refusals that must happen before anything is updated: the owner registry, the GradScaler
guard, and the check of a loss's autograd graph that `ForgeOptimizer.backward` runs before it
starts the backward.

FORGE updates inside the backward, so a refusal raised from inside it would leave the model
half-stepped (the layers already reached are updated, the rest are not). Everything that can be
decided from the graph is therefore decided here, from the graph alone, before the first node
runs. The graph exists in full once the forward has run; walking it costs one visit per node
(about 1 us each).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from frugaltrain.forge.linear import FusedLinearNode

# id(parameter) -> a weak reference to the ForgeOptimizer whose hooks it carries (one owner at a
# time). Keyed by id, not by the tensor (tensors compare element-wise); entries go when the
# parameter is freed. Weak, so a dropped model and its optimizer can be collected (a strong
# reference here kept every model ever trained alive: the GPU benchmark ran out of memory).
_OWNERS: dict[int, weakref.ref] = {}


def owner_of(p: torch.Tensor) -> object | None:
    """The ForgeOptimizer whose hooks p carries, if one is alive."""
    ref = _OWNERS.get(id(p))
    return None if ref is None else ref()


def set_owner(p: torch.Tensor, opt: object) -> None:
    """Record opt as p's owner, until p is freed or opt releases it."""
    _OWNERS[id(p)] = weakref.ref(opt)
    weakref.finalize(p, _OWNERS.pop, id(p), None)


def release_owner(p: torch.Tensor, opt: object) -> None:
    """Forget opt as p's owner (a record of another owner stays)."""
    if owner_of(p) is opt:
        del _OWNERS[id(p)]


def _tensors(outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        outputs = outputs.values()
    try:
        return [t for o in outputs for t in _tensors(o)]
    except TypeError:
        return []


def _reaches_forge(outputs) -> object | None:
    """The ForgeOptimizer owning a parameter that `outputs`' autograd graph reaches, if any."""
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, FusedLinearNode):
            return fn.handle.owner
        var = getattr(fn, "variable", None)  # AccumulateGrad of a leaf
        if var is not None and owner_of(var) is not None:
            return owner_of(var)
        stack.extend(f for f, _ in fn.next_functions)
    return None


def guard_grad_scaler() -> None:
    """Make torch.amp.GradScaler.scale refuse a loss that reaches FORGE parameters.

    Loss scaling has to be refused before the backward: FORGE updates inside it, so by the time
    GradScaler.step() could refuse, the scaled gradient has been applied (and with fp16 an
    overflow found late cannot be undone). The wrapper walks the loss's autograd graph once per
    scale() call and only raises when it reaches a parameter a live ForgeOptimizer owns; other
    optimizers' use of GradScaler is unchanged. Installed once, at the first ForgeOptimizer.
    """
    cls = torch.amp.GradScaler
    if getattr(cls.scale, "_forge_guard", False):
        return
    original = cls.scale

    def scale(self, outputs):
        if self.is_enabled() and _reaches_forge(outputs) is not None:
            raise ValueError(
                "FORGE: torch.amp.GradScaler (fp16 dynamic loss scaling) is not supported: FORGE "
                "updates the weights during backward, so the scaled gradient would be applied "
                "before any overflow check or unscale. Refused in scaler.scale(), before the "
                "backward: no weight was updated. Train in bf16 weights or fp32 without a scaler."
            )
        return original(self, outputs)

    scale._forge_guard = True
    scale.__doc__ = original.__doc__
    cls.scale = scale


def _walk(root) -> tuple[list, dict[int, list]]:
    """Every node reachable from `root`, and id(node) -> the nodes with an edge to it."""
    nodes, parents = [root], {id(root): []}
    stack = [root]
    while stack:
        fn = stack.pop()
        for child, _ in fn.next_functions:
            if child is None:
                continue
            plist = parents.get(id(child))
            if plist is None:
                parents[id(child)] = plist = []
                nodes.append(child)
                stack.append(child)
            plist.append(fn)
    return nodes, parents


def check_graph(
    loss: torch.Tensor,
    opt: object,
    fused: Mapping[torch.Tensor, str],
    names: Mapping[torch.Tensor, str],
) -> None:
    """Refuse, before the backward starts, every use of a fused weight that the fused update
    cannot serve. `opt` is the ForgeOptimizer about to run the backward, `fused` its fused
    weights (each -> its Linear's name), `names` its parameters' names. The fused path of a
    weight W is: its Linear's node -> the private alias of W (linear.py) -> W's AccumulateGrad.
    In the loss's graph:

    - one Linear node appearing twice: the layer ran forward twice (shared or recurrent use);
    - the alias reached from another node: a gradient computed with create_graph=True (only a
      backward that records a graph can hand the alias it saved to another node);
    - W's AccumulateGrad reached from anything but the alias: W is used outside its Linear
      (F.embedding, F.linear, indexing on the same tensor), or reached with no Linear at all.
    """
    if loss.grad_fn is None:
        return
    nodes, parents = _walk(loss.grad_fn)
    layers: dict[int, object] = {}  # id(alias) -> the Linear node that owns it
    handles: set[int] = set()
    accs = []
    for fn in nodes:
        if isinstance(fn, FusedLinearNode) and fn.handle.owner is opt:
            if id(fn.handle) in handles:
                raise ValueError(_msg_twice(fn.handle.name))
            handles.add(id(fn.handle))
            layers[id(fn.next_functions[1][0])] = fn
        elif getattr(fn, "variable", None) is not None and fn.variable in fused:
            accs.append(fn)
    for acc in accs:
        w_name = names.get(acc.variable, "?")
        for parent in parents[id(acc)]:
            node = layers.get(id(parent))
            if node is None:
                raise ValueError(_msg_outside(w_name, fused[acc.variable], type(parent).__name__))
            if any(f is not node for f in parents[id(parent)]):
                raise ValueError(_msg_create_graph(w_name, node.handle.name))


def _msg_twice(name: str) -> str:
    return (
        f"FORGE: Linear '{name}' appears twice in this loss's graph (it ran forward twice: a "
        "shared or recurrent layer). Its update is fused into one backward, so reuse would step "
        "it twice with partial gradients. Refused before the backward: nothing was updated. "
        f"Pass exclude=lambda n: n.startswith('{name}') to keep it on the standard path."
    )


def _msg_outside(w_name: str, layer: str, node: str) -> str:
    return (
        f"FORGE: fused weight '{w_name}' is also used outside its Linear in this loss's graph "
        f"(by {node}: e.g. F.embedding or F.linear on the same tensor), so part of its gradient "
        "would bypass the fused update. Refused before the backward: nothing was updated. Keep "
        f"that Linear on the standard path: ForgeOptimizer(model, ..., exclude=lambda n: "
        f"n == '{layer}')."
    )


def _msg_create_graph(w_name: str, layer: str) -> str:
    return (
        f"FORGE: this loss reaches fused weight '{w_name}' through a gradient computed with "
        "create_graph=True (a double backward, e.g. a gradient penalty). The penalty's gradient "
        "with respect to the weight arrives outside the fused update, which cannot combine the "
        "two. Refused before the backward: nothing was updated. Keep the Linears the penalty "
        f"differentiates through on the standard path, e.g. exclude=lambda n: n == '{layer}' "
        "(or exclude=lambda n: True for all)."
    )
