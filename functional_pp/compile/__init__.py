"""``torch.compile`` of the step: tags that traced ops leave on the graph, the graph passes
(recomputation of FSDP gathers and remat regions, overlap of collectives, re-inplacing), the
backend that runs them, per-layer compilation and the gate that compiles once for every
simulated device (docs/compile.md). Each pass says which eager mechanism it mirrors."""
