"""Shared oracle machinery: run a named-axis loss on one device and under a layout."""
from __future__ import annotations

import contextlib

import torch

import functional_pp as fpp
from functional_pp.core import tree
from functional_pp.models import llama
from functional_pp.parallel import sharding


def make_batch(cfg, batch=4, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def local_batch(full, mesh, rules):
    """This device's block of a global batch, laid out (and ordered) by the rules (a
    vision-language batch's image entries by their own dimensions, data/images.py)."""
    from functional_pp.data.images import IMAGE_DIMS
    return {k: fpp.named(v, IMAGE_DIMS.get(k, "batch seq")) for k, v in full.items()}


def single_device(cfg, full_params, batch, loss_fn=llama.loss, dtype=torch.float64):
    decls = llama.init(cfg, dtype)
    params = tree.tree_map(lambda x: x.clone().requires_grad_(), full_params)
    named = sharding.named_tree(params, decls)
    from functional_pp.data.images import IMAGE_DIMS
    b = {k: fpp.wrap(v, IMAGE_DIMS.get(k, "batch seq")) for k, v in batch.items()}
    loss = loss_fn(named, b, cfg).value()
    loss.backward()
    return loss.detach(), tree.tree_map(lambda p: p.grad, params)


def parallel(cfg, full_params, batch, mesh, rules, loss_fn=llama.loss, dtype=torch.float64,
             report=False, options=None, gather=True):
    decls = llama.init(cfg, dtype)

    def fn():
        with fpp.use_rules(rules), fpp.configure(**(options or {})):
            local = tree.tree_map(lambda x: x.clone().requires_grad_(),
                                  sharding.shard(full_params, decls, mesh, rules, fpp.current_rank()))
            named = sharding.named_tree(local, decls)
            with fpp.comm_report() as rep:
                loss = loss_fn(named, local_batch(batch, mesh, rules), cfg).value()
                loss.backward()
            grads = tree.tree_map(lambda p: p.grad, local)
            full = fpp.gather_tree(grads, decls, rules) if gather else grads
        return loss.detach(), full, rep
    return fpp.launch(fn, mesh)


def train_steps(cfg, data, mesh, rules, dtype=torch.float64, opt=None, device=None, wrap_loss=None,
                loss_as_traced=False, **step_kw):
    """A launchable function: ``len(data)`` steps of ``fpp.train_step`` (AdamW by default); per
    device the losses, the gathered parameters (numpy) and the collectives of the first step.
    ``device``: where the parameters and batches live (default the CPU); ``wrap_loss``: applied to
    the Llama loss (e.g. fake quantization's ``adapt``); ``loss_as_traced``: an eager step
    computes the cross-entropy as a traced one does (``ops.loss.logits_widened_whole``: the
    reference a compiled run is compared with)."""
    import contextlib
    import functools

    from functional_pp.ops.loss import logits_widened_whole
    opt = opt or fpp.optim.adamw(3e-3, weight_decay=0.1, clip_norm=1.0)
    loss = functools.partial(llama.loss, cfg=cfg)
    step = fpp.train_step(wrap_loss(loss) if wrap_loss else loss, opt, mesh=mesh, rules=rules, **step_kw)

    def run():
        state = step.init(fpp.init(llama.init, cfg, dtype, mesh=mesh, rules=rules, seed=0, device=device))
        losses, events = [], None
        for b in data:
            with fpp.use_rules(rules):
                local = {k: v.data.to(device) for k, v in local_batch(b, mesh, rules).items()}
            with fpp.comm_report() as rep, (logits_widened_whole() if loss_as_traced else contextlib.nullcontext()):
                state, m = step(state, local)
            losses.append(m["loss"])
            events = rep.events if events is None else events
        with fpp.use_rules(rules):
            full = fpp.gather_tree(state["params"], llama.init(cfg, dtype), rules)
        return losses, {p: x.cpu().numpy() for p, x in fpp.leaves_with_paths(full)}, events
    return run


def launch_steps(cfg, compile=False, mesh=None, rules=None, steps=2, batch=4, dtype=torch.float32,
                 processes=False, **step_kw):
    """``train_steps`` of ``steps`` fresh batches, launched on every device of ``mesh`` (one
    device by default): per device ``(losses, gathered parameters, first-step collectives)``."""
    mesh, rules = mesh or fpp.Mesh(), rules or fpp.Rules()
    data = [make_batch(cfg, batch=batch, seq=16, seed=i) for i in range(steps)]
    return fpp.launch(train_steps(cfg, data, mesh, rules, dtype, compile=compile, **step_kw), mesh,
                      timeout=1800, processes=processes)


def assert_processes_equal_one_device(cfg, mesh=None, rules=None, **step_kw):
    """Two float64 AdamW steps on every rank of ``mesh`` (default FSDP x TP, 2 x 2) as real gloo
    processes equal the same steps on one device: losses and gathered parameters. Returns the
    one device's ``(losses, parameters, collectives)``."""
    mesh = mesh or fpp.Mesh(dp_shard=2, tp=2)
    one = launch_steps(cfg, dtype=torch.float64, **step_kw)[0]
    real = launch_steps(cfg, mesh=mesh, rules=rules or llama.default_rules(), dtype=torch.float64, processes=True,
                        **step_kw)
    for losses, params, _ in real:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=1e-10, atol=0)
        for p, x in params.items():
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(one[1][p]), rtol=1e-8, atol=1e-12,
                                       msg=lambda m: f"{p}: {m}")
    return one


