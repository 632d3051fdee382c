"""The dimension-wise functional collectives (functional_pp/_torch/distributed.py): named
``all_gather_single`` / ``reduce_scatter_single`` from torch 2.13, ``all_gather_tensor`` /
``reduce_scatter_tensor`` on 2.11 and 2.12. The capability is what torch has, and the chosen
functions gather and reduce-scatter along a dimension (two gloo processes, in a child)."""
import subprocess
import sys

import torch.distributed._functional_collectives as funcol

from functional_pp._torch import distributed as D


def test_the_capability_is_what_torch_has():
    has = hasattr(funcol, "all_gather_single") and hasattr(funcol, "reduce_scatter_single")
    assert D.has_single_collectives() is has
    if has:
        assert (D.all_gather_single, D.reduce_scatter_single) == (funcol.all_gather_single, funcol.reduce_scatter_single)
    else:
        assert D.reduce_scatter_single is funcol.reduce_scatter_tensor


CHILD = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:       # a failed check still destroys the group: one left to the teardown can abort the process
        check(rank)
    finally:
        dist.destroy_process_group()

def check(rank):
    from functional_pp._torch.distributed import all_gather_single, funcol, reduce_scatter_single
    pg = dist.group.WORLD
    x = torch.arange(6.).reshape(2, 3) + 10 * rank
    for dim in (0, 1):
        g = funcol.wait_tensor(all_gather_single(x, dim, pg))
        assert torch.equal(g, torch.cat([torch.arange(6.).reshape(2, 3) + 10 * r for r in range(2)], dim)), g
        # traced as torch.compile traces a step (dynamo, fullgraph)
        f = torch.compile(lambda t: funcol.wait_tensor(all_gather_single(t, dim, pg)) * 1,
                          backend="aot_eager", fullgraph=True)
        assert torch.equal(f(x), g)
    y = torch.arange(8.).reshape(2, 4) * (rank + 1)
    s = funcol.wait_tensor(reduce_scatter_single(y, "sum", 1, pg))
    assert torch.equal(s, (torch.arange(8.).reshape(2, 4) * 3)[:, 2 * rank:2 * rank + 2]), s

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(run, args=(port,), nprocs=2)
    print("ok")
"""


def test_gather_and_reduce_scatter_along_a_dimension(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
