"""`kvctl limit-percent NAME PCT`: the limit as a share of a GPU's memory (loads PyTorch, only here)."""

from typing import Annotated

import typer

from ..exitcodes import CliError, Exit
from ..params import NEGATIVE_OK, JsonLimit, KvctlCommand, OneName, globals_of, parse_percent, typer_app
from .limit import set_limit

app = typer_app()


@app.command("limit-percent", cls=KvctlCommand, context_settings=NEGATIVE_OK)
def limit_percent(
    ctx: typer.Context,
    name: OneName,
    percent: Annotated[
        float,
        typer.Argument(
            parser=parse_percent, metavar="PCT", help="Percentage of the GPU's total memory, in (0, 100]."
        ),
    ],
    device: Annotated[int, typer.Option("--device", metavar="N", help="CUDA device index.")] = 0,
    json_out: JsonLimit = False,
) -> int:
    """Set a deployment's limit to a percentage of GPU memory (loads PyTorch, only here)."""
    run = globals_of(ctx)
    run.layout().segment_path(name)  # validate the name before paying for torch
    try:
        import torch
    except ImportError:
        raise CliError(
            "limit-percent needs PyTorch to read GPU memory, and it is not installed "
            "(use 'kvctl limit NAME SIZE' instead)",
            Exit.ERROR,
        ) from None
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise CliError(
            f"no GPU {device} visible to PyTorch (torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}); use 'kvctl limit NAME SIZE' instead",
            Exit.ERROR,
        )
    total_mem = torch.cuda.get_device_properties(device).total_memory
    return set_limit(run, name, int(total_mem * percent / 100), json_out, f"{percent:g}% of GPU {device}")