def assert_same_run(a, b, rtol=0.0, atol=0.0):
    """Losses and parameters of two ``train_steps`` results agree (bitwise by default)."""
    la, pa, _ = a
    lb, pb, _ = b
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=rtol, atol=atol)
    assert pa.keys() == pb.keys()
    for p in pa:
        torch.testing.assert_close(torch.from_numpy(pa[p]), torch.from_numpy(pb[p]), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{p}: {m}")


def nan_on_second_call(loss_fn):
    """``loss_fn`` whose second call returns a NaN loss (a step to be skipped)."""
    calls = {"n": 0}

    def wrapped(params, batch):
        calls["n"] += 1
        loss = loss_fn(params, batch)
        return loss * float("nan") if calls["n"] == 2 else loss
    return wrapped


@contextlib.contextmanager
def hf_scan_in_fp64():
    """transformers' Mamba2 scan and gated norm cast to float32 (``.float()``, ``.to(torch.float32)``):
    kept in float64 inside this context, so a float64 model of a hybrid family is an oracle to
    float64 rounding (with the casts: ~1e-6)."""
    real_float, real_to = torch.Tensor.float, torch.Tensor.to
    torch.Tensor.float = lambda t: t if t.dtype == torch.float64 else real_float(t)
    torch.Tensor.to = lambda t, *a, **kw: t if t.dtype == torch.float64 and a == (torch.float32,) else real_to(t, *a, **kw)
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = real_float, real_to


def fp64_beside_hf(hf_dir, hf_class: str = "AutoModelForCausalLM", seq: int = 12, **load_kw):
    """One float64 step of ours and of transformers (its class ``hf_class``) on the Hugging Face
    directory ``hf_dir`` and a fixed batch (3 rows of ``seq`` tokens): ``(model, cfg, loss, grads,
    out, want)``: transformers' model and output, our config, loss and gradients by path, and
    transformers' cross-entropy (its backward not run)."""
    import torch.nn.functional as F
    import transformers
    from functional_pp.checkpoint import hf
    model = getattr(transformers, hf_class).from_pretrained(hf_dir, dtype=torch.float64, **load_kw)
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=3, seq=seq, seed=2)
    loss, grads = single_device(cfg, params, batch)
    out = model(input_ids=batch["tokens"])
    want = F.cross_entropy(out.logits.reshape(-1, cfg.vocab), batch["labels"].reshape(-1))
    return model, cfg, loss, grads, out, want


