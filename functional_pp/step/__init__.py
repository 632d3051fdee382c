"""The training step: ``train_step`` (forward, backward, gradient reduction and the optimizer
update in one function, eager or compiled), its buffers and donation, the non-finite guard
and the metrics it returns (docs/policy.md)."""
