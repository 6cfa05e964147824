"""ForgeOptimizer: the optimizer step inside the backward pass; no weight gradient is materialized.

FORGE (Kukreja et al., arXiv 2606.22932). Every eligible nn.Linear's backward computes dX with the
old weight, then dW one tile (a block of R output rows) at a time, and applies the element-wise
rule to that tile at once, so at most one tile of weight gradient is alive. Every other parameter
(embeddings, norms, biases, and weights that fall back) updates from a post-accumulate-grad hook,
one parameter gradient at a time. The rule's state update reads the gradient element by element,
so any tile partition gives the same result as the two-phase step (exact in fp32/fp64).

Calling contract, once per optimizer step:
    loss = model(...)            # at most one forward per fused Linear before its backward
    opt.backward(loss)           # or loss.backward() when clipping is off; updates happen here
    opt.step()                   # closes the step (checks; the accumulation mode updates here)
    scheduler.step()             # lr changes take effect at the next backward
    opt.zero_grad()

Modes, all explicit:
- default: one fused backward per step. A second backward before step() raises (that would be
  gradient accumulation, which needs `accumulation_steps`).
- max_grad_norm: exact global-norm clipping in two passes. opt.backward(loss) runs a backward
  with retain_graph that only sums squared gradient tiles (no update), then a second backward that
  applies the rule with c = min(1, max_norm / (norm + 1e-6)) folded into each tile. Cost: one extra
  backward, and activations stay alive until the second pass ends. A non-finite norm skips the
  update (warned, counted in `num_skipped_steps`). A plain loss.backward() in this mode raises.
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

import math
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from frugaltrain.forge import precision
from frugaltrain.forge._inplace import inplace_variant
from frugaltrain.forge.linear import _LayerHandle, install_linear, uninstall_linear
from frugaltrain.forge.rules import RULES, Rule

# id(parameter) -> a weak reference to the ForgeOptimizer whose hooks it carries (one owner at a
# time). Keyed by id, not by the tensor (tensors compare element-wise); entries go when the
# parameter is freed. Weak, so a dropped model and its optimizer can be collected (a strong
# reference here kept every model ever trained alive: the GPU benchmark ran out of memory).
_OWNERS: dict[int, weakref.ref] = {}


def _owner(p: torch.Tensor) -> ForgeOptimizer | None:
    ref = _OWNERS.get(id(p))
    return None if ref is None else ref()


def _reaches_forge(outputs) -> ForgeOptimizer | None:
    """The ForgeOptimizer owning a parameter that `outputs`' autograd graph reaches, if any."""
    from frugaltrain.forge.linear import _ForgeLinearFn

    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, _ForgeLinearFn._backward_cls):  # the node is the Function's ctx
            return fn.handle.owner
        var = getattr(fn, "variable", None)  # AccumulateGrad of a leaf
        if var is not None and _owner(var) is not None:
            return _owner(var)
        stack.extend(f for f, _ in fn.next_functions)
    return None


