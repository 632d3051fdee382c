"""``torch.compile`` of the step: tags that traced ops leave on the graph, the graph passes that
know tags, not meshes (recomputation of tagged regions: FSDP's re-gathers and remat regions;
re-inplacing), the backend that runs them with the passes it is given, per-layer compilation
and the gate that compiles once for every simulated device (docs/compile.md). The graph forms
of the communication mechanisms live with their eager forms (functional_pp/parallel/fsdp/,
functional_pp/parallel/buckets/)."""
