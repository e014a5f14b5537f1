"""natsim.planner.plans: the runnable plans a search returns, and their reports.
A plan is plain data (its settings, predictions and runners-up) that round-trips through JSON, explains itself
and runs itself: `Plan` (GNA), `MaskPlan` (a predicted block mask), `ParallelPlan` (GNA over several GPUs).
"""

from .candidates import Candidate, Search
from .mask import MaskCandidate, MaskPlan, or_pool
from .parallel import ParallelPlan
from .plan import Plan
from .ranking import BASIS_COST_MODEL, BASIS_TILES, TIE_TOLERANCE
from .verdict import Verdict

__all__ = [
    "Plan",
    "Verdict",
    "Candidate",
    "Search",
    "MaskPlan",
    "MaskCandidate",
    "ParallelPlan",
    "or_pool",
    "BASIS_COST_MODEL",
    "BASIS_TILES",
    "TIE_TOLERANCE",
]
