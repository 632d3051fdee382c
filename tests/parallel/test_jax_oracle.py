"""JAX itself as the oracle of manual mode: seeded random collective programs run in
``jax.shard_map(check_vma=True)`` (float64, CPU host devices, in a subprocess) and in
``fpp.shard_map`` on simulated meshes of 3 and 6 devices, one axis and tuples of axes; the
outputs and the input gradients must agree on every device (docs/manual_mode.md).

Each program runs three ways here: as a JAX user writes it (no casts: the typed shard_map
inserts them), with every cast written out as ``fpp.pvary``, and that explicit program
untyped (``check_vma=False``), which must equal the typed run bit for bit.

JAX 0.10 fails to transpose an untiled ``all_to_all`` whose split and concat axes differ (a
cotangent of the wrong shape): programs with one compare outputs only. JAX has no derivative for ``pmax``; its stand-in on the JAX side is ``jnp.max`` of an
invariant all_gather, whose gradient splits ties as ours does. JAX numbers a ``ppermute`` over
a tuple of axes by mesh position whatever the tuple's order (its ``axis_index`` follows the
tuple); ours follows the tuple in both, so the permutation is translated for JAX.

Run as a script (``python test_jax_oracle.py --jax IN OUT``) it is the JAX side."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np

ORDER = ("dp_replicate", "dp_shard", "cp", "tp")          # fpp's mesh axis order
MESHES = ({"tp": 3}, {"dp_shard": 2, "tp": 3}, {"dp_shard": 3, "cp": 2})
PROGRAMS_PER_MESH = 12
SEED = 2026


# ------------------------------------------------------------------ programs as data
def _size(mesh, axes):
    n = 1
    for a in axes:
        n *= mesh[a]
    return n


def _axis_choices(mesh):
    live = [a for a in ORDER if a in mesh]
    choices = [(a,) for a in live]
    if len(live) == 2:
        choices += [tuple(live), tuple(reversed(live))]
    return choices


def _vma_after(op, vma, axes):
    """JAX's varying type of a collective's result (its operand cast over ``axes`` first)."""
    if op in ("psum", "pmean", "pmax", "pmin", "all_gather_invariant"):
        return sorted(set(vma) - set(axes))
    return sorted(set(vma) | set(axes))


def make_program(rng: random.Random, mesh: dict) -> dict:
    """A random well-typed program: inputs with in_specs, 1-4 steps, outputs with out_specs.
    Values are tracked as (local shape, vma)."""
    live = [a for a in ORDER if a in mesh]
    inputs, values = [], []
    for _ in range(rng.choice((1, 2))):
        local = [rng.choice((2, 3, 6)) for _ in range(2)]
        spec, used = [], set()
        for _d in range(2):
            options = [None] + [c for c in _axis_choices(mesh) if not used & set(c)]
            c = rng.choice(options)
            spec.append(None if c is None else list(c))
            used |= set(c or ())
        shape = [n * (_size(mesh, s) if s else 1) for n, s in zip(local, spec)]
        inputs.append({"shape": shape, "spec": spec})
        values.append((local, sorted(used)))
    steps = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(OPS)
        step = None
        for _attempt in range(20):       # another operand or axes until the op fits
            step = _random_step(rng, mesh, values, op)
            if step is not None:
                break
        while step is None:
            step = _random_step(rng, mesh, values, "unary")
        steps.append(step)
        values.append((step["shape"], step["vma"]))
    # JAX 0.10 cannot transpose an untiled all_to_all whose axes differ: such programs compare
    # outputs only
    grad = not any(st["op"] == "all_to_all" and not st["tiled"] and st["split"] != st["concat"] for st in steps)
    outputs = [len(values) - 1] + ([rng.randrange(len(values) - 1)] if rng.random() < 0.4 else [])
    outs = []
    for k in outputs:
        replicated = not values[k][1] and rng.random() < 0.5
        n_all = _size(mesh, live)
        shape = list(values[k][0]) if replicated else [n_all] + list(values[k][0])
        outs.append({"value": k, "spec": "replicated" if replicated else "every_device", "shape": shape})
    return {"mesh": mesh, "inputs": inputs, "steps": steps, "outputs": outs, "grad": grad}


def _fits(shape, n, untiled_ok=True):
    """(tiled, dim) for every dimension a collective over n devices can split: tiled where n
    divides it, untiled (JAX's default) where it is n."""
    return ([(True, d) for d in range(len(shape)) if shape[d] % n == 0]
            + [(False, d) for d in range(len(shape)) if shape[d] == n and untiled_ok])


OPS = ("psum", "pmean", "pmax", "pmin", "all_gather", "all_gather", "psum_scatter", "psum_scatter", "ppermute",
       "ppermute", "all_to_all", "all_to_all", "binary", "binary", "index", "unary")


def _random_step(rng, mesh, values, op):
    k = rng.randrange(len(values))
    shape, vma = values[k]
    axes = list(rng.choice(_axis_choices(mesh)))
    n = _size(mesh, axes)
    mixed = set(vma) & set(axes) and not set(axes) <= set(vma)
    if op in ("psum", "pmean", "psum_scatter") and mixed:      # JAX refuses these: a user casts
        missing = [a for a in ORDER if a in axes and a not in vma]
        return {"op": "pvary", "arg": k, "axes": missing, "shape": list(shape), "vma": sorted(set(vma) | set(axes))}
    step = {"op": op, "arg": k, "axes": axes}
    ndim = len(shape)
    out = list(shape)
    if op == "all_gather":
        tiled = rng.random() < 0.5
        if not tiled and ndim >= 3:
            return None
        d = rng.randrange(ndim if tiled else ndim + 1)
        step.update(tiled=tiled, axis=d, invariant=rng.random() < 0.3)
        if tiled:
            out[d] *= n
        else:
            out.insert(d, n)
        if step["invariant"]:
            step["op"] = op = "all_gather_invariant"
    elif op == "psum_scatter":
        fits = _fits(shape, n, untiled_ok=ndim > 1)
        if not fits:
            return None
        tiled, d = rng.choice(fits)
        step.update(tiled=tiled, dim=d)
        if tiled:
            out[d] //= n
        else:
            del out[d]
    elif op == "ppermute":
        kind = rng.choice(("shift", "partial", "empty", "random"))
        if kind == "shift":
            perm = [(i, (i + 1) % n) for i in range(n)]
        elif kind == "empty":
            perm = []
        else:
            dst = list(range(n))
            rng.shuffle(dst)
            perm = [(i, dst[i]) for i in range(n)]
            if kind == "partial":
                perm = rng.sample(perm, rng.randint(1, n - 1))
        step["perm"] = perm
    elif op == "all_to_all":
        fits = _fits(shape, n)
        if not fits:
            return None
        (tiled, s), c = rng.choice(fits), rng.randrange(ndim)
        step.update(tiled=tiled, split=s, concat=c)
        if tiled:
            out[s] //= n
            out[c] *= n
        else:
            del out[s]
            out.insert(c, n)
    elif op == "binary":
        others = [j for j, (sh, _) in enumerate(values) if list(sh) == list(shape)]
        step.update(other=rng.choice(others), how=rng.choice(("mul", "add")))
        step["vma"] = sorted(set(vma) | set(values[step["other"]][1]))
    elif op == "index":
        pass
    elif op == "unary":
        step["how"] = rng.choice(("tanh", "sin"))
    if len(out) > 3 or int(np.prod(out)) > 400:
        return None
    step["shape"] = out
    if op == "unary":
        step["vma"] = list(vma)
    elif op != "binary":
        step["vma"] = _vma_after(op, vma, axes)
    return step


def arrays(program: dict, seed: int):
    """The global inputs and the cotangents of the outputs (float64)."""
    g = np.random.default_rng(seed)
    xs = [g.standard_normal(i["shape"]) for i in program["inputs"]]
    ws = [g.standard_normal(o["shape"]) for o in program["outputs"]]
    return xs, ws


# ------------------------------------------------------------------------ JAX side
def _mesh_position_index(i, axes, mesh):
    """The index over ``axes`` in JAX's ppermute numbering (mesh order) of the device whose
    index over ``axes`` in their tuple order is ``i``."""
    coords = {}
    for a in reversed(axes):
        coords[a] = i % mesh[a]
        i //= mesh[a]
    j = 0
    for a in (a for a in ORDER if a in axes):
        j = j * mesh[a] + coords[a]
    return j


def run_jax(programs, in_path, out_path):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P
    jax.config.update("jax_enable_x64", True)
    # XLA's compilation is most of the time: cached across runs (the programs are seeded)
    import tempfile
    jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "functional_pp_jax_oracle"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    data = np.load(in_path)
    results = {}
    by_mesh: dict = {}
    for p, prog in enumerate(programs):
        by_mesh.setdefault(json.dumps(prog["mesh"]), []).append(p)
    for key, members in by_mesh.items():
        mesh_sizes = json.loads(key)
        names = tuple(a for a in ORDER if a in mesh_sizes)
        n_dev = _size(mesh_sizes, names)
        mesh = jax.make_mesh(tuple(mesh_sizes[a] for a in names), names, devices=jax.devices()[:n_dev],
                             axis_types=(jax.sharding.AxisType.Auto,) * len(names))

        def body(prog):
            def f(*xs):
                vals = list(xs)
                for st in prog["steps"]:
                    v, axes, op = vals[st["arg"]], tuple(st["axes"]), st["op"]
                    if op == "pvary":
                        y = lax.pcast(v, axes, to="varying")
                    elif op == "psum":
                        y = lax.psum(v, axes)
                    elif op == "pmean":
                        y = lax.pmean(v, axes)
                    elif op == "pmax":      # no derivative for lax.pmax: jnp.max's tie rule
                        y = jnp.max(lax.all_gather(v, axes, to="invarying"), axis=0)
                    elif op == "pmin":
                        y = jnp.min(lax.all_gather(v, axes, to="invarying"), axis=0)
                    elif op in ("all_gather", "all_gather_invariant"):
                        y = lax.all_gather(v, axes, axis=st["axis"], tiled=st["tiled"],
                                           to="invarying" if op == "all_gather_invariant" else "varying")
                    elif op == "psum_scatter":
                        y = lax.psum_scatter(v, axes, scatter_dimension=st["dim"], tiled=st["tiled"])
                    elif op == "ppermute":
                        perm = [(_mesh_position_index(s, axes, mesh_sizes), _mesh_position_index(d, axes, mesh_sizes))
                                for s, d in st["perm"]]
                        y = lax.ppermute(v, axes, perm)
                    elif op == "all_to_all":
                        y = lax.all_to_all(v, axes, st["split"], st["concat"], tiled=st["tiled"])
                    elif op == "binary":
                        w = vals[st["other"]]
                        y = v * w if st["how"] == "mul" else v + w
                    elif op == "index":
                        y = v * (lax.axis_index(axes) + 1)
                    else:
                        y = jnp.tanh(v) if st["how"] == "tanh" else jnp.sin(v)
                    vals.append(y)
                return tuple(vals[o["value"]] if o["spec"] == "replicated" else vals[o["value"]][None]
                             for o in prog["outputs"])
            in_specs = tuple(P(*[None if s is None else tuple(s) for s in i["spec"]]) for i in prog["inputs"])
            out_specs = tuple(P() if o["spec"] == "replicated" else P(names) for o in prog["outputs"])
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)

        def everything(inputs, cotangents):
            out = []
            for q, p in enumerate(members):
                if programs[p]["grad"]:
                    outs, vjp = jax.vjp(body(programs[p]), *inputs[q])
                    out.append((outs, vjp(tuple(cotangents[q]))))
                else:
                    out.append((body(programs[p])(*inputs[q]), ()))
            return out
        inputs = [[data[f"{p}/x{i}"] for i in range(len(programs[p]["inputs"]))] for p in members]
        cots = [[data[f"{p}/w{i}"] for i in range(len(programs[p]["outputs"]))] for p in members]
        with jax.set_mesh(mesh):
            done = jax.jit(everything)([tuple(xs) for xs in inputs], [tuple(ws) for ws in cots])
        for p, (outs, grads) in zip(members, done):
            for i, o in enumerate(outs):
                results[f"{p}/out{i}"] = np.asarray(o)
            for i, g in enumerate(grads):
                results[f"{p}/grad{i}"] = np.asarray(g)
    np.savez(out_path, **results)