def import_logits_beside_hf(model, hf_dir, atol=1e-5):
    """Our logits of the Hugging Face directory ``hf_dir`` equal ``model``'s on fixed tokens;
    returns ``(cfg, params, toks, want)`` for the checks that each option matters."""
    from functional_pp.checkpoint import hf
    cfg, params = hf.load_hf_llama(hf_dir)
    toks = tokens()
    with torch.no_grad():
        want = model(input_ids=toks).logits
    assert want.abs().max() > 0.5
    torch.testing.assert_close(our_logits(params, cfg, toks), want, atol=atol, rtol=1e-5)
    return cfg, params, toks, want


def saved_hf_model(model, out_dir, perturb: tuple[str, ...] = ("norm", "dt_bias")):
    """``(model, out_dir)``: transformers' ``model`` with the parameters whose names hold one of
    ``perturb`` moved off their initial values (ones, zeros: a test then sees them), saved to
    ``out_dir`` as safetensors, then set to transformers' eager attention and experts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in perturb):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    model.config._attn_implementation = "eager"
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    return model, out_dir


def assert_nf4_base_equals_bitsandbytes(model, out_dir, **load_kw) -> dict:
    """QLoRA's base (``load_in_4bit``, NF4 without double quantization): transformers' ``model``
    saved to ``out_dir`` and loaded by transformers + bitsandbytes gives our logits of the same
    checkpoint with :func:`quantize_linear_weights`; the quantization acts (the logits move off the
    full model's). Returns our quantized parameters (for the caller's check of which are)."""
    from functional_pp.checkpoint import hf
    from functional_pp.models.quantize import quantize_linear_weights
    from functional_pp.parallel import sharding
    model.save_pretrained(out_dir)
    with torch.no_grad():
        full = model(input_ids=tokens()).logits
    import transformers
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                                          bnb_4bit_compute_dtype=torch.float32)
    q = transformers.AutoModelForCausalLM.from_pretrained(out_dir, quantization_config=bnb, dtype=torch.float32,
                                                          device_map="cpu", **load_kw).eval()
    for module in q.modules():           # (bitsandbytes' bf16 CPU path off: the fp32 compute asked for)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        want = q(input_ids=tokens()).logits
    cfg, params = hf.load_hf_llama(out_dir)
    qp, qd = quantize_linear_weights(params, llama.init(cfg), "nf4", double_quant=False)
    with torch.no_grad():
        got = llama.forward(sharding.named_tree(qp, qd), fpp.wrap(tokens(), "batch seq"), cfg).value()
    assert (want - full).abs().max() > 0.01
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    return qp


def tokens(batch=4, seq=12, seed=1):
    """Random token ids below 256 (the tiny Hugging Face models' vocabulary)."""
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def our_logits(params, cfg, toks):
    """Our Llama-style decoder's logits for a full parameter tree ``params`` (one device)."""
    named = sharding.named_tree(params, llama.init(cfg))
    with torch.no_grad():
        return llama.forward(named, fpp.wrap(toks, "batch seq"), cfg).value()


def peft_lora(model, targets, seed: int):
    """peft's LoRA (r 4, alpha 8, no dropout) on the transformers ``model`` at ``targets``, its B
    matrices random (0.1 N(0, 1) from a generator seeded ``seed``, so that the adapters act)."""
    import peft
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return pm


def random_lora(decls, g: torch.Generator) -> dict:
    """Full adapters of ``decls`` (``adapters.init``): A as initialised, B random (nonzero, so
    that the adapters act)."""
    from functional_pp import adapters
    return {p: {"lora_A": ab["lora_A"].data, "lora_B": 0.1 * torch.randn(ab["lora_B"].data.shape, generator=g)}
            for p, ab in adapters.split(fpp.init(lambda: decls, seed=0))[1].items()}


def adapted_logits(base, lora, decls, lc, cfg, toks) -> torch.Tensor:
    """Our logits of ``toks`` with the adapters ``lora`` (config ``lc``) on ``base``."""
    from functional_pp import adapters
    with torch.no_grad():
        return adapters.adapt(llama.forward, lc)(sharding.named_tree(adapters.joined(base, lora), decls),
                                                 fpp.wrap(toks, "batch seq"), cfg).value()


def assert_export_round_trip(hf_dir, out_dir, model_type: str, hf_class: str, atol: float = 1e-5, **load_kw):
    """Export of a Hugging Face directory's model (weights moved off the file's values) writes
    ``model_type`` / ``hf_class``, which transformers loads with our logits (within ``atol``), and
    which we read back to the same config and the same tensors."""
    import json

    import transformers

    from functional_pp.checkpoint import hf
    cfg, params = hf.load_hf_llama(hf_dir)
    params = tree.tree_map(lambda t: t + 0.01 * torch.randn_like(t), params)     # not the file's values
    out = hf.save_hf_llama(params, cfg, out_dir)
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (model_type, [hf_class])
    auto = transformers.AutoModelForCausalLM       # (5.25's does not map Mistral4Config: its class then)
    loader = auto if hf_class != "Mistral4ForCausalLM" else getattr(transformers, hf_class)
    back = loader.from_pretrained(out, dtype=torch.float32, **load_kw)
    assert type(back).__name__ == hf_class
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=toks).logits, our_logits(params, cfg, toks), atol=atol, rtol=1e-5)
    cfg2, again = hf.load_hf_llama(out)
    assert cfg2 == cfg
    for (p, a), (_, b) in zip(tree.leaves_with_paths(params), tree.leaves_with_paths(again)):
        assert torch.equal(a, b), p


