"""Sharded checkpoints: resharding on load, exact round trips, one replica on disk,
consolidation, crash safety and clear errors on bad input."""
import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import functional_pp as fpp
from functional_pp import checkpoint as ck
from functional_pp.checkpoint import format as fmt
from functional_pp.core.layout import block_slices
from functional_pp.optim.transform import EmptyState, ScaleByAdamState

MESH8 = fpp.Mesh(dp_shard=2, cp=2, tp=2)
RULES8 = fpp.Rules(hidden=("dp_shard", "cp"), mlp="tp", vocab="tp")
MESH4 = fpp.Mesh(dp_replicate=2, cp=2)
RULES4 = fpp.Rules(hidden="cp")


def decls(n_layers=2, hidden=8, vocab=16, mlp=12, dtype=torch.float32):
    return {
        "embed": fpp.param((vocab, hidden), "vocab hidden", dtype=dtype),
        "layers": [{"w1": fpp.param((hidden, mlp), "hidden mlp", dtype=dtype),
                    "w2": fpp.param((mlp, hidden), "mlp hidden", dtype=dtype),
                    "b1": fpp.param((mlp,), "mlp", init="uniform", dtype=dtype),
                    "norm": fpp.param((hidden,), "hidden", dtype=dtype),
                    "rope": fpp.param((4,), "head_dim", dtype=dtype)}
                   for _ in range(n_layers)],
    }


D = decls()
LOADER = {"version": 1, "step": 37, "epoch": 2, "seed": 5, "global_batch_size": 8, "seq_len": 16}
CONFIG = {"model": {"n_layers": 2, "hidden": 8}, "lr": 3e-4, "name": "tiny"}


def opt_state(mesh=None, rules=None):
    mu = fpp.init_params(D, seed=2, mesh=mesh, rules=rules)
    nu = fpp.init_params(D, seed=3, mesh=mesh, rules=rules)
    return (ScaleByAdamState(count=torch.tensor(7), mu=mu, nu=nu), EmptyState())


def train_state(mesh=None, rules=None):
    return {"params": fpp.init_params(D, seed=1, mesh=mesh, rules=rules),
            "opt": opt_state(mesh, rules),
            "rng": {"cpu": torch.Generator().manual_seed(1234).get_state()},
            "extra": {"step": 12, "lr": 0.1 + 0.2, "tag": "x", "flag": True,
                      "bf16": torch.linspace(-3, 3, 10).to(torch.bfloat16),
                      "ids": torch.arange(5, dtype=torch.int64)}}


def specs(state):
    return {"params": D, "opt": ck.state_specs(state["opt"], D)}


def expected_shards(tree_full, mesh, rules, rank):
    """The oracle: slices of the full single-device tensors."""
    def cut(p, d, x):
        return x[block_slices(d.shape, rules.resolve(d.dims, d.shape, mesh, p), mesh, rank)]
    return fpp.map_with_path(cut, D, tree_full)


def assert_trees_equal(a, b, what=""):
    la, lb = fpp.leaves_with_paths(a), fpp.leaves_with_paths(b)
    assert [p for p, _ in la] == [p for p, _ in lb], what
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}{p}: {x.dtype}{tuple(x.shape)}"
        assert torch.equal(x, y), f"{what}{p} differs"


def save_on_8(root, step=10, **kw):
    def device():
        state = train_state(MESH8, RULES8)
        return ck.save_checkpoint(root, step, state, specs(state), rules=RULES8,
                                  metadata={"loader": LOADER}, config=CONFIG, **kw)
    return fpp.launch(device, MESH8)


