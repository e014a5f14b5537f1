"""What every `natsim` command shares: the consoles, bad input as one red line, the GPUs listed in --help, a
progress bar for long work, and the cost model read from --coefficients."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from typer.core import TyperCommand

from .parsing import CliInputError

# Tables are wide: when stdout is not a terminal (a pipe, a file, a test), do not cut them to 80 columns.
out = Console(width=None if sys.stdout.isatty() else 132)
err = Console(stderr=True)


def reports_bad_input(command: Callable) -> Callable:
    """Turn invalid input into one red line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (CliInputError, ValueError, TypeError) as error:
            err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None
        except (OverflowError, MemoryError) as error:  # sizes each valid, together beyond what can be counted here
            err.print(f"[red]error:[/red] the sizes given are too large to count on this machine "
                      f"({type(error).__name__}: {escape(str(error))}).", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


class ListsGpusInHelp(TyperCommand):
    """A command whose --help ends with the GPUs that have cost-model coefficients (for --device).

    The list comes from the coefficient files when the help is shown, read by natsim.gpus without torch (the
    planner, which would also load each file as a cost model, imports torch: seconds for a help text).
    """

    def format_help(self, ctx, formatter) -> None:
        from natsim.gpus import coefficient_gpus, describe_gpus

        self.epilog = escape(
            f"GPUs with cost-model coefficients, for --device: {describe_gpus(coefficient_gpus())}. --device takes a "
            "GPU's full name (any case) or its alias, and needs no GPU present."
        )
        super().format_help(ctx, formatter)


class LazyProgress:
    """A progress bar on stderr that appears only once work has taken longer than a second."""

    def __init__(self, description: str, delay: float = 1.0):
        self.description = description
        self.delay = delay
        self.started_at = time.perf_counter()
        self.bar: Optional[Progress] = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if time.perf_counter() - self.started_at < self.delay:
                return
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                TimeRemainingColumn(), console=err, transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def load_cost_model(path: Path):
    """The cost model in the file given with --coefficients."""
    from natsim.planner import CostModel

    try:
        return CostModel.load(path)
    except (OSError, KeyError, ValueError) as error:
        raise CliInputError(f"--coefficients {path} is not a readable cost model: {error}") from None
