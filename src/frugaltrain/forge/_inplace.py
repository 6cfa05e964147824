"""Run a rule in place on the torch path: the same source, rewritten where a value is dead.

A rule (rules.py) is straight-line code over tiles. Written functionally it allocates a new tile
for every operation. This module rewrites the rule's syntax tree once: an operation whose first
operand is a tile that nothing reads afterwards (an unnamed intermediate, or a name that is not
used again) runs in place on that operand (`a * b` -> `a.mul_(b)`, `_lerp(a, ...)` ->
`a.lerp_(...)`). For AdamW the result is exactly torch.optim's own in-place sequence
(mul_, lerp_, mul_.addcmul_, sqrt, div_, add_, addcdiv_): the same kernels, so the same bits,
and no tile-sized temporaries beyond the one torch also makes. The Triton kernel keeps using
the functional original, so the rule is still written once.

Only the four tile parameters (w, g, s1, s2) and names assigned in the body are tiles; the
scalar slots are never written. The caller must own every tile it passes (views it will
overwrite anyway, or private copies).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch

_BINOPS = {ast.Mult: "_imul", ast.Div: "_idiv", ast.Add: "_iadd", ast.Sub: "_isub"}
_HELPERS = ("_lerp", "_addcmul", "_addcdiv", "_add", "_sign", "_sqrt")

_NAMESPACE = {
    "_imul": lambda a, b: a.mul_(b),
    "_idiv": lambda a, b: a.div_(b),
    "_iadd": lambda a, b: a.add_(b),
    "_isub": lambda a, b: a.sub_(b),
    "_lerp_": lambda a, b, weight: a.lerp_(b, weight),
    "_addcmul_": lambda a, b, c, value: a.addcmul_(b, c, value=value),
    "_addcdiv_": lambda a, b, c, value: a.addcdiv_(b, c, value=value),
    "_add_": lambda a, b, alpha: a.add_(b, alpha=alpha),
    "_sign_": lambda a: a.sign_(),
    "_sqrt_": lambda a: a.sqrt_(),
}


def _loads(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]


class _Rewriter(ast.NodeTransformer):
    """Rewrite one statement's expression, given the tile names and the names read later."""

    def __init__(self, tiles: set[str], live_after: set[str], uses_here: dict[str, int]):
        self.tiles, self.live_after, self.uses_here = tiles, live_after, uses_here

    def _is_tile(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.tiles
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else ""
            return name.rstrip("_") in _HELPERS or name in _BINOPS.values()
        if isinstance(node, ast.BinOp):
            return self._is_tile(node.left) or self._is_tile(node.right)
        return False

    def _dead(self, node: ast.AST) -> bool:
        """Nothing reads this tile after the operation that consumes it."""
        if isinstance(node, (ast.Call, ast.BinOp)):
            return self._is_tile(node)  # an unnamed intermediate
        if isinstance(node, ast.Name) and node.id in self.tiles:
            return node.id not in self.live_after and self.uses_here.get(node.id, 0) == 1
        return False

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        op = _BINOPS.get(type(node.op))
        if op is not None and self._dead(node.left):
            return ast.Call(
                func=ast.Name(op, ast.Load()), args=[node.left, node.right], keywords=[]
            )
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name in _HELPERS and node.args and self._dead(node.args[0]):
            node.func = ast.Name(name + "_", ast.Load())
        return node


def _assigned(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, ast.Assign):
        return {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return set()


def _live_after(body: list[ast.stmt], i: int, name: str) -> bool:
    """Is the value `name` holds while statement i runs read by a later statement?"""
    if name in _assigned(body[i]):
        return False  # later reads see the new value
    for stmt in body[i + 1 :]:
        if name in _loads(stmt.value):
            return True
        if name in _assigned(stmt):
            return False
    return False


def inplace_variant(fn):
    """The rule `fn` rewritten to run in place where a tile is dead (see the module docstring)."""
    fdef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(fdef, ast.FunctionDef)
    body = [
        s for s in fdef.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    tiles = {a.arg for a in fdef.args.args[:4]}
    for stmt in body:
        if isinstance(stmt, ast.Assign):
            tiles |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    new_body = []
    for i, stmt in enumerate(body):
        assert isinstance(stmt, (ast.Assign, ast.Return)), "rules are straight-line assignments"
        uses_here: dict[str, int] = {}
        for n in _loads(stmt.value):
            uses_here[n] = uses_here.get(n, 0) + 1
        if isinstance(stmt, ast.Assign):
            live = {n for n in uses_here if _live_after(body, i, n)}
            stmt.value = _Rewriter(tiles, live, uses_here).visit(stmt.value)
        new_body.append(stmt)
    fdef.body = new_body
    fdef.decorator_list = []
    fdef.name = fn.__name__ + "_inplace"
    module = ast.fix_missing_locations(ast.Module(body=[fdef], type_ignores=[]))
    namespace = {**fn.__globals__, **_NAMESPACE, "torch": torch}
    exec(compile(module, f"<inplace {fn.__name__}>", "exec"), namespace)
    return namespace[fdef.name]