ADAPTER_LAYOUTS = {"dp": (fpp.Mesh(dp_shard=2), fpp.Rules(batch="dp_shard")),
                   "fsdp": (fpp.Mesh(dp_shard=2), llama.default_rules(tp=False)),
                   "tp": (fpp.Mesh(tp=2), llama.default_rules(fsdp=False)),
                   "fsdp_tp": (fpp.Mesh(dp_shard=2, tp=2), llama.default_rules())}


def train_adapters(cfg, lc, decls, full, data, mesh, rules, lr=1e-2, wd=0.1, **step_kw):
    """AdamW steps of adapter training (``lc``: LoRA / DoRA) from the full tree ``full``, one per
    batch of ``data`` (a vision-language batch's image entries laid out by their own dimensions:
    give ``batch_dims``); per device the losses, the first step's adapter gradients and the full
    adapters after the steps."""
    import functools

    from functional_pp import adapters
    loss = adapters.adapt(functools.partial(llama.loss, cfg=cfg), lc)
    step = fpp.train_step(loss, fpp.optim.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd), mesh=mesh,
                          rules=rules, trainable=adapters.trainable(lc), **step_kw)

    def device():
        with fpp.use_rules(rules):
            state = step.init(sharding.named_tree(sharding.shard(full, decls, mesh, rules, fpp.current_rank()), decls))
        grads, losses = None, []
        for b in data:
            with fpp.use_rules(rules):
                dims = step_kw.get("batch_dims") or {}
                lb = {k: (fpp.named(v, dims[k]) if k in dims else local_batch({k: v}, mesh, rules)[k]).data
                      for k, v in b.items()}
            if grads is None:
                _, g = step.gradients(state, lb)
                with fpp.use_rules(rules):
                    grads = adapters.split(fpp.gather_tree(g))[1]
            state, m = step(state, lb)
            losses.append(float(m["loss"]))
        with fpp.use_rules(rules):
            lora = adapters.split(fpp.gather_tree(state["params"], decls, rules))[1]
        return losses, grads, lora
    return fpp.launch(device, mesh)


