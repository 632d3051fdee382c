"""Train the tiny Llama on the Python standard library with the library API (no CLI):
FSDP x context parallelism x tensor parallelism (with sequence parallelism) on 8 simulated
devices, then save a sharded checkpoint.  Run:  python examples/train.py [OUTPUT_DIR]"""
import functools
import sys

import functional_pp as fpp
from functional_pp import checkpoint as ckpt
from functional_pp.data import DataLoader, batch_shard, load_corpus
from functional_pp.models import llama

STEPS, GLOBAL_BATCH, SEQ = 30, 8, 64
OUT = sys.argv[1] if len(sys.argv) > 1 else "runs/example"
cfg = llama.Config.tiny()
mesh = fpp.Mesh(dp_shard=2, cp=2, tp=2)                  # 8 devices, tp innermost
rules = llama.default_rules(sequence_parallel=True)      # FSDP over dp_shard x cp, TP over heads/mlp/vocab
schedule = fpp.optim.make_schedule(3e-3, "cosine", warmup_steps=5, total_steps=STEPS)
opt = fpp.optim.adamw(schedule, weight_decay=0.1, clip_norm=1.0, mask=fpp.optim.decay_mask_by_ndim)
step = fpp.train_step(functools.partial(llama.loss, cfg=cfg), opt, mesh=mesh, rules=rules,
                      lr_schedule=schedule)
corpus = load_corpus(max_bytes=2_000_000)                # stdlib *.py as bytes: vocab 256


def device():
    """Runs on every device: build this device's shards, train, save."""
    state = step.init(fpp.init(llama.init, cfg, mesh=mesh, rules=rules, seed=0))
    loader = DataLoader(corpus, global_batch_size=GLOBAL_BATCH, seq_len=SEQ, seed=0,
                        **batch_shard(mesh, rules).loader_args())   # this device's block, by the rules
    losses = []
    for _, batch in zip(range(STEPS), loader):           # batch: this device's block
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        if fpp.current_rank() == 0 and metrics["step"] % 5 == 0:
            print(f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}  "
                  f"{metrics['tokens_per_s_avg']:,.0f} tokens/s")
    decls = llama.init(cfg)
    tree = {"params": state["params"], "opt": state["opt_state"], "step": state["step"]}
    specs = {"params": decls, "opt": ckpt.state_specs(state["opt_state"], decls)}
    path = ckpt.save_checkpoint(OUT, int(state["step"]), tree, specs, rules=rules,
                                metadata={"loader": loader.state_dict()})
    return losses, path


if __name__ == "__main__":
    losses, path = fpp.launch(device, mesh)[0]           # results in rank order
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; checkpoint {path}")
