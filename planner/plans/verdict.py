"""`Verdict`: whether natsim's call on a layout is predicted to beat the attention a model runs of its own.

A model's own attention is one dense call of torch's SDPA. natsim's is its plan's call through the operator
`natsim::gna_resolved`. On a large layout the plan's skipped tiles decide; on a small one (an image model's 4,096
tokens) both calls take a fraction of a millisecond, and what the host spends issuing them decides as much: a
compiled step whose host cannot keep ahead of the GPU pays every microsecond of host work. So each side is priced
as the host's time to issue its call plus the call's predicted time (`CostModel.host`: OWN_ATTENTION for SDPA,
the plan's backend for natsim), the sum that a host-bound step pays; a GPU-bound step pays less of the host part,
which this rule then overstates on both sides. The dense call is priced on natsim's dense Triton kernel
(`Plan.dense_score`), which runs within a few per cent of SDPA's flash and cuDNN kernels at these sizes
(docs/performance.md).

In joint attention (text, or reference images, beside the N latent tokens: T tokens in all) the model's own call
attends all N + T tokens densely; natsim's runs its plan over the latent's tokens and, beside it, a dense part: the
latent's queries over the T keys and the T queries over all N + T keys, merged with the plan's output through
their log-sum-exps. Both dense parts are priced per query-key pair at the dense call's rate (dense attention's time
grows with its pairs), and natsim's host issues the dense part's calls and the merge on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .plan import Plan


@dataclass(frozen=True)
class Verdict:
    """natsim's call against the model's own on one layout: `serves` says which runs. `natsim_s` and `own_s`
    are the priced seconds (module docstring), None where no cost model prices this GPU, in which case natsim
    serves every layout."""

    layout: tuple[int, ...]
    serves: bool
    natsim_s: Optional[float] = None
    own_s: Optional[float] = None
    text: int = 0

    @classmethod
    def of(cls, plan: Plan, natsim_host_s: float, own_host_s: float, own_call_s: Optional[float] = None,
           batch: int = 1, text: int = 0, text_host_s: float = 0.0) -> "Verdict":
        """The verdict on `plan`'s layout for calls of `batch` layouts at once, with the host's time to issue
        natsim's call and the model's, and the model's call over the layout (`plan.dense_score` unless given: an
        FP8 plan's is priced in FP8, the model's own attention is not). `text`: the tokens beside the layout in a
        joint call (module docstring), whose dense part costs natsim's host `text_host_s` more."""
        if text < 0:
            raise ValueError(f"text must be a token count >= 0, got text={text}.")
        if not plan.calibrated:
            return cls(plan.problem.shape, True, text=text)
        latent = plan.problem.num_tokens
        per_pair = (plan.dense_score if own_call_s is None else own_call_s) / latent**2
        text_pairs = text * latent + text * (latent + text)  # the latent's queries over the text, the text's over all
        natsim_s = natsim_host_s + (text_host_s if text else 0.0) + batch * (plan.score + per_pair * text_pairs)
        own_s = own_host_s + batch * per_pair * (latent + text) ** 2
        return cls(plan.problem.shape, natsim_s < own_s, natsim_s, own_s, text)

    def explain(self) -> str:
        """One sentence: which attention runs this layout, and why."""
        layout = "x".join(str(n) for n in self.layout)
        if self.text:
            layout += f" (with {self.text} joint tokens beside it)"
        if self.natsim_s is None:
            return (f"natsim serves layout {layout}: no cost model prices this GPU, so nothing says the model's own "
                    "attention is faster (run `natsim calibrate`).")
        figures = f"{self.natsim_s * 1e3:.3f} ms against {self.own_s * 1e3:.3f} ms, host time to issue each call included"
        if self.serves:
            return f"natsim serves layout {layout}: its call is predicted faster than the model's own ({figures})."
        return (f"natsim keeps the model's own attention at layout {layout}: natsim's call is predicted slower "
                f"({figures}); natsim.integrations.diffusers.apply(..., keep_own=False) routes it anyway.")