def assert_adapter_layouts_equal_one_device(cfg, lc, full):
    """Two fp64 steps (the layouts' sums, not Adam's rounding) of adapter training on every
    layout of ``ADAPTER_LAYOUTS`` equal one device: losses and every adapter tensor."""
    from functional_pp import adapters
    decls = adapters.init(llama.init(cfg, torch.float64), lc)
    full = tree.tree_map(lambda x: x.double(), full)
    data = [make_batch(cfg, batch=4, seq=12, seed=s) for s in range(2)]
    one = train_adapters(cfg, lc, decls, full, data, fpp.Mesh(), fpp.Rules())[0]
    for name, (mesh, rules) in ADAPTER_LAYOUTS.items():
        for run in train_adapters(cfg, lc, decls, full, data, mesh, rules):
            torch.testing.assert_close(torch.tensor(run[0]), torch.tensor(one[0]), rtol=1e-10, atol=1e-12)
            assert run[2].keys() == one[2].keys()
            for p in one[2]:
                for k in one[2][p]:
                    torch.testing.assert_close(run[2][p][k], one[2][p][k], rtol=1e-8, atol=1e-10,
                                               msg=lambda m: f"{name} {p}.{k}: {m}")


def tiny_qwen3_finetune(root, config: str, model: str = "tiny-qwen3", *sets: str):
    """A fine-tune through the CLI of ``examples/configs/<config>`` on a tiny Qwen3 that
    examples/make_tiny_hf_qwen3.py writes under ``root`` (``model``: which of its models;
    nothing downloaded), its alpaca data, and ``--set`` overrides ``sets``; returns the
    model's directory and the run's output directory."""
    import importlib.util
    from pathlib import Path

    from functional_pp import cli
    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3", examples / "make_tiny_hf_qwen3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inputs = mod.main(root / "inputs")
    out = root / "run"
    args = ["train", str(examples / "configs" / config), "--set", f"base_model={inputs / model}",
            "--set", f"datasets=[{{path: {inputs / 'alpaca.jsonl'}, type: alpaca}}]"]
    assert cli.main([*args, *(a for s in sets for a in ("--set", s)), "--output", str(out)]) == 0
    return inputs / model, out


def run_lora_config(out):
    """A run's LoRA settings, as its checkpoint records them (what export reads)."""
    from functional_pp import adapters
    from functional_pp import checkpoint as ck
    meta = ck.format.read_index(ck.format.resolve_checkpoint(out / "checkpoints")).get("metadata")
    return adapters.LoraConfig(**meta["lora"])


def assert_lora_step_equals_peft(model, hf_dir, targets, count: int | None = None, layers: int | None = None) -> None:
    """LoRA (r 4, B random and nonzero) on ``targets`` of transformers' ``model`` (loaded from
    ``hf_dir``): our loss and every adapter gradient of one step equal peft's; ``count``: how many
    adapter tensors that makes (default: every target in each of ``layers``, default every layer)."""
    import peft
    import torch.nn.functional as F

    from functional_pp import adapters
    from functional_pp.adapters import peft_dir
    from functional_pp.checkpoint import hf
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets)))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn_like(p))
    cfg = hf.config_from_hf(hf_dir)
    lc = adapters.LoraConfig(r=4, alpha=8, target_modules=tuple(targets))
    decls = adapters.init(llama.init(cfg), lc)
    state = {k.replace(".default", ""): v.detach().clone() for k, v in pm.state_dict().items() if "lora_" in k}
    full = adapters.joined(hf.load_hf_params(hf_dir, cfg), peft_dir.from_peft(state, decls, cfg.model_type))
    batch = make_batch(cfg, batch=2, seq=12, seed=3)
    ours = train_adapters(cfg, lc, decls, full, [batch], fpp.Mesh(), fpp.Rules(), 1e-2, 0.1)[0]
    logits = pm(input_ids=batch["tokens"]).logits
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    ref.backward()
    torch.testing.assert_close(torch.tensor(float(ours[0][0])), ref.detach().reshape(()), rtol=1e-5, atol=1e-6)
    grads = peft_dir.to_peft(ours[1], cfg.model_type)    # (Mistral Small 4: its shared expert's names)
    want = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}
    assert grads.keys() == want.keys() and len(want) == (count or 2 * len(targets) * (layers or cfg.layers))
    for k in want:
        assert want[k].abs().max() > 0, k
        # (fp32 round-off of two implementations is relative to the gradient's scale, not each
        # element's: an element near zero may differ by 1e-6 of a gradient of order 0.1)
        atol = max(1e-6, 1e-5 * float(want[k].abs().max()))
        torch.testing.assert_close(grads[k], want[k], rtol=1e-4, atol=atol, msg=lambda m: f"grad {k}: {m}")


