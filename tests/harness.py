"""Shared oracle machinery: run a named-axis loss on one device and under a layout."""
from __future__ import annotations

import torch

import functional_pp as fpp
from functional_pp import tree
from functional_pp.models import llama


def make_batch(cfg, batch=4, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def local_batch(full, mesh, rules):
    """This device's block of a global batch, laid out (and ordered) by the rules."""
    return {k: fpp.named(v, "batch seq") for k, v in full.items()}


def single_device(cfg, full_params, batch, loss_fn=llama.loss, dtype=torch.float64):
    decls = llama.init(cfg, dtype)
    params = tree.tree_map(lambda x: x.clone().requires_grad_(), full_params)
    named = tree.named_tree(params, decls)
    b = {k: fpp.wrap(v, "batch seq") for k, v in batch.items()}
    loss = loss_fn(named, b, cfg).value()
    loss.backward()
    return loss.detach(), tree.tree_map(lambda p: p.grad, params)


def parallel(cfg, full_params, batch, mesh, rules, loss_fn=llama.loss, dtype=torch.float64,
             report=False, options=None, gather=True):
    decls = llama.init(cfg, dtype)

    def fn():
        with fpp.use_rules(rules), fpp.configure(**(options or {})):
            local = tree.tree_map(lambda x: x.clone().requires_grad_(),
                                  tree.shard(full_params, decls, mesh, rules, fpp.current_rank()))
            named = tree.named_tree(local, decls)
            with fpp.comm_report() as rep:
                loss = loss_fn(named, local_batch(batch, mesh, rules), cfg).value()
                loss.backward()
            grads = tree.tree_map(lambda p: p.grad, local)
            full = tree.gather(grads, decls, rules) if gather else grads
        return loss.detach(), full, rep
    return fpp.launch(fn, mesh)
