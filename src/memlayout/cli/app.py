"""The ``memlayout`` typer app; each verb registers itself on it (``memlayout.cli``)."""

import typer

app = typer.Typer(
    help="Tensor memory layout (NCHW / channels-last) for PyTorch models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """Tensor memory layout (NCHW / channels-last) for PyTorch models."""