def assert_fake_quant_equals_hf(model, hf_dir, qat, out_dir, acts_by: float) -> None:
    """Our logits and every gradient of the Hugging Face directory ``hf_dir`` under fake
    quantization ``qat`` equal those of ``model`` (transformers with the library's fake-quantized
    linears), and differ from the plain model's logits by more than ``acts_by`` (so it acts)."""
    from safetensors.torch import load_file

    from functional_pp.checkpoint import hf
    from functional_pp.ops import fake_quant
    toks = tokens(batch=2, seq=12)
    want = model(input_ids=toks).logits
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * up).sum().backward()
    cfg, full = hf.load_hf_llama(hf_dir)
    decls = llama.init(cfg)
    leaves = tree.tree_map(lambda t: t.clone().requires_grad_(), full)
    got = fake_quant.adapt(llama.forward, qat)(sharding.named_tree(leaves, decls), fpp.wrap(toks, "batch seq"), cfg)
    got = got.value()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    plain = llama.forward(sharding.named_tree(full, decls), fpp.wrap(toks, "batch seq"), cfg).value()
    assert (plain - want).abs().max() > acts_by
    (got * up).sum().backward()
    hf.save_hf_llama(tree.tree_map(lambda t: t.grad, leaves), cfg, out_dir / "grads")
    grads = load_file(str(out_dir / "grads" / "model.safetensors"))
    theirs = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(theirs)
    for name, gr in grads.items():
        torch.testing.assert_close(gr, theirs[name], atol=2e-4, rtol=1e-4, msg=name)


def assert_cp_equals_one_device(hf_dir, lengths=(5, 9, 10), mesh=None, rules=None) -> None:
    """One float64 step of ``hf_dir``'s model with the sequence (24) split over cp (default: CP 2 x TP 2,
    load-balanced, FSDP over cp): plain rows, and rows of packed documents of ``lengths`` (``segments``,
    crossing the blocks' boundaries); the loss and every gradient equal one device's."""
    from functional_pp.checkpoint import hf
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(4, -1).contiguous()
    plain = make_batch(cfg, batch=4, seq=seg.shape[1], seed=3)
    for batch in (plain, {**plain, "segments": seg}):
        loss, grads = single_device(cfg, params, batch)
        p_loss, p_grads, _ = parallel(cfg, params, batch, mesh or fpp.Mesh(cp=2, tp=2), rules or llama.default_rules())[0]
        torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
        for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m, path=path: f"{path}: {m}")


def assert_hf_layout_equals_one_device(hf_dir, layout: str) -> None:
    """One float64 step of the Hugging Face directory ``hf_dir``'s model under ``layout``
    ("fsdp_tp_sp": FSDP 2 x TP 2 with sequence parallelism; "cp": CP 2) on simulated devices:
    the loss and every gradient equal one device's."""
    from functional_pp.checkpoint import hf
    cfg, params = hf.load_hf_llama(hf_dir, dtype=torch.float64)
    batch = make_batch(cfg, batch=4, seq=12, seed=3)
    loss, grads = single_device(cfg, params, batch)
    mesh, rules = ((fpp.Mesh(dp_shard=2, tp=2), llama.default_rules(sequence_parallel=True))
                   if layout == "fsdp_tp_sp" else (fpp.Mesh(cp=2), llama.default_rules(tp=False)))
    p_loss, p_grads, _ = parallel(cfg, params, batch, mesh, rules)[0]
    torch.testing.assert_close(p_loss, loss, rtol=1e-10, atol=1e-12)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(p_grads), tree.leaves_with_paths(grads)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11, msg=lambda m: f"{path}: {m}")


