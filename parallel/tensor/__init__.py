"""Tensor and sequence parallelism (Megatron): column/row linears, f and g, vocab-parallel
embedding and cross-entropy, sequence-parallel regions, placement plans."""
