"""The plan runners: convert (HF -> torch_dist), export (torch_dist -> HF), relayout (between Megatron layouts),
verify (every value), audit (plan vs disk), and how they run as 1, N or torchrun ranks (`flow`, `ranks`)."""