# ------------------------------------------------------------------------ fpp side
def run_fpp(program: dict, xs, ws, variant: str):
    """This device's outputs and input gradients; ``variant``: "implicit" (as a JAX user
    writes), "explicit" (every cast written out) or "untyped" (explicit, check_vma=False)."""
    import torch

    import functional_pp as fpp
    live = tuple(a for a in ORDER if a in program["mesh"])
    explicit = variant != "implicit"

    def f(*locals_):
        vals = [(x, set(a for s in i["spec"] if s for a in s)) for x, i in zip(locals_, program["inputs"])]

        def cast(v, vma, axes):
            missing = tuple(a for a in ORDER if a in axes and a not in vma)
            return (fpp.pvary(v, missing) if explicit and missing else v), vma | set(missing)
        for st in program["steps"]:
            (v, vma), axes, op = vals[st["arg"]], tuple(st["axes"]), st["op"]
            if op not in ("binary", "unary", "pvary"):
                v, vma = cast(v, vma, axes)
            if op == "pvary":           # written by the user in every variant
                y = fpp.pvary(v, axes)
            elif op == "psum":
                y = fpp.psum(v, axes)
            elif op == "pmean":
                y = fpp.pmean(v, axes)
            elif op == "pmax":
                y = fpp.pmax(v, axes)
            elif op == "pmin":
                y = fpp.pmin(v, axes)
            elif op in ("all_gather", "all_gather_invariant"):
                y = fpp.all_gather(v, axes, axis=st["axis"], tiled=st["tiled"], invariant=op == "all_gather_invariant")
            elif op == "psum_scatter":
                y = fpp.psum_scatter(v, axes, scatter_dimension=st["dim"], tiled=st["tiled"])
            elif op == "ppermute":
                y = fpp.ppermute(v, axes, st["perm"])
            elif op == "all_to_all":
                y = fpp.all_to_all(v, axes, st["split"], st["concat"], tiled=st["tiled"])
            elif op == "binary":
                w, wvma = vals[st["other"]]
                union = vma | wvma
                v, _ = cast(v, vma, union)
                w, _ = cast(w, wvma, union)
                y = v * w if st["how"] == "mul" else v + w
            elif op == "index":
                y = v * (fpp.axis_index(axes) + 1)
            else:
                y = torch.tanh(v) if st["how"] == "tanh" else torch.sin(v)
            vals.append((y, set(st["vma"])))
        outs = []
        for o in program["outputs"]:
            y, vma = vals[o["value"]]
            if o["spec"] == "every_device":
                y, _ = cast(y, vma, live)
                y = y[None]
            outs.append(y)
        return tuple(outs)
    in_specs = tuple(fpp.P(*[None if s is None else tuple(s) for s in i["spec"]]) for i in program["inputs"])
    out_specs = tuple(fpp.P() if o["spec"] == "replicated" else fpp.P(live) for o in program["outputs"])
    inputs = [torch.from_numpy(x).requires_grad_() for x in xs]
    outs = fpp.shard_map(f, in_specs, out_specs, check_vma=variant != "untyped")(*inputs)
    loss = sum((o * torch.from_numpy(w)).sum() for o, w in zip(outs, ws))
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return ([o.detach().numpy() for o in outs],
            [np.zeros(x.shape) if g is None else g.numpy() for g, x in zip(grads, xs)])


