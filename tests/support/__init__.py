"""What several test modules share: tiny models, reference formats, counters, torchrun."""

from pathlib import Path

#: the repository's root folder
ROOT = Path(__file__).resolve().parents[2]
