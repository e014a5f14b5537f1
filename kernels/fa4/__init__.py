"""natsim.kernels.fa4: FlashAttention-4's Hopper kernels under natsim's calls. What natsim computes for them (the
GNA element mask as a `mask_mod`, block-sparse lists from the simulator or a block mask) and the calls into
`flash_attn.cute.interface`; kernels/backends/fa4.py says what they run."""
