"""Rank every layout of a Llama 3 8B (4 layers shown, for speed) on 8 devices by estimated
communication time and memory, without running it: meta tensors on simulated devices."""
import functools

import torch

from functional_pp import plan
from functional_pp.models import llama

cfg = llama.Config.llama3_8b(layers=4)
batch = {"tokens": ((8, 2048), "batch seq"), "labels": ((8, 2048), "batch seq")}
bandwidth = {"tp": 400e9, "cp": 50e9, "dp_shard": 50e9, "dp_replicate": 25e9}   # bytes/s per device
ranked = plan.search(functools.partial(llama.loss, cfg=cfg), llama.init(cfg, torch.bfloat16), 8, batch,
                     rules_for=lambda mesh: llama.default_rules(), bandwidth=bandwidth,
                     memory_limit_bytes=12e9)
print(plan.table(ranked))
for note in ranked[0].notes:
    print(note)
print("\ncommunication of the best layout, per device and step:")
print(ranked[0].comm)
