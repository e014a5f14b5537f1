"""natsim.kernels.backends: the seam between natsim's calls and the kernels that run them. Every backend (natsim's
Triton kernels, the torch reference, FlashAttention-4) declares what it runs in a `Capabilities` table; the
planner and the dispatchers read those tables instead of kernel internals."""

from .capabilities import FEATURES, Capabilities

__all__ = ["Capabilities", "FEATURES"]
