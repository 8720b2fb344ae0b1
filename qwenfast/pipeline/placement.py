"""Where the weights live: the memory plan (`weights="auto"`, `vram_gib`), offload (the text encoder in host
memory, transformer blocks streamed through a ring of GPU buffers) and how many blocks stay resident.

A mixin of `PipelineBase` (`configure` calls it when the options change; `enable_offload` is the public
door): it reads the pipeline's state (`self.transformer`, `self.text_encoder`, `self.vae`, `self.defaults`,
`self._options`) and installs the lower layers' pieces (runtime/offload.py's streamers, the block runner),
never the other way round.
"""

from __future__ import annotations

import torch

from ..models.text_encoder import decoder_layers
from ..options import EngineOptions
from ..runtime.attention import key_lengths_free
from ..runtime.blocks import StreamingBlockRunner
from ..runtime.offload import BlockStreamer, ModelOffloader, offload_module, spread
from .common import plan_options


class PlacementMethods:
    """Memory planning and offload of a loaded model (see the module docstring)."""

    def _plan_memory(self, old: EngineOptions, new: EngineOptions) -> EngineOptions:
        """`weights="auto"` made concrete and `vram_gib` turned into an offload plan (runtime/tiers.py),
        for a call of the model's default size; the plan stays readable as `pipe.memory_plan`."""
        from ..kernels.lowbit import LowBitLinear
        from ..runtime.memory import ModelSizes

        d = self.defaults
        loaded_8bit = any(isinstance(m, LowBitLinear) for m in self.transformer.blocks[0].modules())
        new, plan = plan_options(
            new,
            lambda: ModelSizes.from_pipeline(self),
            self._compute_device,
            height=d["height"],
            width=d["width"],
            cfg=d.get("true_cfg_scale", 1) > 1,
            eight_bit_sizes=loaded_8bit,
            table_bytes=self._modulation_table_bytes(),
            current_offload=old.offload,
            dtype=self.dtype,
        )
        self.memory_plan = plan
        return new

    def enable_offload(
        self, mode: str = "model", device: torch.device | str | None = None, vae: bool = False, ring: int = 2
    ) -> None:
        """Fit smaller GPUs: "model" keeps the text encoder in pinned host memory (its layers streamed
        while encoding; with `vae=True` the VAE too); "blocks" also streams the transformer blocks
        through a ring of `ring` GPU buffers. Same images; "blocks" is PCIe-bound. Load LoRAs before;
        one-way for this pipeline object (none -> model -> blocks). `configure(offload=...)` with options."""
        if device is not None:
            self._compute_device = torch.device(device)
        self._ring, self._offload_vae = ring, vae
        if mode not in ("none", "model", "blocks"):
            raise ValueError(f"offload must be one of ('none', 'model', 'blocks'), got {mode!r}")
        if mode == self._options.offload:
            return
        if self._options.offload != "none" and not (self._options.offload == "model" and mode == "blocks"):
            raise RuntimeError(
                f"offload is already {self._options.offload!r}; load the model again to use {mode!r}"
            )
        self.configure(offload=mode)

    def _cfg_batching(self) -> bool | str:
        """The `batched_cfg` option, except that "auto" batches cond and uncond even with a padding mask
        while transformer blocks stream: two forwards a step would copy every streamed block twice
        (at 12 GiB, 5 GB a step on full size), which costs far more than the masked attention saves;
        and where padded text is attended by key lengths on FlashAttention-3 (no masked attention)."""
        o = self._options.batched_cfg
        st = self._block_streamer
        if o == "auto" and self.transformer.key_lengths and key_lengths_free(self._compute_device):
            return True  # padded text by key lengths: the padding costs attention nothing
        return True if o == "auto" and st is not None and st.order else o

    def streamed_bytes(self) -> int:
        """Weight bytes copied host -> GPU so far by offload (transformer blocks, modulation Linears,
        text-encoder layers and the rest of it, an offloaded VAE); 0 without offload."""
        te = self.text_encoder
        parts = (
            self._block_streamer,
            getattr(te, "layer_streamer", None),
            getattr(te, "offloader", None),
            self._vae_offloader,
        )
        return sum(p.bytes_in for p in parts if p is not None)

    def _set_offload(self, old: str, opts: EngineOptions, device: torch.device) -> None:
        """From offload mode `old` to `opts.offload` (`opts`: the options being configured)."""
        new, ring, tr, te = opts.offload, getattr(self, "_ring", 2), self.transformer, self.text_encoder
        if old == "none":  # the text encoder (and optionally the VAE) to host memory
            te.offloader, te.layer_streamer = offload_module(te.model, device, decoder_layers(te.model), ring)
            if getattr(self, "_offload_vae", False):
                self._vae_offloader = ModelOffloader(self.vae, device)
        if new == "blocks":
            for child in tr.children():  # everything but the blocks, which stream
                if child is not tr.blocks:
                    child.to(device)
            self._stream_blocks(device, opts)
        elif tr.device != device:
            tr.to(device)
        if self._vae_offloader is None and next(self.vae.parameters()).device != device:
            self.vae.to(device)

    def _stream_blocks(self, device: torch.device, opts: EngineOptions) -> None:
        """A new block streamer for this budget (blocks come from wherever the last one left them)."""
        tr = self.transformer
        self._block_streamer = None  # the old one's host buffers go before the new ones are pinned
        n, te_layers = self._resident_blocks(device, opts)
        resident = spread(len(tr.blocks), n)
        self._block_streamer = BlockStreamer(
            tr.blocks,
            device,
            ring=getattr(self, "_ring", 2),
            hooks=False,
            resident=resident,
            on_host=self._modulation_modules(),
        )
        tr.set_block_runner(StreamingBlockRunner(self._block_streamer))
        te_stream = getattr(self.text_encoder, "layer_streamer", None)
        if te_stream is not None:  # what the transformer leaves of the budget keeps encoder layers resident
            te_stream.set_resident(spread(len(te_stream.blocks), te_layers))

    def _modulation_modules(self) -> list[torch.nn.Module]:
        """With a modulation table, the blocks' modulation Linears, which offload keeps in host memory
        (the table serves the forward; a miss brings them in): half of each FP8 block's bytes."""
        tr = self.transformer
        if tr.modulation_table is None:
            return []
        return [m for mods in tr.modulation_modules() for m in mods]

    def _modulation_table_bytes(self) -> int:
        """What the modulation table holds on the device for the model's default schedule (its steps,
        + a t=0 entry; at most its size): 4.4 MB per timestep at full size."""
        tr = self.transformer
        table = tr.modulation_table
        if table is None:
            return 0
        entries = min(table.max_entries, int(self.defaults.get("num_inference_steps", 50)) + 1)
        return (
            entries
            * len(tr.blocks)
            * 2
            * 6
            * tr.cfg.inner_dim
            * torch.empty((), dtype=tr.dtype).element_size()
        )

    def _resident_blocks(self, device: torch.device, opts: EngineOptions) -> tuple[int, int]:
        """offload="blocks": how many transformer blocks, and then (once all of those fit) how many
        text-encoder layers, stay on the device, so that a call of the model's default size (batch 1,
        its default CFG) peaks under the budget (`options.offload_budget` GiB, else the free GPU
        memory; on CPU without a budget: none); with CUDA graphs, their pool counts as held."""
        budget = opts.offload_budget
        if budget is None and device.type != "cuda":
            return 0, 0
        from ..runtime.memory import GiB, MemoryPlanner, default_budget

        # the planner predicts whole peaks (every resident weight): the budget includes what is allocated.
        # Plan for 90% of a given budget: the caching allocator's fragmentation counts against a hard cap.
        limit = int(0.9 * budget * GiB) if budget is not None else default_budget(device)
        limit -= self._modulation_table_bytes()
        planner = MemoryPlanner.from_pipeline(self)
        d = self.defaults
        kw = dict(
            cfg=d.get("true_cfg_scale", 1) > 1,
            dtype=self.dtype,
            modulation_on_host=bool(self._modulation_modules()),
            graph_pool=opts.cuda_graphs and device.type == "cuda",
        )
        n = planner.resident_blocks(limit, d["height"], d["width"], 1, **kw)
        if n < planner.sizes.num_blocks:
            return n, 0
        return n, planner.te_resident_layers(limit, d["height"], d["width"], 1, resident_blocks=n, **kw)