@pytest.fixture(scope="module")
def saved8(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt8")
    paths = save_on_8(root)
    assert paths == [root / "step-000010"] * 8
    return root


# --------------------------------------------------------------------------- resharding
def test_reshard_8_devices_to_4_and_to_1(saved8):
    full = fpp.init_params(D, seed=1)
    mu_full = fpp.init_params(D, seed=2)

    def device():
        r = ck.load_checkpoint(saved8, {"params": D, "opt": ck.state_specs(opt_state(), D)},
                               rules=RULES4)
        rank = fpp.current_rank()
        assert_trees_equal(r.tree["params"], expected_shards(full, MESH4, RULES4, rank), "params.")
        assert_trees_equal(r.tree["opt"][0].mu, expected_shards(mu_full, MESH4, RULES4, rank))
        assert isinstance(r.tree["opt"][0], ScaleByAdamState)
        assert isinstance(r.tree["opt"][1], EmptyState)
        return tuple(r.tree["params"]["layers"][0]["w1"].shape), r.step

    shapes = fpp.launch(device, MESH4)
    assert shapes == [((4, 12), 10)] * 4          # hidden split over cp=2, mlp whole

    r = ck.load_checkpoint(saved8, {"params": D})  # one device, no mesh: full tensors
    assert_trees_equal(r.tree["params"], full)
    assert_trees_equal(r.tree["opt"][0].nu, fpp.init_params(D, seed=3))


def test_single_device_save_loads_sharded_on_8(tmp_path):
    state = train_state()
    ck.save_checkpoint(tmp_path, 3, state, specs(state), config=CONFIG)
    full = state["params"]

    def device():
        r = ck.load_checkpoint(tmp_path, {"params": D}, rules=RULES8, keys=["params"])
        assert list(r.tree) == ["params"]
        assert_trees_equal(r.tree["params"],
                           expected_shards(full, MESH8, RULES8, fpp.current_rank()))
        return r.tree["params"]["embed"].shape

    assert fpp.launch(device, MESH8) == [torch.Size([8, 2])] * 8


# --------------------------------------------------------------------------- exact round trip
def test_train_state_round_trips_bitwise(saved8):
    r = ck.load_checkpoint(saved8)               # no specs: everything whole, saved structure
    ref = train_state()
    assert r.step == 10 and r.metadata == {"loader": LOADER} and r.config == CONFIG
    assert r.path == saved8 / "step-000010"
    assert r.tree["extra"]["step"] == 12 and r.tree["extra"]["lr"] == 0.1 + 0.2
    assert r.tree["extra"]["tag"] == "x" and r.tree["extra"]["flag"] is True
    for key in ("bf16", "ids"):
        assert r.tree["extra"][key].dtype == ref["extra"][key].dtype
        assert torch.equal(r.tree["extra"][key], ref["extra"][key])
    count = r.tree["opt"][0].count
    assert count.dtype == torch.int64 and count.ndim == 0 and count.item() == 7
    assert r.tree["opt"][0]._fields == ("count", "mu", "nu") and r.tree["opt"][1] == ()
    rng = r.tree["rng"]["cpu"]
    assert rng.dtype == torch.uint8 and torch.equal(rng, ref["rng"]["cpu"])
    # the restored RNG state reproduces the same stream
    ck.set_rng_state(r.tree["rng"])
    assert torch.equal(torch.rand(5), torch.rand(5, generator=torch.Generator().manual_seed(1234)))
    assert torch.equal(ck.rng_state()["cpu"], torch.get_rng_state())
    index = json.loads((r.path / "index.json").read_text())
    assert index["tensors"]["params.layers.0.w1"]["axes"] == ["hidden", "mlp"]
    assert index["tensors"]["params.layers.0.w1"]["shape"] == [8, 12]
    assert index["tensors"]["rng.cpu"]["dtype"] == "uint8"
    assert not list(r.path.glob("*.pt")) and not list(r.path.glob("*.pkl"))


def test_per_rank_leaves_come_back_to_their_rank(tmp_path):
    mesh = fpp.Mesh(dp_shard=4)

    def save():
        own = {"gen": torch.full((3,), fpp.current_rank(), dtype=torch.uint8)}
        ck.save_checkpoint(tmp_path, 1, {"rng": own}, {"rng": ck.PER_RANK})

    def load():
        return ck.load_checkpoint(tmp_path).tree["rng"]["gen"].tolist()

    fpp.launch(save, mesh)
    assert fpp.launch(load, mesh) == [[r] * 3 for r in range(4)]
    with pytest.raises(fpp.DeviceError, match="saved per rank from 4 devices"):
        fpp.launch(load, fpp.Mesh(dp_shard=2))


# --------------------------------------------------------------------------- one replica
def data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())


