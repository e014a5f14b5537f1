"""Run Triton kernels in the CPU interpreter on machines without an NVIDIA GPU.

`@triton.jit` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test module
imports natsim.kernels. With a GPU the kernel tests run on CUDA tensors instead.
"""

import os

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["TRITON_INTERPRET"] = "1"
