"""``python -m memlayout.cli`` (what torchrun runs): the ``memlayout`` command."""

from memlayout.cli import app

app()