def test_only_one_replica_of_each_shard_is_written(tmp_path):
    mesh = fpp.Mesh(dp_replicate=2, dp_shard=2, tp=2)   # replicated over dp_replicate
    rules = fpp.Rules(hidden="dp_shard", mlp="tp", vocab="tp")

    def device():
        p = fpp.init_params(D, seed=1, mesh=mesh, rules=rules)
        ck.save_checkpoint(tmp_path, 1, {"params": p}, {"params": D}, rules=rules)

    fpp.launch(device, mesh)
    files = sorted((tmp_path / "step-000001").glob("*.safetensors"))
    model_bytes = fpp.count_params(D) * 4
    assert sum(data_bytes(f) for f in files) == model_bytes
    # dp_replicate=1 (ranks 4..7) hold copies of ranks 0..3: they write nothing
    assert [f.name for f in files] == [f"rank-0000{r}.safetensors" for r in range(4)]
    # "rope" (no rule) is written once, by rank 0; "norm" (hidden) by the tp=0 ranks only
    index = json.loads((tmp_path / "step-000001" / "index.json").read_text())
    assert [c["file"] for c in index["tensors"]["params.layers.0.rope"]["chunks"]] == \
        ["rank-00000.safetensors"]
    assert [c["file"] for c in index["tensors"]["params.layers.0.norm"]["chunks"]] == \
        ["rank-00000.safetensors", "rank-00002.safetensors"]
    assert sum(f.stat().st_size for f in files) < model_bytes + 4 * 4096   # headers only


def test_saved_state_bytes_match_state_size(saved8):
    files = sorted((saved8 / "step-000010").glob("*.safetensors"))
    n = fpp.count_params(D)
    extra = train_state()
    replicated = (8 + sum(t.numel() * t.element_size() for t in extra["rng"].values())
                  + 10 * 2 + 5 * 8)                   # count, rng, bf16, ids
    assert sum(data_bytes(f) for f in files) == 3 * n * 4 + replicated


# --------------------------------------------------------------------------- consolidation
def test_consolidate_single_file_and_hf_shards(saved8, tmp_path):
    full = dict(fpp.leaves_with_paths(fpp.init_params(D, seed=1)))
    out = ck.consolidate(saved8, tmp_path / "model.safetensors")
    assert out == tmp_path / "model.safetensors"
    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == sorted(full)
        assert f.metadata()["format"] == "pt"
        for name, t in full.items():
            assert torch.equal(f.get_tensor(name), t), name

    hf = ck.consolidate(saved8, tmp_path / "hf", max_shard_bytes=1024,
                        name_map=lambda p: "model." + p)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    assert index["metadata"]["total_size"] == fpp.count_params(D) * 4
    assert sorted(index["weight_map"]) == sorted("model." + k for k in full)
    for shard in shards:
        assert shard.stat().st_size < 1024 + 1024    # data <= 1 KiB unless one tensor is bigger
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard.name
                assert torch.equal(f.get_tensor(name), full[name[len("model."):]])

    # and a consolidated set loads sharded onto a mesh
    def device():
        got = ck.load_safetensors(hf, D, rules=RULES4, name_map=lambda p: "model." + p)
        want = expected_shards(fpp.init_params(D, seed=1), MESH4, RULES4, fpp.current_rank())
        assert_trees_equal(got, want)
    fpp.launch(device, MESH4)


def test_consolidate_holds_one_full_tensor_at_a_time(saved8, tmp_path, monkeypatch):
    import weakref
    real, alive, peak = fmt.write_safetensors, [], [0]

    def counting(path, items, metadata=None):
        def wrap(produce):
            def inner():
                t = produce()
                alive.append(weakref.ref(t.untyped_storage()))  # outlives aliases of t
                peak[0] = max(peak[0], sum(r() is not None for r in alive))
                return t
            return inner
        return real(path, [(n, d, s, wrap(p)) for n, d, s, p in items], metadata)

    monkeypatch.setattr(fmt, "write_safetensors", counting)
    ck.consolidate(saved8, tmp_path / "m.safetensors", key=None)
    assert len(alive) == len(json.loads((saved8 / "step-000010" / "index.json").read_text())
                             ["tensors"]) and peak[0] == 1


