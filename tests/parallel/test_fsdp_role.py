"""A named value's part in FSDP is one immutable record owned by parallel/fsdp/role.py
(``Named.role``: parameter, tied, the recipe of its gather; None for an ordinary value), and the
ops ask that module's functions instead of reading the fields (docs/architecture.md)."""
import ast
import dataclasses
import pathlib

import pytest
import torch

import functional_pp as fpp
from functional_pp.parallel.fsdp import role as fsdp_role
from functional_pp.parallel.named import Named

PKG = pathlib.Path(fpp.__file__).parent
FIELDS = {"is_param", "tied", "gathered_from", "_role", "_is_param", "_tied", "_gathered_from"}


def test_the_role_is_one_record_none_for_an_ordinary_value():
    x = Named(torch.zeros(2, 3), ("a", "b"))
    assert x.role is None and not x.is_param and not x.tied and x.gathered_from is None
    p = x.replace(is_param=True)
    assert p.role is fsdp_role.PARAM and p.is_param and not p.tied
    t = fpp.tied(p)
    assert t.role == fsdp_role.ParamRole(True, True) and t.tied and t.data is p.data
    assert "_role" in Named.__slots__ and not {"_is_param", "_tied", "_gathered_from"} & set(Named.__slots__)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.role.tied = True
    # what the ops ask of it
    recipe = (torch.zeros(1), ("dp",), 0, 1)
    g = fsdp_role.gathered(p.role, recipe)
    assert fsdp_role.is_gathered(g) and not fsdp_role.is_gathered(p.role) and not fsdp_role.is_gathered(None)
    assert fsdp_role.after_reshard(g) is fsdp_role.PARAM and fsdp_role.after_reshard(None) is None
    assert not fsdp_role.keeps_relayout(p.role, True) and fsdp_role.keeps_relayout(t.role, True)
    assert fsdp_role.keeps_relayout(None, True) and fsdp_role.keeps_relayout(p.role, False)
    base = torch.zeros(4)
    assert fsdp_role.of_view(g, base.view(2, 2), base) is g       # a view of the gathered block keeps its recipe
    assert fsdp_role.of_view(g, base.clone(), base) is fsdp_role.PARAM


def test_only_fsdp_and_the_value_type_read_the_role_fields():
    reads = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).as_posix()
        if rel.startswith("parallel/fsdp/") or rel == "parallel/named.py":
            continue
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr in FIELDS:
                reads.append(f"{rel}:{n.lineno} .{n.attr}")
    assert not reads, f"ask parallel/fsdp/role.py instead of reading the role's fields: {reads}"
