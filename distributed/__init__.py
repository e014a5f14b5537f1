"""natsim.distributed: context parallelism over torch.distributed (`import natsim` does not import it): GNA and
sparse attention on tokens sharded across ranks. The simulator's side (per-rank tiles, bytes per strategy) is
`natsim.partition`.

Each rank of a process group holds a slab of frames of the token layout, `[B, T_r, *rest, heads, head_dim]`
with rank r holding frames `[t_r, t_{r+1})` of dimension 0 (uneven slabs allowed; the split is all-gathered
from the group or given), and gets back its frames of the output. Everything moves through PyTorch's own
collectives (NCCL on GPUs, gloo on CPUs): `all_to_all_single` and batched point-to-point with exact per-peer
sizes, nothing home-made.

- `"ulysses"` (DeepSpeed-Ulysses): all-to-all from frame-sharded to head-sharded full sequences, the
  single-GPU kernel on `heads / P` heads of the whole layout, all-to-all back. Heads must divide by P.
- `"halo"`: every rank keeps its heads and receives point-to-point (`batch_isend_irecv`), from the ranks that
  hold them, the key/value frames its queries' windows reach (natsim.partition.key_frames: GNA window bounds
  with stride, dilation and causal), then runs the kernel on its queries against that frame range
  (`gna_attention(..., frame_offsets=...)`: global window bounds). Under dilation along dimension 0 the frames received are the hull over the rank's
  dilation groups (exact, a few extra frames may travel).
- `"auto"`: the strategy whose slowest rank is predicted fastest by natsim.partition (per-rank tile work of
  the kernel's tiles, bytes moved, default rates); `natsim.planner.best(..., world_size=P)` ranks with a
  GPU's calibrated cost model instead.

`sparse_attention` shards heads the same way (Ulysses): head-parallel attention composes with any per-head
block mask, so each rank runs its heads of the mask over the whole sequence.
"""

from natsim.partition import STRATEGIES

from .collectives import frame_split
from .gna import choose, gna_attention
from .sparse import sparse_attention

__all__ = ["gna_attention", "sparse_attention", "choose", "frame_split", "STRATEGIES"]