# --------------------------------------------------------------------------- crash safety
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_on_8(tmp_path, step=10)
    real = fmt.write_safetensors

    def failing(path, items, metadata=None):
        if path.name == "rank-00003.safetensors":
            raise RuntimeError("simulated crash while writing")
        return real(path, items, metadata)

    monkeypatch.setattr(fmt, "write_safetensors", failing)
    with pytest.raises(fpp.DeviceError, match="failed on rank 3.*simulated crash") as info:
        save_on_8(tmp_path, step=20, keep_last=1)
    assert "previous checkpoint is untouched" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000010"]
    assert (tmp_path / "latest").read_text().strip() == "step-000010"
    r = ck.load_checkpoint(tmp_path, {"params": D}, keys=["params"])
    assert r.step == 10
    assert_trees_equal(r.tree["params"], fpp.init_params(D, seed=1))


class HardCrash(BaseException):
    """Like a process being killed: no cleanup code runs on that rank."""


def test_hard_crash_leaves_only_an_ignored_temp_dir(tmp_path, monkeypatch):
    save_on_8(tmp_path, step=10)
    real = fmt.write_safetensors

    def dying(path, items, metadata=None):
        out = real(path, items, metadata)
        if path.name == "rank-00005.safetensors":
            raise HardCrash()
        return out

    monkeypatch.setattr(fmt, "write_safetensors", dying)
    with pytest.raises(fpp.DeviceError):
        save_on_8(tmp_path, step=20)
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith("step-000020.tmp-")
    assert ck.CheckpointManager(tmp_path).latest() == 10
    assert ck.CheckpointManager(tmp_path).steps() == [10]
    assert ck.load_checkpoint(tmp_path, keys=["params"]).step == 10
    with pytest.raises(ck.CheckpointNotFoundError):
        ck.load_checkpoint(tmp_path, step=20)
    monkeypatch.setattr(fmt, "write_safetensors", real)
    save_on_8(tmp_path, step=20)               # the next good save cleans the leftover up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000010", "step-000020"]


