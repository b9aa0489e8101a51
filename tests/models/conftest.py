"""Fixtures for the real-model tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.real import installed


@pytest.fixture(scope="module")
def ultralytics(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """ultralytics, imported offline and quiet, its settings file in a temporary folder.
    Importing it replaces ``PIL.Image.open`` (a HEIF fallback that installs a package on an
    unreadable file) and ``torch.save`` for the whole process: both are put back after this
    module's tests, so later ones see PIL's and torch's own."""
    from PIL import Image

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Image, "open", Image.open)  # restored as it is now when the context ends
        mp.setattr(torch, "save", torch.save)
        mp.setenv("YOLO_OFFLINE", "1")
        mp.setenv("YOLO_VERBOSE", "False")
        mp.setenv("YOLO_CONFIG_DIR", str(tmp_path_factory.mktemp("ultralytics")))
        module = installed("ultralytics", "the models extra: pip install ultralytics")
        from ultralytics.utils import ONLINE

        assert not ONLINE  # nothing it does may reach the network
        yield module
