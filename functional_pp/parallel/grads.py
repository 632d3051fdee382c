"""Public access to what a step computes: the reduced gradients of a loss, and full tensors
gathered from a sharded tree (for research, debugging and tests)."""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from functional_pp.core.backward_thread import carry_to_backward
from functional_pp.core.layout import Rules
from functional_pp.parallel.named import Named, env, settle
from functional_pp.parallel.reshard import relayout


def value_and_grad(loss_fn: Callable[[Any, Any], Named], params: Any, batch: Any) -> tuple[torch.Tensor, Any]:
    """``loss, grads = value_and_grad(loss_fn, params, batch)`` on every device: ``params`` a
    tree of named parameters (``functional_pp.init``), ``batch`` what ``loss_fn`` takes. The
    gradients are named arrays laid out like the parameters and reduced exactly once over
    every mesh axis where the data varied: what the training step hands its optimizer."""
    leaves, spec = optree.tree_flatten(params, none_is_leaf=False)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, Named)]
    if bad:
        raise TypeError(f"value_and_grad: params must be named arrays (functional_pp.init); found a {bad[0]}")
    xs = [x.data.detach().requires_grad_(x.data.is_floating_point()) for x in leaves]
    named = []
    for x, leaf in zip(xs, leaves):
        named.append(Named(x, leaf.dims, leaf.split, leaf.vary, sizes=leaf._sizes, is_param=True))
    loss = settle(loss_fn(optree.tree_unflatten(spec, named), batch))
    check_scalar_loss(loss, "value_and_grad")
    diff = [x for x in xs if x.requires_grad]
    gs = iter(torch.autograd.grad(carry_to_backward(loss.data), diff, allow_unused=True))
    grads = []
    for x, leaf in zip(xs, leaves):
        g = next(gs) if x.requires_grad else None
        g = torch.zeros_like(x) if g is None else g
        grads.append(Named(g, leaf.dims, leaf.split, leaf.vary))
    return loss.data.detach(), optree.tree_unflatten(spec, grads)


def check_scalar_loss(loss: Named, where: str) -> None:
    """Refuse a loss that is not a scalar invariant over the mesh (``where`` names the caller):
    differentiating it would seed a different gradient on each device (docs/semantics.md)."""
    if loss.dims:
        raise ValueError(f"{where}: the loss must be a scalar; it has dimensions {loss.dims} (reduce "
                         f"them with functional_pp.ops.mean/sum)")
    if loss.vary:
        raise ValueError(f"{where}: the loss varies over mesh axes {sorted(loss.vary)}: every device "
                         f"would seed a different gradient. Reduce it over those axes (e.g. a mean over "
                         f"the batch dimensions) before returning it")


def gather_tree(tree: Any, decls: Any = None, rules: Rules | None = None) -> Any:
    """Full tensors on every device from a tree of named arrays (each gathered in its layout's
    order, pending sums completed), or from plain shards with their ``decls``
    (``functional_pp.param`` declarations) laid out by ``rules`` (default: the active rules)."""
    mesh, active = env()
    rules = active if rules is None else rules

    def full(x: Any, d: Any = None) -> Any:
        if d is not None and not isinstance(x, Named):
            x = Named(x, d.dims, rules.resolve(d.dims, d.shape, mesh, name="gather_tree"))
        if not isinstance(x, Named):
            return x
        with torch.no_grad():
            return relayout(x, ((),) * len(x.dims), "gather_tree").data.detach()
    if decls is None:
        return optree.tree_map(full, tree, none_is_leaf=False)
    return optree.tree_map(full, tree, decls, none_is_leaf=False)