def _tensors(outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        outputs = outputs.values()
    try:
        return [t for o in outputs for t in _tensors(o)]
    except TypeError:
        return []


def _guard_grad_scaler() -> None:
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


TILE_ELEMS = 65536  # default tile budget: 256 KiB of fp32 gradient
_BACKENDS = ("torch", "triton")
_STATES = ("fp32", "int8")
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
    # _guard_grad_scaler; this catches a scaler whose scale() was bypassed)
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
        if rule not in RULES:
            raise ValueError(f"FORGE: rule={rule!r} is unknown; choose one of {sorted(RULES)}")
        self.rule: Rule = RULES[rule]
        self._update_inplace = inplace_variant(self.rule.update)
        unknown = set(defaults) - set(self.rule.defaults)
        if unknown:
            raise ValueError(
                f"FORGE: {sorted(unknown)} are not hyperparameters of rule {rule!r}; "
                f"it takes {sorted(self.rule.defaults)}"
            )
        for key, allowed, value in (
            ("backend", _BACKENDS, backend),
            ("states", _STATES, states),
            ("rounding", _ROUNDING, rounding),
        ):
            if value not in allowed:
                raise ValueError(f"FORGE: {key}={value!r} is unknown; choose one of {allowed}")
        if tile_rows is not None and tile_rows < 1:
            raise ValueError(f"FORGE: tile_rows={tile_rows} must be >= 1")
        if accumulation_steps < 1:
            raise ValueError(f"FORGE: accumulation_steps={accumulation_steps} must be >= 1")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"FORGE: max_grad_norm={max_grad_norm} must be > 0 (None: off)")
        _guard_grad_scaler()
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
        self.triton_block = None  # (BV, BH, BK[, warps, stages]); None: the kernel's default
        self.num_skipped_steps = 0
        self._mode = "update"  # "update" | "norm" | "refuse" (clipping set, plain backward)
        if max_grad_norm is not None and accumulation_steps == 1:
            self._mode = "refuse"
        self._coef = 1.0
        self._sumsq = 0.0
        self._updated: set[nn.Parameter] = set()  # params stepped since the last step()
        self._num_backward: dict[nn.Parameter, int] = {}
        self._accum: dict[nn.Parameter, torch.Tensor] = {}
        if backend == "triton":
            from frugaltrain.forge import triton_kernel

            self._triton = triton_kernel
        self._model = weakref.ref(model)
        self._exclude = exclude
        self._params: list[nn.Parameter] = []
        self._param_index: dict[nn.Parameter, int] = {}
        self._handles: list[_LayerHandle] = []
        self._hooks: list = []
        self._fused: set[nn.Parameter] = set()
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
        taken = [names.get(p, "?") for p in new if _owner(p) is not None]
        if taken:
            raise ValueError(
                f"FORGE: parameters {taken[:3]}... already belong to another ForgeOptimizer; "
                "call its remove() before building a new one (two would update them twice)"
            )
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
            _OWNERS[id(p)] = weakref.ref(self)
            weakref.finalize(p, _OWNERS.pop, id(p), None)
        self._fused |= {h.module.weight for h in handles}
        added = {k: v for k, v in self.fallback.items() if k not in before}
        if added:
            warnings.warn(
                "FORGE: these Linear weights stay on the standard (hook) path, one full gradient "
                f"each: {added}",
                stacklevel=stacklevel,
            )

    # ---- installation --------------------------------------------------------------------

    def _install(self, model: nn.Module, exclude, params) -> tuple[list[_LayerHandle], list]:
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
            if _owner(p) is self:
                del _OWNERS[id(p)]
        self._handles, self._hooks = [], []

    # ---- backward entry points ---------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Backward with the configured clipping; returns the pre-clip global norm (or None).

        Without max_grad_norm this is loss.backward(). With it, two passes (module docstring).
        """
        if self.max_grad_norm is None or self.accumulation_steps > 1:
            loss.backward()
            return None
        self._mode, self._sumsq = "norm", 0.0
        try:
            loss.backward(retain_graph=True)
            norm = math.sqrt(float(self._sumsq))  # the one host sync of the two-pass mode
        finally:
            self._mode = "refuse"
        if not math.isfinite(norm):
            self.num_skipped_steps += 1
            warnings.warn(
                f"FORGE: gradient norm is {norm}; this step's update is skipped", stacklevel=2
            )
            return torch.tensor(norm, dtype=torch.float64)
        self._coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
        self._mode = "update"
        try:
            loss.backward()
        finally:
            self._mode, self._coef = "refuse", 1.0
        return torch.tensor(norm, dtype=torch.float64)

    def _check_mode(self, name: str) -> None:
        if self._mode == "refuse":
            raise ValueError(
                f"FORGE: max_grad_norm={self.max_grad_norm} needs the two-pass backward; call "
                f"opt.backward(loss) instead of loss.backward() (parameter '{name}')"
            )

    def _mark_updated(self, p: nn.Parameter) -> None:
        if p in self._updated:
            raise ValueError(
                f"FORGE: parameter '{self._names.get(p, '?')}' got a second backward before "
                "opt.step(). Gradient accumulation over micro-batches needs "
                "accumulation_steps=K (an fp32 buffer per fused weight); otherwise call "
                "opt.step() after every backward."
            )
        self._updated.add(p)

    @torch.no_grad()
    def _fused_linear_backward(self, handle: _LayerHandle, w, x_BTH, dy_BTV) -> None:
        """Called from the fused Linear's backward after dX: dW tile by tile, rule per tile."""
        name = f"{handle.name}.weight"
        self._check_mode(name)
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
            sr = w.dtype == torch.bfloat16 and self.rounding == "stochastic"
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
        if p.grad is None:
            return
        raise ValueError(
            f"FORGE: fused weight '{self._names.get(p, '?')}' received a gradient outside its "
            "Linear forward (it is used directly elsewhere, e.g. F.linear(x, layer.weight)). "
            "Keep it on the standard path with exclude=..."
        )

    @torch.no_grad()
    def _param_hook(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook of a non-fused parameter: update from p.grad, then free it."""
        if self.accumulation_steps > 1:
            self._num_backward[p] = self._num_backward.get(p, 0) + 1
            return
        if p.grad is None:
            return
        self._check_mode(self._names.get(p, "?"))
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

    def _init_state(self, p: nn.Parameter, state: dict) -> None:
        state["step"] = torch.tensor(0.0)
        math_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        rows = _rows(p)
        cols = p.numel() // rows
        for name, signed in zip(self.rule.state_names, self.rule.state_signed, strict=True):
            if self.states == "int8" and p.dim() >= 2:
                nb = -(-cols // precision.QBLOCK)
                code_dtype = torch.int8 if signed else torch.uint8
                state[name] = torch.zeros((rows, cols), dtype=code_dtype, device=p.device)
                state[f"{name}_scale"] = torch.zeros((rows, nb), device=p.device)
            else:
                state[name] = torch.zeros(p.shape, dtype=math_dtype, device=p.device)

    def _update_rows(self, p, state, r0, g_RH, scalars, gen) -> None:
        """Load rows r0:r0+R of W and its states, apply the rule, store them back.

        The rule runs in place (`_inplace.inplace_variant`) on tiles this method owns: views of
        W and fp32 states that it overwrites anyway, private copies otherwise, and g_RH, which
        every caller hands over (a fresh GEMM tile or a gradient it has already detached).
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
                s_in.append(views[-1])
        s2 = s_in[1] if len(s_in) > 1 else None
        w_new, s1_new, s2_new = self._update_inplace(w_RH, g_RH, s_in[0], s2, *scalars)
        for name, signed, new, view in zip(
            self.rule.state_names, self.rule.state_signed, (s1_new, s2_new), views, strict=False
        ):
            if view is None:
                codes, scale = precision.quantize(new, signed)
                state[name][r0:r1] = codes
                state[f"{name}_scale"][r0:r1] = scale
            elif new is not view:
                view.copy_(new)
        if p.dtype == torch.bfloat16 and self.rounding == "stochastic":
            w_new = precision.stochastic_round_to_bf16(w_new, gen)
        if w_new is not w_view:
            w_view.copy_(w_new)  # in place under no_grad: bumps W's version counter

    def _sr_seed(self, p: nn.Parameter, state: dict) -> int:
        """Seed of p's rounding stream this step: reproducible, distinct per param and step."""
        step = int(state["step"].item())
        return (self.seed * 1_000_003 + self._param_index[p] * 7_919 + step) % (2**31 - 1)

    def _sr_generator(self, p: nn.Parameter, state: dict) -> torch.Generator | None:
        if p.dtype != torch.bfloat16 or self.rounding != "stochastic":
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
        if self.accumulation_steps > 1:
            self._step_accumulated()
        self._updated.clear()
        for h in self._handles:
            h.pending = 0
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
        super().zero_grad(set_to_none=set_to_none)
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
        """Load a state_dict from `state_dict()`; state dtypes are kept (no cast to the params')."""
        meta = state_dict.get("forge", {"rule": self.rule.name, "states": self.states})
        if (meta["rule"], meta["states"]) != (self.rule.name, self.states):
            raise ValueError(
                f"FORGE: state_dict is for rule={meta['rule']!r} states={meta['states']!r}, "
                f"this optimizer has rule={self.rule.name!r} states={self.states!r}"
            )
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("FORGE: state_dict param groups do not match this optimizer's")
        for group, entry in zip(self.param_groups, saved, strict=True):
            group.update({k: v for k, v in entry.items() if k != "params"})
        self.state.clear()
        for idx, s in state_dict["state"].items():
            p = self._params[int(idx)]
            self.state[p] = {
                k: v.detach().clone().to(p.device if k != "step" else v.device)
                if torch.is_tensor(v)
                else v
                for k, v in s.items()
            }


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