def linearized_llama4(sd: dict) -> dict:
    """The state dict ``sd`` with each layer's stacked experts as Axolotl's linearized Llama 4
    holds them (its ``Llama4TextExperts``: one ``nn.Linear`` [out, in] per expert's gate / up / down)."""
    out = {}
    for k, t in sd.items():
        if k.endswith("experts.gate_up_proj"):
            pre, f = k.removesuffix(".gate_up_proj"), t.shape[-1] // 2
            for j in range(t.shape[0]):
                out[f"{pre}.gate_projs.{j}.weight"] = t[j, :, :f].T.contiguous()
                out[f"{pre}.up_projs.{j}.weight"] = t[j, :, f:].T.contiguous()
        elif k.endswith("experts.down_proj"):
            for j in range(t.shape[0]):
                out[f"{k.removesuffix('.down_proj')}.down_projs.{j}.weight"] = t[j].T.contiguous()
        else:
            out[k] = t
    return out


def bnb_nf4_serialized(sd: dict, double_quant: bool = False) -> dict:
    """``sd`` with its linear weights (not the router, norms, embedding or head) as bitsandbytes
    serializes a 4-bit ``Params4bit``: the packed codes and ``quant_state.as_dict(packed=True)``."""
    import bitsandbytes.functional as F
    out = {}
    for k, t in sd.items():
        if t.ndim == 2 and k.endswith("_proj.weight") or "_projs." in k:
            packed, qs = F.quantize_4bit(t.to(torch.bfloat16), blocksize=64, quant_type="nf4",
                                         compress_statistics=double_quant)
            out[k] = packed
            out.update({f"{k}.{c}": v for c, v in qs.as_dict(packed=True).items()})
        else:
            out[k] = t.to(torch.bfloat16)
    return out