def programs():
    rng = random.Random(SEED)
    return [make_program(rng, mesh) for mesh in MESHES for _ in range(PROGRAMS_PER_MESH)]


def test_random_collective_programs_match_jax(tmp_path):
    import importlib.util

    import pytest
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed, so the JAX oracle cannot run: pip install -e '.[jax]' "
                    "(it is in the [test] extra)")
    import functional_pp as fpp
    progs = programs()
    data = {}
    for p, prog in enumerate(progs):
        xs, ws = arrays(prog, SEED + p)
        data.update({f"{p}/x{i}": x for i, x in enumerate(xs)})
        data.update({f"{p}/w{i}": w for i, w in enumerate(ws)})
    np.savez(tmp_path / "in.npz", **data)
    (tmp_path / "programs.json").write_text(json.dumps(progs))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen([sys.executable, __file__, "--jax", str(tmp_path / "programs.json"),
                              str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    ours = {}                      # runs while JAX computes
    for mesh in MESHES:
        members = [p for p, prog in enumerate(progs) if prog["mesh"] == mesh]

        def device(members=members):
            res = {}
            for p in members:
                xs, ws = arrays(progs[p], SEED + p)
                for variant in ("implicit", "explicit", "untyped"):
                    res[p, variant] = run_fpp(progs[p], xs, ws, variant)
            return res
        for rank, res in enumerate(fpp.launch(device, fpp.Mesh(**mesh))):
            for key, value in res.items():
                ours[key + (rank,)] = value
    log, _ = child.communicate(timeout=300)
    assert child.returncode == 0, f"the JAX side failed:\n{log[-4000:]}"
    theirs = np.load(tmp_path / "out.npz")
    for (p, variant, rank), (outs, grads) in sorted(ours.items()):
        where = f"program {p} ({variant}, device {rank}): {json.dumps(progs[p])}"
        for i, o in enumerate(outs):
            np.testing.assert_allclose(o, theirs[f"{p}/out{i}"], rtol=1e-9, atol=1e-9, err_msg=f"output {i} of {where}")
        for i, g in enumerate(grads if progs[p]["grad"] else ()):
            np.testing.assert_allclose(g, theirs[f"{p}/grad{i}"], rtol=1e-9, atol=1e-9,
                                       err_msg=f"gradient of input {i} of {where}")
        if variant == "untyped":       # the explicit style: typed or not, the same bits
            for a, b in zip(outs + grads, ours[p, "explicit", rank][0] + ours[p, "explicit", rank][1]):
                assert np.array_equal(a, b), f"explicit casts typed vs untyped differ: {where}"


if __name__ == "__main__" and sys.argv[1:2] == ["--jax"]:
    run_jax(json.loads(open(sys.argv[2]).read()), sys.argv[3], sys.argv[4])
