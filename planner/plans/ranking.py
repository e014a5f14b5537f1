"""How a plan's candidates were ranked, in the words every plan records and its report explains.

`basis` is BASIS_COST_MODEL (scores are predicted seconds on the plan's GPU) or BASIS_TILES (no coefficients for
that GPU: scores are simulated tile work, and no time is predicted). A search prefers the simpler of two
configurations whose scores lie within TIE_TOLERANCE of the best one (a smaller stride product for GNA, less host
work for a mask), so a plan records the tolerance it was chosen with.
"""

from __future__ import annotations

BASIS_COST_MODEL = "cost model"
BASIS_TILES = "simulated tiles"
BASES = (BASIS_COST_MODEL, BASIS_TILES)
TIE_TOLERANCE = 0.02
