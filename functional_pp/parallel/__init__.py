"""Communication derived from layouts: raw and differentiable collectives with their
transposes, ``shard_map``, the ``Named`` array that reconciles layouts by inserting
collectives, resharding, parameter initialisation and sharding of trees, gradients,
data-parallel buckets and FSDP units (docs/semantics.md)."""
