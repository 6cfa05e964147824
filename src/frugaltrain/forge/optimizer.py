"""ForgeOptimizer: the optimizer step inside the backward pass; no weight gradient is materialized.

FORGE (Kukreja et al., arXiv 2606.22932). Every eligible nn.Linear's backward computes dX with the
old weight, then dW one tile (a block of R output rows) at a time, and applies the element-wise
rule to that tile at once, so at most one tile of weight gradient is alive. Every other parameter
(embeddings, norms, biases, and weights that fall back) updates from a post-accumulate-grad hook,
one parameter gradient at a time. The rule's state update reads the gradient element by element,
so any tile partition gives the same result as the two-phase step (exact in fp32/fp64).

Calling contract, once per optimizer step:
    loss = model(...)            # at most one forward per fused Linear before its backward
    opt.backward(loss)           # the one backward that updates (refusals come before it starts)
    opt.step()                   # closes the step (checks; the accumulation mode updates here)
    scheduler.step()             # lr changes take effect at the next backward
    opt.zero_grad()

Only opt.backward(loss) updates. Any other backward through the model (loss.backward(),
torch.autograd.grad, backward(inputs=...)) is nn.Linear's: input gradients, a weight gradient only
where asked for, no update; step() then refuses the gradients it would silently ignore, and
zero_grad() drops them. Everything opt.backward refuses (a layer run twice, a fused weight used
outside its Linear, a create_graph penalty reaching one) is found in the loss's graph before the
backward starts (_checks.py), so a refused step changes nothing.

Modes, all explicit:
- default: one fused backward per step. A second backward before step() raises (that would be
  gradient accumulation, which needs `accumulation_steps`).
- max_grad_norm: exact global-norm clipping in two passes. opt.backward(loss) runs a backward
  with retain_graph that only sums squared gradient tiles (no update), then a second backward that
  applies the rule with c = min(1, max_norm / (norm + 1e-6)) folded into each tile. Cost: one extra
  backward, and activations stay alive until the second pass ends. A non-finite norm skips the
  update (warned, counted in `num_skipped_steps`).
- accumulation_steps = K > 1: micro-batch backwards add each dW tile into one fp32 buffer per fused
  weight (4 bytes/param resident, no full-size temporary); step() checks that K backwards ran,
  clips exactly if asked (one pass) and applies the rule tile by tile. No memory saving versus
  the standard path in fp32; the fused GEMM epilogue is the only thing kept.
- fp16 and loss scaling are refused before any update: fp16 parameters at construction,
  torch.autocast (fp16 or bf16) in the first fused Linear forward, and torch.amp.GradScaler in
  scaler.scale(loss) when the loss reaches FORGE parameters (the class's scale() is wrapped once;
  step() refuses too, as a last line). Dynamic loss scaling needs the whole gradient checked for
  overflow before any update, and FORGE updates inside the backward.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from frugaltrain.forge import precision
from frugaltrain.forge._checks import (
    check_graph,
    guard_grad_scaler,
    owner_of,
    release_owner,
    set_owner,
)
from frugaltrain.forge._inplace import inplace_variant
from frugaltrain.forge.linear import LayerHandle, install_linear, uninstall_linear
from frugaltrain.forge.rules import RULES, Rule

TILE_ELEMS = 65536  # default tile budget: 256 KiB of fp32 gradient
_BACKENDS = ("torch", "triton")
_STATES = ("fp32", "bf16", "int8")
_ROUNDING = ("stochastic", "nearest")


class ForgeOptimizer(torch.optim.Optimizer):
    """Fused optimizer-in-backward for any nn.Module (see the module docstring for the contract).

    Args:
        model: the module to train; its eligible nn.Linear layers (and subclasses that keep
            nn.Linear.forward) get the fused backward; the others are listed in `fallback`.
        params: parameters or param-group dicts, as torch.optim takes them; default: every
            parameter of `model` that requires grad, in one group.
        rule: "adamw", "sgd" or "lion" (rules.py).
        tile_rows: R, output rows of W per tile; one tile of dW (R x in_features) is the largest
            weight gradient alive. Default None: the largest multiple of 8 rows within
            TILE_ELEMS elements (256 KiB in fp32), at least 8.
        states: "fp32" (float32, or float64 for float64 params) or "int8" (blockwise 8-bit).
        rounding: bf16 weight store, "stochastic" (seeded) or "nearest".
        seed: base seed of the stochastic rounding streams.
        max_grad_norm: global-norm clip threshold (two-pass mode); None: no clipping.
        accumulation_steps: K micro-batch backwards per step (K > 1: accumulation mode).
        exclude: name -> True keeps that Linear on the standard (hook) path.
        backend: "torch" (chunked, CPU and GPU) or "triton" (GPU; CPU under TRITON_INTERPRET=1).
        **defaults: the rule's hyperparameters (lr, betas, eps, weight_decay, momentum, ...).
    """

    # so GradScaler hands itself to step(), which refuses it (scale() refuses first, see
    # _checks.guard_grad_scaler; this catches a scaler whose scale() was bypassed)
    _step_supports_amp_scaling = True

    def __init__(
        self,
        model: nn.Module,
        params: Iterable | None = None,
        *,
        rule: str = "adamw",
        tile_rows: int | None = None,
        states: str = "fp32",
        rounding: str = "stochastic",
        seed: int = 0,
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        exclude: Callable[[str], bool] | None = None,
        backend: str = "torch",
        **defaults,
    ) -> None:
        _check_model_argument(model)
        _check_options(rule, defaults, backend, states, rounding)
        if tile_rows is not None and tile_rows < 1:
            raise ValueError(f"FORGE: tile_rows={tile_rows} must be >= 1")
        if accumulation_steps < 1:
            raise ValueError(f"FORGE: accumulation_steps={accumulation_steps} must be >= 1")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"FORGE: max_grad_norm={max_grad_norm} must be > 0 (None: off)")
        self.rule: Rule = RULES[rule]
        self._update_inplace = inplace_variant(self.rule.update)
        guard_grad_scaler()
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, {**self.rule.defaults, **defaults})

        self._group_of: dict[nn.Parameter, dict] = {}
        self.tile_rows = tile_rows
        self.states = states
        self.rounding = rounding
        self.seed = seed
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.backend = backend
        # (BV, BH, BK[, warps, stages]); None: the kernel's default; "auto": timed per layer shape
        self.triton_block = None
        self.num_skipped_steps = 0
        self._armed = False  # True only inside opt.backward(loss): fused layers update then
        self._mode = "update"  # "update" | "norm" (first pass of two-pass clipping)
        self._coef = 1.0
        self._sumsq = 0.0
        self._updated: set[nn.Parameter] = set()  # params stepped since the last step()
        self._num_armed = 0  # opt.backward calls since the last step()
        self._stray: set[nn.Parameter] = set()  # params given a .grad by another backward
        self._num_backward: dict[nn.Parameter, int] = {}
        self._accum: dict[nn.Parameter, torch.Tensor] = {}
        if backend == "triton":
            from frugaltrain.forge import triton_kernel

            self._triton = triton_kernel
        self._model = weakref.ref(model)
        self._exclude = exclude
        self._params: list[nn.Parameter] = []
        self._param_index: dict[nn.Parameter, int] = {}
        self._handles: list[LayerHandle] = []
        self._hooks: list = []
        self._fused: dict[nn.Parameter, str] = {}  # fused weight -> its Linear's name
        self.fallback: dict[str, str] = {}  # Linear weight name -> why it is on the hook path
        self._adopt(self.param_groups, stacklevel=3)

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group, plus FORGE's installation for the new parameters: their
        Linears get the fused backward (or a reported fallback), the rest get update hooks."""
        if not hasattr(self, "_params"):  # torch.optim.Optimizer.__init__ adding the first groups
            super().add_param_group(param_group)
            return
        super().add_param_group(param_group)  # validates: defaults, no parameter in two groups
        try:
            self._adopt(self.param_groups[-1:], stacklevel=3)
        except Exception:
            self.param_groups.pop()
            raise

    def _adopt(self, groups: list[dict], stacklevel: int) -> None:
        """Check and install the parameters of `groups` (new to this optimizer)."""
        model = self._model()
        if model is None:
            raise ValueError("FORGE: the model of this ForgeOptimizer was garbage-collected")
        names = {p: n for n, p in model.named_parameters(remove_duplicate=False)}
        new = [p for g in groups for p in g["params"]]
        self._refuse_params(new, names)
        self._names = names
        before = dict(self.fallback)
        handles, hooks = self._install(model, self._exclude, new)
        self._handles += handles
        self._hooks += hooks
        for g in groups:
            for p in g["params"]:
                self._group_of[p] = g
        for p in new:
            self._param_index[p] = len(self._params)
            self._params.append(p)
            set_owner(p, self)
        self._fused |= {h.module.weight: h.name for h in handles}
        added = {k: v for k, v in self.fallback.items() if k not in before}
        if added:
            warnings.warn(
                "FORGE: these Linear weights stay on the standard (hook) path, one full gradient "
                f"each: {added}",
                stacklevel=stacklevel,
            )

    def _refuse_params(self, new: list[nn.Parameter], names: dict) -> None:
        """Refusals at construction (and add_param_group), before anything is installed."""
        for p in new:
            if p.dtype == torch.float16:
                raise ValueError(
                    f"FORGE: parameter '{names.get(p, '?')}' is float16. fp16 training needs "
                    "dynamic loss scaling, which checks the whole gradient for overflow before any "
                    "update; FORGE updates during backward and refuses it. Use bf16 or fp32."
                )
            if self.backend == "triton" and p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(
                    f"FORGE: backend='triton' supports fp32 and bf16 parameters; "
                    f"'{names.get(p, '?')}' is {p.dtype} (use backend='torch')"
                )
            if self.backend == "triton" and not p.is_contiguous():
                raise ValueError(
                    f"FORGE: backend='triton' needs contiguous parameters; '{names.get(p, '?')}' "
                    "is not (make it contiguous before building the optimizer)"
                )
        taken = [names.get(p, "?") for p in new if owner_of(p) is not None]
        if taken:
            raise ValueError(
                f"FORGE: parameters {taken[:3]}... already belong to another ForgeOptimizer; "
                "call its remove() before building a new one (two would update them twice)"
            )
        outside = sum(p not in names for p in new)
        if outside:
            raise ValueError(
                f"FORGE: {outside} of the parameters given are not parameters of the model passed "
                "first; ForgeOptimizer(model, params) trains parameters of `model` only"
            )

    # ---- installation --------------------------------------------------------------------

    def _install(self, model: nn.Module, exclude, params) -> tuple[list[LayerHandle], list]:
        owned = set(params)
        uses: dict[nn.Parameter, int] = {}
        for _, module in model.named_modules(remove_duplicate=False):
            for p in module.parameters(recurse=False):
                uses[p] = uses.get(p, 0) + 1
        inside_mha = {
            id(m)
            for mha in model.modules()
            if isinstance(mha, nn.MultiheadAttention)
            for m in mha.modules()
        }
        handles = []
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or module.weight not in owned:
                continue
            if exclude is not None and exclude(name):
                self.fallback[f"{name}.weight"] = "excluded"
            elif uses[module.weight] > 1:
                self.fallback[f"{name}.weight"] = "tied or shared with another module"
            elif id(module) in inside_mha:
                self.fallback[f"{name}.weight"] = "used functionally by nn.MultiheadAttention"
            elif type(module).forward is not nn.Linear.forward:
                # a subclass with its own forward may not compute x @ W^T + b with this weight;
                # subclasses that keep Linear's forward are fused like nn.Linear
                self.fallback[f"{name}.weight"] = (
                    f"{type(module).__qualname__} overrides nn.Linear.forward"
                )
            else:
                handles.append(install_linear(name, module, self))
        fused = {h.module.weight for h in handles}
        hooks = []
        for p in params:
            hook = _weak_hook(self, "_fused_weight_hook" if p in fused else "_param_hook")
            hooks.append(p.register_post_accumulate_grad_hook(hook))
        return handles, hooks

    def remove(self) -> None:
        """Give the model back its own Linear forwards and drop the hooks."""
        for h in self._handles:
            uninstall_linear(h.module)
        for hook in self._hooks:
            hook.remove()
        for p in self._params:
            release_owner(p, self)
        self._handles, self._hooks = [], []

    # ---- backward entry points ---------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> torch.Tensor | None:
        """The optimizer's backward: the one backward in which fused layers update their weights
        (and hooked parameters theirs). Returns the pre-clip global norm (or None).

        Every refusal happens here, before the backward starts (`_checks.check_graph`): nothing
        is updated by a refused call. Without max_grad_norm this runs loss.backward() once;
        with it, two passes (module docstring). Any other backward through the model (plain
        loss.backward(), torch.autograd.grad, backward(inputs=...)) updates nothing.
        """
        self._refuse_backward(loss)
        self._num_armed += 1
        if self.max_grad_norm is None or self.accumulation_steps > 1:
            with self._arm("update"):
                loss.backward()
            return None
        with self._arm("norm"):
            self._sumsq = 0.0
            loss.backward(retain_graph=True)
            norm = math.sqrt(float(self._sumsq))  # the one host sync of the two-pass mode
        if not math.isfinite(norm):
            self.num_skipped_steps += 1
            warnings.warn(
                f"FORGE: gradient norm is {norm}; this step's update is skipped", stacklevel=2
            )
            return torch.tensor(norm, dtype=torch.float64)
        self._coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
        try:
            with self._arm("update"):
                loss.backward()
        finally:
            self._coef = 1.0
        return torch.tensor(norm, dtype=torch.float64)

    @contextlib.contextmanager
    def _arm(self, mode: str):
        """Fused layers and hooks act only while armed (linear.py, `_param_hook`)."""
        self._armed, self._mode = True, mode
        try:
            yield
        finally:
            self._armed, self._mode = False, "update"

    def _refuse_backward(self, loss: torch.Tensor) -> None:
        """Everything opt.backward(loss) refuses, checked before its backward starts."""
        held = self._held_grads()
        if held:
            raise ValueError(
                f"FORGE: parameters {held[:3]} hold gradients from a backward that was not "
                "opt.backward(loss) (a plain loss.backward(), or inputs= naming them); FORGE never "
                "applies those and the fused layers would not see them. Call opt.zero_grad() "
                "before opt.backward(loss). Refused before the backward: nothing was updated."
            )
        if self._updated and self.accumulation_steps == 1:
            raise ValueError(
                "FORGE: opt.backward(loss) called again before opt.step(). Gradient accumulation "
                "over micro-batches needs accumulation_steps=K (an fp32 buffer per fused weight); "
                "otherwise call opt.step() after every backward. Refused before the backward: "
                "nothing was updated."
            )
        block = self.triton_block
        if self.backend == "triton" and self.states == "int8" and isinstance(block, tuple):
            if block[1] != precision.QBLOCK:
                raise ValueError(
                    f"FORGE: 8-bit states need a Triton tile width of {precision.QBLOCK} columns; "
                    f"triton_block={block}"
                )
        check_graph(loss, self, self._fused, self._names)

    def _held_grads(self) -> list[str]:
        """Names of parameters holding a gradient from a backward FORGE did not run."""
        return [self._names.get(p, "?") for p in self._stray if p.grad is not None]

    def _mark_updated(self, p: nn.Parameter) -> None:
        # a last line: opt.backward refuses a second backward before it starts
        if p in self._updated:
            raise ValueError(
                f"FORGE: parameter '{self._names.get(p, '?')}' got a second update before "
                "opt.step() (it is reached twice in one backward, or opt.step() was skipped)"
            )
        self._updated.add(p)

    @torch.no_grad()
    def _fused_linear_backward(self, handle: LayerHandle, w, x_BTH, dy_BTV) -> None:
        """Called from the fused Linear's backward after dX: dW tile by tile, rule per tile."""
        if w.dtype not in (torch.float32, torch.float64) and (
            self.backend == "torch" or self.accumulation_steps > 1
        ):
            # fp32 accumulation for bf16 weights (the Triton kernel takes bf16 X and dY as they
            # are: exact products, fp32 accumulator)
            x_BTH, dy_BTV = x_BTH.float(), dy_BTV.float()
        V = w.shape[0]
        R = self._tile_rows_for(w)
        if self.accumulation_steps > 1:
            self._num_backward[w] = self._num_backward.get(w, 0) + 1
            buf = self._accum.get(w)
            if buf is None:
                buf = self._accum[w] = torch.zeros(w.shape, dtype=x_BTH.dtype, device=w.device)
            for r0 in range(0, V, R):
                buf[r0 : r0 + R].addmm_(dy_BTV[:, r0 : r0 + R].t(), x_BTH)
            return
        if self._mode == "norm":
            if self.backend == "triton":
                self._sumsq += self._triton.fused_linear_sumsq(dy_BTV, x_BTH, self.triton_block)
                return
            for r0 in range(0, V, R):
                g_RH = dy_BTV[:, r0 : r0 + R].t() @ x_BTH
                self._sumsq = self._sumsq + torch.sum(g_RH.double().square())  # no host sync
            return
        self._mark_updated(w)
        state, scalars = self._begin_update(w)
        if self.backend == "triton":
            sr = self.rounding == "stochastic" and (
                w.dtype == torch.bfloat16 or self.states == "bf16"
            )
            seed = self._sr_seed(w, state) if sr else None
            self._triton.fused_linear_update(
                dy_BTV, x_BTH, w, state, self.rule, scalars, self._coef, seed, self.triton_block
            )
            return
        gen = self._sr_generator(w, state)
        for r0 in range(0, V, R):
            g_RH = dy_BTV[:, r0 : r0 + R].t() @ x_BTH  # the only weight gradient alive
            if self._coef != 1.0:
                g_RH.mul_(self._coef)
            self._update_rows(w, state, r0, g_RH, scalars, gen)

    def _fused_weight_hook(self, p: nn.Parameter) -> None:
        """A fused weight received a gradient: from its Linear outside opt.backward (nn.Linear's
        semantics, recorded so that step() and opt.backward() refuse to ignore it silently), or,
        inside opt.backward, from a use the graph check could not see (a reentrant checkpoint)."""
        if p.grad is None:
            return
        if not self._armed:
            self._stray.add(p)
            return
        raise ValueError(
            f"FORGE: fused weight '{self._names.get(p, '?')}' received a gradient outside its "
            "Linear forward (it is used directly elsewhere, e.g. F.linear(x, layer.weight), "
            "inside a reentrant checkpoint where the graph check cannot see it). Keep it on the "
            "standard path with exclude=..."
        )

    @torch.no_grad()
    def _param_hook(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook of a non-fused parameter: update from p.grad, then free it.
        Outside opt.backward the gradient is left in p.grad, as torch.optim would."""
        if p.grad is None:
            return
        if not self._armed:
            self._stray.add(p)
            return
        if self.accumulation_steps > 1:
            self._num_backward[p] = self._num_backward.get(p, 0) + 1
            return
        if self._mode == "norm":
            self._sumsq = self._sumsq + torch.sum(p.grad.double().square())
            p.grad = None
            return
        self._mark_updated(p)
        g = p.grad
        p.grad = None
        self._apply_full(p, g * self._coef if self._coef != 1.0 else g)

    # ---- the update --------------------------------------------------------------------------

    def _apply_full(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Rule over a whole materialized gradient, tile by tile (hook and accumulation paths)."""
        state, scalars = self._begin_update(p)
        gen = self._sr_generator(p, state)
        g2 = grad.reshape(_rows(p), -1)
        if p.dtype not in (torch.float32, torch.float64):
            g2 = g2.float()
        R = self._tile_rows_for(p)
        for r0 in range(0, g2.shape[0], R):
            self._update_rows(p, state, r0, g2[r0 : r0 + R], scalars, gen)

    def _tile_rows_for(self, p: nn.Parameter) -> int:
        if self.tile_rows is not None:
            return self.tile_rows
        cols = p.numel() // _rows(p)
        return max(8, TILE_ELEMS // max(cols, 1) // 8 * 8)

    def _begin_update(self, p: nn.Parameter) -> tuple[dict, tuple[float, ...]]:
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        state["step"] += 1
        return state, self.rule.scalars(self._group_of[p], int(state["step"].item()))

    def _state_dtype(self, p: nn.Parameter, signed: bool) -> torch.dtype:
        """The storage dtype of one of p's states."""
        if self.states == "int8" and p.dim() >= 2:
            return torch.int8 if signed else torch.uint8
        if self.states == "bf16":
            return torch.bfloat16
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _init_state(self, p: nn.Parameter, state: dict) -> None:
        state["step"] = torch.tensor(0.0)
        rows = _rows(p)
        cols = p.numel() // rows
        for name, signed in zip(self.rule.state_names, self.rule.state_signed, strict=True):
            dtype = self._state_dtype(p, signed)
            if dtype in (torch.int8, torch.uint8):
                nb = -(-cols // precision.QBLOCK)
                state[name] = torch.zeros((rows, cols), dtype=dtype, device=p.device)
                state[f"{name}_scale"] = torch.zeros((rows, nb), device=p.device)
            else:
                state[name] = torch.zeros(p.shape, dtype=dtype, device=p.device)

    def _update_rows(self, p, state, r0, g_RH, scalars, gen) -> None:
        """Load rows r0:r0+R of W and its states, apply the rule, store them back.

        The rule runs in place (`_inplace.inplace_variant`) on tiles this method owns: views of
        W and fp32 states that it overwrites anyway, private copies otherwise (an up-cast bf16
        tile, a dequantized 8-bit one), and g_RH, which every caller hands over (a fresh GEMM
        tile or a gradient it has already detached). bf16 stores (states, then the weight) round
        stochastically from `gen` when it is given, to nearest otherwise.
        """
        r1 = r0 + g_RH.shape[0]
        w2 = p.view(_rows(p), -1)
        w_view = w2[r0:r1]
        w_RH = w_view if w_view.dtype == g_RH.dtype else w_view.to(g_RH.dtype)
        s_in, views = [], []
        for name, signed in zip(self.rule.state_names, self.rule.state_signed, strict=True):
            s = state[name]
            if s.dtype in (torch.int8, torch.uint8):
                views.append(None)
                s_in.append(precision.dequantize(s[r0:r1], state[f"{name}_scale"][r0:r1], signed))
            else:
                views.append(s.view(w2.shape)[r0:r1])
                s_in.append(views[-1] if s.dtype == g_RH.dtype else views[-1].to(g_RH.dtype))
        s2 = s_in[1] if len(s_in) > 1 else None
        w_new, s1_new, s2_new = self._update_inplace(w_RH, g_RH, s_in[0], s2, *scalars)
        for name, signed, new, view in zip(
            self.rule.state_names, self.rule.state_signed, (s1_new, s2_new), views, strict=False
        ):
            if view is None:
                codes, scale = precision.quantize(new, signed)
                state[name][r0:r1] = codes
                state[f"{name}_scale"][r0:r1] = scale
            elif view.dtype == torch.bfloat16 and gen is not None:
                view.copy_(precision.stochastic_round_to_bf16(new, gen))
            elif new is not view:
                view.copy_(new)  # bf16: round to nearest even
        if p.dtype == torch.bfloat16 and gen is not None:
            w_new = precision.stochastic_round_to_bf16(w_new, gen)
        if w_new is not w_view:
            w_view.copy_(w_new)  # in place under no_grad: bumps W's version counter

    def _sr_seed(self, p: nn.Parameter, state: dict) -> int:
        """Seed of p's rounding stream this step: reproducible, distinct per param and step."""
        step = int(state["step"].item())
        return (self.seed * 1_000_003 + self._param_index[p] * 7_919 + step) % (2**31 - 1)

    def _sr_generator(self, p: nn.Parameter, state: dict) -> torch.Generator | None:
        """The stream of p's stochastic rounding this step (None: no bf16 store, or nearest)."""
        if self.rounding != "stochastic":
            return None
        if p.dtype != torch.bfloat16 and self.states != "bf16":
            return None
        gen = torch.Generator(device=p.device)
        gen.manual_seed(self._sr_seed(p, state))
        return gen

    # ---- torch.optim surface -----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Close the step: updates already ran in backward (accumulation mode updates here)."""
        if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
            raise ValueError(
                "FORGE: torch.amp.GradScaler (fp16 dynamic loss scaling) is not supported: an "
                "overflow found late in the backward cannot undo updates already applied. Train "
                "in bf16 or fp32 without a scaler."
            )
        if closure is not None:
            raise ValueError("FORGE: step(closure) is not supported; updates happen in backward")
        held = self._held_grads()
        if held and (not self._num_armed or self.accumulation_steps > 1):
            raise ValueError(
                f"FORGE: opt.step() found gradients in {held[:3]} from a backward that was not "
                "opt.backward(loss) (e.g. loss.backward()), and FORGE never applies those: it "
                "updates inside opt.backward(loss), which stores no gradient. Call "
                "opt.backward(loss) instead of loss.backward(); opt.zero_grad() drops these. "
                "Nothing was updated."
            )
        if self.accumulation_steps > 1:
            self._step_accumulated()
        self._updated.clear()
        self._num_armed = 0
        for h in self._handles:
            h.last = None
        return None

    def _step_accumulated(self) -> None:
        seen = {n for n in self._num_backward.values()}
        if seen and seen != {self.accumulation_steps}:
            raise ValueError(
                f"FORGE: accumulation_steps={self.accumulation_steps} but the parameters saw "
                f"{sorted(seen)} backward passes since the last step()"
            )
        grads = {p: self._accum[p] for p in self._accum if self._num_backward.get(p)}
        grads.update({p: p.grad for p in self._params if p.grad is not None})
        coef = 1.0
        if self.max_grad_norm is not None and grads:
            norm = math.sqrt(sum(torch.sum(g.double().square()).item() for g in grads.values()))
            if not math.isfinite(norm):
                self.num_skipped_steps += 1
                warnings.warn(f"FORGE: gradient norm is {norm}; update skipped", stacklevel=3)
                grads = {}
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
        for p, g in grads.items():
            self._apply_full(p, g * coef if coef != 1.0 else g)
        for p in self._params:
            p.grad = None
        for buf in self._accum.values():
            buf.zero_()
        self._num_backward.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's zero_grad. Fused weights never keep a gradient: one left by a backward
        other than opt.backward(loss) is dropped even with set_to_none=False."""
        super().zero_grad(set_to_none=set_to_none)
        for p in self._fused:
            p.grad = None
        self._stray.clear()
        for buf in self._accum.values():
            buf.zero_()
        self._num_backward.clear()

    def state_dict(self) -> dict:
        """torch.optim layout (states keyed by parameter index); tensors are references."""
        groups = []
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [self._param_index[p] for p in g["params"]]
            groups.append(entry)
        state = {self._param_index[p]: dict(s) for p, s in self.state.items() if s}
        return {
            "state": state,
            "param_groups": groups,
            "forge": {"rule": self.rule.name, "states": self.states},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict from `state_dict()` or from torch.optim's AdamW / SGD (same layout:
        states keyed by parameter index in group order, torch's state names). Float states are
        cast to this optimizer's state dtype (fp32, or bf16 with states="bf16"); 8-bit states
        load only from a FORGE state_dict with states="int8"."""
        meta = state_dict.get("forge", {"rule": self.rule.name, "states": self.states})
        states_ok = meta["states"] == self.states or "int8" not in (meta["states"], self.states)
        if meta["rule"] != self.rule.name or not states_ok:
            raise ValueError(
                f"FORGE: state_dict is for rule={meta['rule']!r} states={meta['states']!r}, "
                f"this optimizer has rule={self.rule.name!r} states={self.states!r}"
            )
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("FORGE: state_dict param groups do not match this optimizer's")
        for entry in saved:
            on = [k for k in ("amsgrad", "maximize", "nesterov") if entry.get(k)]
            if on:
                raise ValueError(f"FORGE: state_dict has {on} set, which FORGE does not support")
        for group, entry in zip(self.param_groups, saved, strict=True):
            group.update({k: v for k, v in entry.items() if k != "params"})
        self.state.clear()
        for idx, s in state_dict["state"].items():
            p = self._params[int(idx)]
            self.state[p] = self._loaded_state(p, s)

    def _loaded_state(self, p: nn.Parameter, s: dict) -> dict:
        out = {}
        for k, v in s.items():
            if not torch.is_tensor(v):
                continue  # torch's SGD keeps momentum_buffer=None before its first step
            v = v.detach().clone()
            if k == "step":
                out[k] = v.float()
                continue
            v = v.to(p.device)
            signed = dict(zip(self.rule.state_names, self.rule.state_signed, strict=True)).get(k)
            if signed is not None:
                want = self._state_dtype(p, signed)
                if (v.dtype in (torch.int8, torch.uint8)) != (want in (torch.int8, torch.uint8)):
                    raise ValueError(
                        f"FORGE: state '{k}' of '{self._names.get(p, '?')}' is {v.dtype}, "
                        f"which states={self.states!r} cannot load"
                    )
                v = v.to(want)
            out[k] = v
        if out and "step" not in out:  # torch's SGD keeps no step; momentum_buffer means >= 1
            out["step"] = torch.tensor(1.0)
        if out and any(n not in out for n in self.rule.state_names):
            out = {}  # nothing to resume for this parameter's rule: starts fresh
        return out


def _check_model_argument(model) -> None:
    """The torch.optim habit ForgeOptimizer(model.parameters(), ...) gets a message, not an
    AttributeError: FORGE replaces the model's nn.Linear backwards, so it needs the module."""
    if isinstance(model, nn.Module):
        return
    got = type(model).__name__
    raise TypeError(
        f"FORGE: ForgeOptimizer takes the model first, ForgeOptimizer(model, ...), got a {got}: "
        "it installs the fused backward on the model's nn.Linear layers, so it needs the module "
        "itself, not model.parameters(); to train a subset or set param groups pass them second, "
        "ForgeOptimizer(model, params, ...)"
    )


def _check_options(rule: str, defaults: dict, backend: str, states: str, rounding: str) -> None:
    if rule not in RULES:
        raise ValueError(f"FORGE: rule={rule!r} is unknown; choose one of {sorted(RULES)}")
    unknown = set(defaults) - set(RULES[rule].defaults)
    if unknown:
        raise ValueError(
            f"FORGE: {sorted(unknown)} are not hyperparameters of rule {rule!r}; "
            f"it takes {sorted(RULES[rule].defaults)}"
        )
    for key, allowed, value in (
        ("backend", _BACKENDS, backend),
        ("states", _STATES, states),
        ("rounding", _ROUNDING, rounding),
    ):
        if value not in allowed:
            raise ValueError(f"FORGE: {key}={value!r} is unknown; choose one of {allowed}")


def _weak_hook(opt: ForgeOptimizer, method: str) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook calling `opt.<method>` through a weak reference.

    The hook lives in the parameter's C++ hook table, which the garbage collector cannot
    traverse, so a bound method there (optimizer -> parameter -> hook -> optimizer) kept every
    model and optimizer alive for good. The fused Linears' handles still hold the optimizer
    strongly, so it lives as long as the model; a hook that finds it gone raises.
    """
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        owner = ref()
        if owner is None:
            raise ValueError(
                "FORGE: the ForgeOptimizer of this parameter was garbage-collected while its "
                "hooks were installed; keep a reference to it, or call opt.remove() first"
            )
        getattr(owner, method)(p)

    return hook


def _rows(p: torch.Tensor) -> int:
    """Rows of the 2-D view a parameter is tiled in (1-D parameters are one row)."""
    return p.shape[0] if p.dim() >= 2 else 1
