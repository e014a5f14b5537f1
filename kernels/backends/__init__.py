"""natsim.kernels.backends: the seam between natsim's calls and the kernels that run them. Every backend (natsim's
Triton kernels, the torch reference, FlashAttention-4) declares what it runs in a `Capabilities` table per kernel
family; the planner and the dispatchers read those tables (`capabilities(backend, family)`) instead of kernel
internals. What the rooms above need to know about the Triton kernels themselves is
`natsim.kernels.backends.triton`."""

from .capabilities import FEATURES, Capabilities
from .registry import BACKENDS, FAMILIES, capabilities

__all__ = ["Capabilities", "FEATURES", "BACKENDS", "FAMILIES", "capabilities"]
