"""The fused nn.Linear backward: input gradient with the old weight, then the update tile by tile.

`install_linear(module, owner)` swaps one nn.Linear's forward for `_ForgeLinearFn`. Its backward
always computes dX = dY @ W with the pre-update W (the chain rule needs the old weight). Then:

- in the backward of `owner.backward(loss)` (the owner is *armed*), it hands (W, X, dY) to the
  owner (ForgeOptimizer), which forms dW one block of rows at a time and applies the optimizer
  rule to that block at once, and returns None for the weight, so W.grad is never allocated;
- in any other backward (torch.autograd.grad, backward(inputs=...), a plain loss.backward(), a
  second pass over a retained graph), it is nn.Linear: it returns dW = dY^T X when that backward
  asks for the weight's gradient and nothing else, and never updates anything.

The bias gradient is returned normally (updated by the owner's post-accumulate-grad hook when
armed). The weight enters the Function through an alias (`weight.view_as(weight)`), a non-leaf
node of its own: the engine can then say whether the running backward needs the weight's
gradient (`torch._C._will_engine_execute_node` refuses leaves inside autograd.grad), and the
owner's graph check can tell the fused path (Function -> alias -> weight) from any other use of
the weight (see _checks.check_graph).

The update writes W in place under no_grad, which bumps W's version counter: any other autograd
node that saved W and runs later fails loudly ("modified by an inplace operation") instead of
silently using the new weight.

Shapes: BT tokens (all leading dims of the input flattened), H in_features, V out_features.
"""

from __future__ import annotations

import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn


class LayerHandle:
    """Per-layer bookkeeping shared by the forward and the backward of one fused Linear."""

    def __init__(self, name: str, module: nn.Linear, owner) -> None:
        self.name = name
        self.module = module
        self.owner = owner
        # the node of this layer's last forward, until its backward runs (reuse detection); weak,
        # so a forward whose graph was dropped without a backward is not taken for a reuse
        self.last: weakref.ref | None = None


class _ForgeLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, handle: LayerHandle):
        ctx.handle = handle
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        handle = ctx.handle
        handle.last = None
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None  # old W, before any update
        dy_BTV = dy.reshape(-1, dy.shape[-1])
        db = dy_BTV.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        x_BTH = x.reshape(-1, x.shape[-1])
        if handle.owner._armed:
            handle.owner._fused_linear_backward(handle, handle.module.weight, x_BTH, dy_BTV)
            return dx, None, db, None
        # Not the optimizer's backward: nn.Linear's gradients, no update. dW only when this
        # backward needs it (plain backward, or inputs=/autograd.grad naming the weight).
        alias = ctx.next_functions[1][0]
        dw = dy_BTV.t().matmul(x_BTH) if torch._C._will_engine_execute_node(alias) else None
        return dx, dw, db, None


# The type of a fused Linear's node in an autograd graph (the node is also the Function's ctx):
# what the graph check looks for.
FusedLinearNode = _ForgeLinearFn._backward_cls


def _forge_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    handle: LayerHandle = self._forge_handle
    if not (torch.is_grad_enabled() and self.weight.requires_grad):
        return F.linear(x, self.weight, self.bias)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        raise ValueError(
            f"FORGE: Linear '{handle.name}' ran under torch.autocast('{dev}', "
            f"dtype={torch.get_autocast_dtype(dev)}), which FORGE does not support (the fused "
            "backward would mix the autocast activations with the fp32 weight, and fp16 autocast "
            "comes with loss scaling, which cannot be checked before the in-backward update). "
            "Refused in the forward: no weight was updated. For bf16 training convert the model "
            "(model.to(torch.bfloat16): fp32 math per tile, stochastic rounding on the store); "
            "otherwise train in fp32 without autocast."
        )
    # A forward that runs inside a backward is an activation-checkpoint recompute, not a reuse.
    recompute = torch._C._current_graph_task_id() != -1
    if not recompute and handle.last is not None and handle.last() is not None:
        raise ValueError(
            f"FORGE: Linear '{handle.name}' ran forward twice before its backward (weight "
            "reuse, e.g. a shared or recurrent layer, or the graph of an earlier forward is still "
            "alive without a backward). Its update is fused into one backward, so reuse would "
            f"step it twice with partial gradients. Pass exclude=lambda n: "
            f"n.startswith('{handle.name}') to keep it on the standard path, or run forwards "
            "that are not trained under torch.no_grad()."
        )
    # The weight is an input (so the output needs grad even when x does not), through an alias
    # node (module docstring); when the backward returns None for it, its AccumulateGrad
    # receives nothing and W.grad is never formed.
    out = _ForgeLinearFn.apply(x, self.weight.view_as(self.weight), self.bias, handle)
    if not recompute:
        handle.last = weakref.ref(out.grad_fn)
    return out


def install_linear(name: str, module: nn.Linear, owner) -> LayerHandle:
    """Route `module`'s forward through the fused Function; returns its handle."""
    handle = LayerHandle(name, module, owner)
    module._forge_handle = handle
    module.forward = types.MethodType(_forge_forward, module)
    return handle


def uninstall_linear(module: nn.Linear) -> None:
    """Restore the class's own forward."""
    module.__dict__.pop("forward", None)
    module.__dict__.pop("_forge_handle", None)
