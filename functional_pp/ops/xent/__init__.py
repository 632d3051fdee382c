"""Cross-entropy over a vocabulary: the fused head projection and loss (``linear``), its
chunked and row-wise kernels (docs/memory.md)."""
