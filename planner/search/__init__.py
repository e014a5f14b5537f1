"""natsim.planner.search: finding the fastest way to run attention before anything runs.
`best` scores GNA windows, strides and tiles (over the tile catalog) for a layout and a target sparsity;
`best_mask` block sizes and merges for a predicted mask; `parallel_plan` strategies and splits over GPUs;
`AutoPlan` runs `best` once per layout it meets.
"""

from .auto import AutoPlan
from .gna import best, fastest_first, predicted_times
from .mask import best_mask, token_density
from .parallel import parallel_plan

__all__ = [
    "AutoPlan",
    "best",
    "predicted_times",
    "fastest_first",
    "best_mask",
    "token_density",
    "parallel_plan",
]
