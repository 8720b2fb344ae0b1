"""The package's version and where its embedded demo models are: plain values (no torch), importable from
every layer (the package root, which re-exports them, sits above all the others)."""

from __future__ import annotations

import os

__version__ = "0.1.0"

_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEMO_MODEL = os.path.join(_ASSETS, "demo-t2i")  # the 128x128 shapes model (text-to-image)
DEMO_EDIT_MODEL = os.path.join(_ASSETS, "demo-edit")  # the same weights as an Edit-2509 folder