class _FullDiskOs:
    """``os`` whose fsync fails with ENOSPC for one file (a full disk on one rank)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("rank-00006.safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.fsync(fd)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_disk_full_names_the_file_and_keeps_previous(tmp_path, monkeypatch):
    save_on_8(tmp_path, step=10)
    monkeypatch.setattr(fmt, "os", _FullDiskOs())
    with pytest.raises(fpp.DeviceError) as info:
        save_on_8(tmp_path, step=20)
    msg = str(info.value)
    assert "could not write checkpoint file" in msg and "rank-00006.safetensors" in msg
    assert "No space left on device" in msg and "rank 6" in msg
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "step-000010"
    assert ck.CheckpointManager(tmp_path).steps() == [10]
    assert ck.load_checkpoint(tmp_path, keys=["params"]).step == 10


def test_manager_keep_last_and_latest(tmp_path):
    mesh = fpp.Mesh(dp_shard=2, tp=2)
    rules = fpp.Rules(hidden="dp_shard", mlp="tp")
    mgr = ck.CheckpointManager(tmp_path / "run", keep_last=2, rules=rules)
    assert mgr.latest() is None

    def device():
        p = fpp.init_params(D, seed=1, mesh=mesh, rules=rules)
        for step in (10, 20, 30):
            p = fpp.map_with_path(lambda _, x: x + 1, p)
            mgr.save(step, {"params": p}, {"params": D}, metadata={"loader": {"step": step}})
        r = mgr.load({"params": D})
        assert_trees_equal(r.tree["params"], p)
        return r.step, r.metadata, mgr.load({"params": D}, step=20).metadata

    out = fpp.launch(device, mesh)
    assert out == [(30, {"loader": {"step": 30}}, {"loader": {"step": 20}})] * 4
    assert mgr.steps() == [20, 30] and mgr.latest() == 30
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000030"
    full = ck.load_checkpoint(tmp_path / "run").tree["params"]
    assert_trees_equal(full, fpp.map_with_path(lambda _, x: x + 1 + 1 + 1, fpp.init_params(D, seed=1)))


# --------------------------------------------------------------------------- bad input
@pytest.fixture()
def copy8(saved8, tmp_path):
    import shutil
    dst = tmp_path / "copy"
    shutil.copytree(saved8, dst)
    return dst / "step-000010"


def test_truncated_file_is_named(copy8):
    f = copy8 / "rank-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ck.CheckpointCorruptError, match=r"rank-00002\.safetensors is truncated"):
        ck.load_checkpoint(copy8, {"params": D}, keys=["params"])


def test_corrupted_header_and_data_are_named(copy8):
    f = copy8 / "rank-00001.safetensors"
    raw = bytearray(f.read_bytes())
    f.write_bytes(b"\xff" * 8 + bytes(raw[8:]))            # same size, garbage header length
    with pytest.raises(ck.CheckpointCorruptError,
                       match=r"rank-00001\.safetensors: not a valid safetensors file"):
        ck.load_checkpoint(copy8, keys=["params"])
    raw[-3] ^= 0xFF                                          # flip bits in the last tensor
    f.write_bytes(bytes(raw))
    with pytest.raises(ck.CheckpointCorruptError, match=r"rank-00001\.safetensors: tensor "
                       r"'.*' fails its checksum"):
        ck.load_checkpoint(copy8)


def test_index_naming_a_tensor_missing_from_its_file(copy8):
    index = json.loads((copy8 / "index.json").read_text())
    index["tensors"]["params.layers.1.rope"]["chunks"][0]["file"] = "rank-00001.safetensors"
    del index["sha256"]             # (the deeper check, for an index whose hash was removed)
    (copy8 / "index.json").write_text(json.dumps(index))
    with pytest.raises(ck.CheckpointCorruptError,
                       match=r"rank-00001\.safetensors: the index says it holds tensor "
                             r"'params\.layers\.1\.rope', but the file has no such tensor"):
        ck.load_checkpoint(copy8, {"params": D}, keys=["params"])
    (copy8 / "index.json").write_text('{"format": "functional_pp.checkp')
    with pytest.raises(ck.CheckpointCorruptError, match=r"index\.json is not valid JSON"):
        ck.load_checkpoint(copy8)


def test_shape_and_dtype_mismatch_name_the_tensor(saved8):
    wrong = decls(hidden=16)
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.load_checkpoint(saved8, {"params": wrong}, keys=["params"])
    msg = str(info.value)
    assert "params.embed: shape mismatch: checkpoint (16, 8), model (16, 16)" in msg
    assert "params.layers.1.w2: shape mismatch: checkpoint (12, 8), model (12, 16)" in msg
    with pytest.MonkeyPatch.context() as mp:     # a changed model: the first few named, the rest counted
        mp.setattr("functional_pp.checkpoint.load.PROBLEMS_SHOWN", 1)
        with pytest.raises(ck.CheckpointMismatchError) as info:
            ck.load_checkpoint(saved8, {"params": wrong}, keys=["params"])
        msg = str(info.value)
        assert msg.count("shape mismatch") == 1 and "more tensors that do not match" in msg
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"params\.layers\.0\.w1: dtype mismatch: checkpoint float32, "
                             r"model bfloat16"):
        ck.load_checkpoint(saved8, {"params": decls(dtype=torch.bfloat16)}, keys=["params"])


def test_different_model_lists_missing_and_unexpected_paths(saved8):
    other = decls(n_layers=3)
    for layer in other["layers"]:
        del layer["norm"]
    other["head"] = fpp.param((8, 16), "hidden vocab")
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.load_checkpoint(saved8, {"params": other})
    msg = str(info.value)
    assert "missing from the checkpoint (5): params.layers.2.w1, params.layers.2.w2, " \
           "params.layers.2.b1, params.layers.2.rope, params.head" in msg
    assert "unexpected in the checkpoint (2): params.layers.0.norm, params.layers.1.norm" in msg
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"different config:\n  model\.n_layers: checkpoint 2, expected 3"):
        ck.load_checkpoint(saved8, config={**CONFIG, "model": {"n_layers": 3, "hidden": 8}})
    r = ck.load_checkpoint(saved8, {"params": D}, config=CONFIG, keys=["params"])
    assert r.config == CONFIG


def test_no_checkpoint_in_directory(tmp_path):
    with pytest.raises(ck.CheckpointNotFoundError, match="no checkpoint in .*expected index.json"):
        ck.load_checkpoint(tmp_path)
    with pytest.raises(ck.CheckpointNotFoundError, match="does not exist"):
        ck.load_checkpoint(tmp_path / "nope")
    (tmp_path / "step-000005.tmp-abcd").mkdir()            # a crashed save is not a checkpoint
    (tmp_path / "step-000006").mkdir()                     # nor a directory without its index
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ck.CheckpointNotFoundError, match=r"pytorch_model\.bin.*pickle"):
        ck.load_checkpoint(tmp_path)


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".pkl"])
def test_pickle_files_are_refused_with_conversion_hint(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\x80\x04this would be unpickled")   # never opened
    for load in (ck.load_checkpoint, lambda p: ck.load_safetensors(p, D)):
        with pytest.raises(ck.UnsafeFormatError) as info:
            load(path)
        msg = str(info.value)
        assert str(path) in msg and "pickle" in msg.lower() and "execute arbitrary code" in msg
        assert "safetensors.torch.save_file(torch.load(" in msg and "weights_only=True" in msg


def test_save_rejects_inconsistent_inputs(tmp_path):
    def wrong_rules():     # shards made with other rules than the ones given to save
        p = fpp.init_params(D, seed=1, mesh=MESH8, rules=RULES8)
        ck.save_checkpoint(tmp_path, 1, {"params": p}, {"params": D}, rules=fpp.Rules(mlp="tp"))

    with pytest.raises(fpp.DeviceError, match=r"params\.embed: this device's tensor has shape "
                                              r"\(8, 2\).*block of shape \(16, 8\)"):
        fpp.launch(wrong_rules, MESH8)

    def unsharded_but_different():
        x = torch.full((2,), float(fpp.current_rank()))
        ck.save_checkpoint(tmp_path, 2, {"noise": x})

    with pytest.raises(fpp.DeviceError, match=r"noise has no spec .* differs from rank 0's.*PER_RANK"):
        fpp.launch(unsharded_but_different, fpp.Mesh(dp_shard=2))
    with pytest.raises(ck.CheckpointError, match="metadata must be JSON-serialisable"):
        ck.save_checkpoint(tmp_path, 3, {"x": torch.ones(1)}, metadata={"bad": object()})
    with pytest.raises(ck.CheckpointError, match=r"w: the value is a tensor but its spec is a dict"):
        ck.save_checkpoint(tmp_path, 3, {"w": torch.ones(1)}, {"w": {"a": None}})
    assert ck.CheckpointManager(tmp_path).steps() == []
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# --------------------------------------------------------------------------- real processes
def _gloo_save_and_load(root):
    mesh = fpp.current_mesh()
    rules = fpp.Rules(hidden="dp_shard", vocab="dp_shard")
    p = fpp.init_params(D, seed=1, mesh=mesh, rules=rules)
    path = ck.save_checkpoint(root, 4, {"params": p, "step": torch.tensor(4)}, {"params": D},
                              rules=rules, metadata={"loader": LOADER})
    other = fpp.Rules(mlp="dp_shard")                  # reshard on load
    r = ck.load_checkpoint(root, {"params": D}, rules=other)
    want = expected_shards(fpp.init_params(D, seed=1), mesh, other, fpp.current_rank())
    same = all(torch.equal(a, b) for (_, a), (_, b) in
               zip(fpp.leaves_with_paths(r.tree["params"]), fpp.leaves_with_paths(want)))
    return str(path), same, r.metadata, int(r.tree["step"])


@pytest.mark.multiprocess
def test_gloo_processes_save_and_load(tmp_path):
    out = fpp.launch(lambda: _gloo_save_and_load(tmp_path), fpp.Mesh(dp_shard=2),
                     processes=True, timeout=120)
    assert out == [(str(tmp_path / "step-000004"), True, {"loader": LOADER}, 4)] * 2
    assert sorted(p.name for p in (tmp_path / "step-000004").iterdir()) == \
        ["index.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    assert_trees_equal(ck.load_checkpoint(tmp_path).tree["params"], fpp.init_params(D, seed=1))