def gptq_pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """GPTQ's packing, written from the format's description: ``32 / bits`` codes (ints in
    ``[0, 2**bits)``) per int32 along ``dim``, entry ``j`` of each run in bits ``[j*bits, (j+1)*bits)``."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    word = sum(c[..., j] << (bits * j) for j in range(per))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32).movedim(-1, dim).contiguous()


def gptq_quantize(w_hf: torch.Tensor, bits: int = 4, group: int = 32, desc_act: bool = True, v1: bool = True,
                  seed: int = 0) -> tuple[dict, torch.Tensor]:
    """``({qweight, qzeros, scales, g_idx}, weight)``: HF linear weight ``w_hf`` [out, in] rounded
    to asymmetric ``bits``-bit codes per group of input rows (act order: the rows of a group picked
    by a random permutation, ``g_idx`` the group of each row), packed as a GPTQ checkpoint stores
    them (v1: zero points minus one), and the fp16 ``[out, in]`` weight the codes stand for:
    ``scale * (code - zero)`` rounded once."""
    w = w_hf.T.double()                                       # [in, out]
    inp, out = w.shape
    size = inp if group == -1 else group
    order = torch.randperm(inp, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int64)
    g_idx[order] = torch.arange(inp) // size
    groups, maxq = -(-inp // size), 2 ** bits - 1
    scales, zeros = torch.empty(groups, out, dtype=torch.float16), torch.empty(groups, out, dtype=torch.int64)
    for k in range(groups):
        rows = w[g_idx == k]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[k] = ((hi - lo) / maxq).clamp(min=1e-4).half()
        zeros[k] = torch.round(-lo / scales[k].double()).clamp(1 if v1 else 0, maxq).long()
    codes = (torch.round(w / scales[g_idx].double()) + zeros[g_idx]).clamp(0, maxq).long()
    weight = (scales[g_idx].double() * (codes - zeros[g_idx])).half().T.contiguous()
    stored = zeros - 1 if v1 else zeros
    return {"qweight": gptq_pack(codes, bits, 0), "qzeros": gptq_pack(stored, bits, 1), "scales": scales,
            "g_idx": g_idx.to(torch.int32)}, weight


def gptq_serialized(sd: dict, bits: int = 4, group: int = 32, desc_act: bool = True, v1: bool = True
                    ) -> tuple[dict, dict, dict]:
    """``(tensors, dequantized, quantization_config)``: ``sd`` with its linear weights (``*_proj.weight``)
    as a GPTQ checkpoint's ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` (:func:`gptq_quantize`),
    the other tensors as they are; ``dequantized``: ``sd`` with the weights the codes stand for; and
    the ``quantization_config`` of its config.json."""
    out, deq = {}, {}
    for i, (k, t) in enumerate(sd.items()):
        if t.ndim == 2 and k.endswith("_proj.weight"):
            parts, deq[k] = gptq_quantize(t, bits, group, desc_act, v1, seed=i)
            out.update({k.removesuffix("weight") + c: v for c, v in parts.items()})
        else:
            out[k], deq[k] = t, t
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": False,
          "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return out, deq, qc


def assert_1f1b_equals_one_device(cfg, batch=8, grad_accum=4, lr=3e-3, rtol=1e-10, atol=0.0) -> list[float]:
    """Two AdamW steps of ``cfg``'s model (float64) with its layers over pp 2 under 1F1B
    (``grad_accum`` micro-batches of ``batch`` rows of 8 tokens) give one device's losses; those."""
    import functools

    from functional_pp.step.pipeline import pipeline_step
    data = [make_batch(cfg, batch=batch, seq=8, seed=s) for s in range(2)]
    loss, opt = functools.partial(llama.loss, cfg=cfg), fpp.optim.adamw(lr, weight_decay=0.1)

    def run(step):
        def device():
            state = step.init(fpp.init(llama.init, cfg, torch.float64, seed=0, mesh=step.mesh, rules=step.rules))
            losses = []
            for b in data:
                with fpp.use_rules(step.rules):
                    local = {k: fpp.named(v, "batch seq").data for k, v in b.items()}
                state, m = step(state, local)
                losses.append(float(m["loss"]))
            return losses
        return fpp.launch(device, step.mesh)
    one = run(fpp.train_step(loss, opt, mesh=fpp.Mesh(), rules=fpp.Rules(), grad_accum=grad_accum))[0]
    first, last = llama.pipeline_ends(cfg)
    for losses in run(pipeline_step(loss, opt, mesh=fpp.Mesh(pp=2), rules=fpp.Rules(layers="pp"),
                                    grad_accum=grad_accum, schedule="1f1b", first_stage=first, last_stage=last)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one), rtol=rtol, atol=atol)
    return one


def assert_packed_documents_equal_hf(model, hf_dir, atol=3e-5) -> None:
    """Packed rows (``segments``: two documents per row) of ``hf_dir``'s model: each document's
    logits equal the transformers ``model``'s logits of that document alone, and the second
    document of the first row differs from transformers' unpacked row (the documents do separate)."""
    from functional_pp.checkpoint import hf
    cfg, params = hf.load_hf_llama(hf_dir)
    toks, seg = tokens(batch=2, seq=12), torch.tensor([[0] * 5 + [1] * 7, [3] * 9 + [4] * 3])
    got = llama.forward(sharding.named_tree(params, llama.init(cfg)), fpp.wrap(toks, "batch seq"), cfg,
                        segments=fpp.wrap(seg, "batch seq")).value()
    with torch.no_grad():
        for b in range(2):
            for doc in seg[b].unique():
                at = (seg[b] == doc).nonzero().flatten()
                torch.testing.assert_close(got[b:b + 1, at], model(input_ids=toks[b:b + 1, at]).logits, atol=atol,
                                           rtol=1e-5)
        assert not torch.allclose(got[0, 5:], model(input_ids=toks[:1]).logits[0, 5:], atol=1e-3)
