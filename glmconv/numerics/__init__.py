"""Numbers, not bytes: FP8 block maths (`fp8`, `fp8_exact`, `fp8_reuse`), the dequantisers (`dequant`) and the
NaN/Inf check of tensors (`finite`). Nothing here opens a file; io/ reads and writes, and calls these."""
