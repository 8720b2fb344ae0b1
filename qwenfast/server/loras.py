"""LoRA names -> files, only inside `--lora-dir`.

A request names a LoRA (`{"name": "pixel-art", "strength": 0.8}`), never a path. The name must be
a plain file stem (letters, digits, `._-`, no separators, no leading dot) and is looked up in a
listing of `<lora-dir>/*.safetensors`, so `../x`, `/etc/passwd`, `a/b`, `%2e%2e`, NUL bytes and
symlink tricks cannot reach anything the operator did not put in that folder. (A symlink the
operator placed *in* the folder is the operator's choice and is followed.)
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .schemas import APIError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SUFFIX = ".safetensors"
log = logging.getLogger("qwenfast.server")


class LoraResolver:
    def __init__(self, lora_dir: str | Path | None):
        self.dir = Path(lora_dir).resolve() if lora_dir else None
        if self.dir is not None and not self.dir.is_dir():
            raise FileNotFoundError(f"--lora-dir {lora_dir} is not a folder")

    def available(self) -> list[str]:
        """Names a request may use (the folder is re-read, so files added later are found)."""
        if self.dir is None:
            return []
        try:
            return sorted(
                p.name[: -len(SUFFIX)]
                for p in self.dir.iterdir()
                if p.name.endswith(SUFFIX) and _NAME.match(p.name[: -len(SUFFIX)]) and p.is_file()
            )
        except OSError as e:  # removed or unreadable since the start; the path goes to the log only
            log.error("cannot list --lora-dir %s: %s", self.dir, e)
            return []

    def resolve(self, name: str) -> Path:
        """The file for `name`, or APIError(400/404) saying why not."""
        if self.dir is None:
            raise APIError(
                400,
                "this server was started without --lora-dir, so requests cannot use LoRAs",
                param="lora",
                code="lora_not_enabled",
            )
        stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
        if not _NAME.match(stem) or ".." in stem:
            raise APIError(
                400,
                f"LoRA name {name[:80]!r} is not valid: use the file name without folder, e.g. "
                '"pixel-art" for pixel-art.safetensors (letters, digits, . _ -)',
                param="lora",
                code="invalid_lora_name",
            )
        if stem not in self.available():
            raise APIError(
                404,
                f"no LoRA named {stem!r} in the server's LoRA folder (GET /v1/loras lists them)",
                param="lora",
                code="lora_not_found",
            )
        return self.dir / f"{stem}{SUFFIX}"

    def resolve_all(self, loras: list[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
        """((path, strength), ...) in the request's canonical (sorted) order: the batch key and what
        `pipe.set_loras` gets."""
        return tuple((str(self.resolve(n)), s) for n, s in loras)
