"""`natsim calibrate-link`: measure the interconnect between the GPUs of one host (run under torchrun) and write it
where `natsim.planner.best(..., world_size=P)` prices the strategies' bytes with it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from .common import out, reports_bad_input
from .output import print_json
from .parsing import CliInputError


@reports_bad_input
def calibrate_link_command(
    output: Optional[Path] = typer.Option(
        None, "--output",
        help="Where to write the measured link (default: link-<gpu>-x<ranks>.json in the coefficients folder of "
             "`natsim calibrate`, where the planner and natsim.distributed's strategy='auto' look for it).",
    ),
    repeats: int = typer.Option(5, "--repeats", help="Timed repeats per size (median, slowest rank)."),
    as_json: bool = typer.Option(False, "--json", help="Print the measured link as JSON."),
) -> None:
    """Time Ulysses' all-to-all and the halo exchange's point-to-point sends between the ranks of this torchrun job, and fit each move's rate and latency.

    `best(..., world_size=P)` then prices the context-parallel strategies on this machine with them instead of a default rate. Run it once per GPU kind and number of GPUs, under torchrun (NCCL on GPUs, gloo on CPUs); rank 0 writes the file.

    Example: NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 4 -m natsim.cli.main calibrate-link
    """
    import torch
    import torch.distributed as dist

    from natsim.distributed import calibrate_link
    from natsim.planner.cost.files import link_file_name, user_coefficients_dir

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CliInputError("calibrate-link measures moves between ranks: launch it under torchrun with two or more "
                            "processes, e.g. `torchrun --nproc_per_node 2 -m natsim.cli.main calibrate-link`.")
    if repeats < 1:
        raise CliInputError(f"--repeats must be at least 1, got --repeats {repeats}.")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        world = dist.get_world_size()
        gpu = torch.cuda.get_device_name() if cuda else "cpu"
        link = calibrate_link(repeats=repeats, source=f"{world} x {gpu}, natsim calibrate-link")
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    if rank:
        return
    path = output if output is not None else user_coefficients_dir() / link_file_name(gpu, world)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(link.to_dict(), indent=1))
    if as_json:
        print_json(out, {"link": link.to_dict(), "written_to": str(path)})
    else:
        out.print(f"{link.describe()}\nwritten to {path}")


def register(app: typer.Typer) -> None:
    """Add the `calibrate-link` command to `app`."""
    app.command("calibrate-link")(calibrate_link_command)
