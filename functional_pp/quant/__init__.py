"""Blockwise quantization: code tables (bitsandbytes' dynamic 8-bit map, NF4) and the
quantize / dequantize of tensors in blocks along their last dimension with one absmax scale
per block (docs/quantization.md). Pure tensor functions; used by the 8-bit optimizer state
(``optim``) and the quantized frozen weights (``ops``, ``models``)."""
