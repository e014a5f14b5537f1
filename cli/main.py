"""The `natsim` command: the app and its commands, each defined in a module of its own beside this one."""

from __future__ import annotations

import typer

from . import calibrate, link, mask, plan, sim, sweep

app = typer.Typer(
    name="natsim",
    help=(
        "Simulate, before anything runs, how many tiles a sparse-attention kernel visits for a "
        "Generalized Neighborhood Attention (GNA) configuration, and the speedup that allows.\n\n"
        "Sizes are written per dimension joined by 'x' (frames x height x width), e.g. "
        "--shape 30x48x80 --window 18x24x24; a single number applies to every dimension."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# In the order `natsim --help` lists them.
sweep.register(app)
sim.register(app)
plan.register(app)
calibrate.register(app)
link.register(app)
mask.register(app)

if __name__ == "__main__":
    app()
