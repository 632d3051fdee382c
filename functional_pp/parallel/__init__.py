"""Communication derived from layouts: raw and differentiable collectives with their
transposes, ``shard_map``, the ``Named`` array that reconciles layouts by inserting
collectives, resharding, parameter initialisation and sharding of trees, gradients, and two mechanisms in
folders of their own, each eager form beside its compiled one: ``fsdp/`` (every FSDP path) and
``buckets/`` (data-parallel gradient buckets); ``step_backend.py`` hands a compiled step their
graph passes (docs/semantics.md)."""
