"""Gluon kernels (Triton's lower-level language) for Hopper: what Triton's compiler does not schedule well enough
on its own, written with explicit warp specialization, TMA and asynchronous warpgroup products."""
