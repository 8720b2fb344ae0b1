"""qwenfast for ComfyUI: copy (or link) this folder into ComfyUI's `custom_nodes/` and `pip install qwenfast`.

Imports without ComfyUI (the nodes look ComfyUI's progress bar, interrupt and model folders up only
when they run), so the node contracts are tested in qwenfast's CI.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
