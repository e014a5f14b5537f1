"""natsim.kernels.common: what every kernel family shares. Where a call runs (Triton or the torch reference),
tensor checks, launch options and tensor descriptors, the online-softmax step, and the backward passes' delta
kernel and per-pair gradient steps; nothing here knows GNA windows or block masks.
"""
