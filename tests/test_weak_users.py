"""Inductor writes into a buffer that dies in a kernel even when a later in-place weight update
is ordered after the buffer's producer (functional_pp/weak_users.py, docs/compile.md "Writes
into dying buffers")."""
import types

import pytest
import torch
from torch._inductor.dependencies import StarDep, WeakDep
from torch._inductor.utils import run_and_get_code

from functional_pp import kernel_order, torch_private, weak_users


def _matmul_then_update(w, x):
    y = x @ w                      # reads w: the update below is ordered after it (weak dependency)
    z = torch.sigmoid(y) * 3       # y dies here, same size as z
    w.copy_(w * 0.5)               # an in-place weight update, as a donated compiled step ends
    return z


def _compiled_code(monkeypatch, with_pass: bool) -> str:
    if not with_pass:
        monkeypatch.setitem(kernel_order.INDUCTOR_PATCHES, "_post_fusion_custom_pass", kernel_order.restore_graph_order)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g)
    w0 = w.clone()
    fn = torch.compile(_matmul_then_update, backend=torch_private.compile_backend("inductor", lambda graph: None),
                       fullgraph=True)
    z, (code,) = run_and_get_code(fn, w, x)
    torch.testing.assert_close(z, torch.sigmoid(x @ w0) * 3)
    assert torch.equal(w, w0 * 0.5)
    return code


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_dying_matmul_output_is_written_in_place_despite_a_later_weight_update(monkeypatch):
    """With the pass: one buffer (the matmul's output, reused by the pointwise kernel); without
    it inductor allocates a second one because the weight update counts as a use."""
    code = _compiled_code(monkeypatch, with_pass=True)
    assert code.count("empty_strided_cpu(") == 1 and "# reuse" in code, code
    code = _compiled_code(monkeypatch, with_pass=False)
    assert code.count("empty_strided_cpu(") == 2 and "# reuse" not in code, code


def _user(name, *deps, weak=True):
    node = types.SimpleNamespace(read_writes=types.SimpleNamespace(reads=list(deps)))
    return types.SimpleNamespace(is_weak=weak, node=node, name=name)


def test_only_users_with_nothing_but_fake_weak_dependencies_are_dropped():
    """Kept: real readers, weak users whose dependency is not fake (the buffer is a view of the
    written one), and users that also read the buffer; dropped: ordering-only users."""
    order_only = _user("order_only", WeakDep("buf0", mutating_buf="buf9", is_fake=True))
    view_alias = _user("view_alias", WeakDep("buf0", mutating_buf="buf9", is_fake=False))
    reader = _user("reader", StarDep("buf0"), weak=False)
    both = _user("both", WeakDep("buf0", mutating_buf="buf9", is_fake=True), StarDep("buf0"))
    other_buffer = _user("other", WeakDep("buf1", mutating_buf="buf9", is_fake=True))
    buf = types.SimpleNamespace(get_name=lambda: "buf0", users=[order_only, view_alias, reader, both, other_buffer])
    node = types.SimpleNamespace(get_outputs=lambda: [buf])
    fused = types.SimpleNamespace(get_nodes=lambda: [node])
    assert weak_users.drop_ordering_only_users([fused]) == [fused]
    assert [u.name for u in buf.users] == ["view_alias", "reader", "both", "other"]
