"""`PipelineBase`: what every Qwen-Image pipeline shares — options, the forward the denoise core
calls, the OOM back-off around the core, presets (LoRAs, memory placement, decoding and previews, and
diffusers' methods come from the mixins it names).

A pipeline call is: check the request -> prepare conditioning (prompts, reference images) -> draw
the whole batch's noise -> `sampling.denoise(...)` (split into chunks on CUDA OOM) -> decode ->
output. Text-to-image and edit differ only in the conditioning step (`text_to_image.py`,
`edit.py`); everything after it is `_generate` here.

Options (`qwenfast.options.EngineOptions`) are changed only by `configure`, which rebuilds what
depends on them: graphs dropped, weights moved (offload), weights quantised (FP8). Lower layers never
set attributes on a pipeline: offload is a block runner on the transformer and an offloader on the
text encoder, installed from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import SchedulerConfig
from ..errors import ConfigureError, OptionsError
from ..kernels import use_backend
from ..models.text_encoder import TextEncoder
from ..options import EngineOptions, check_transition
from ..runtime.attention import auto_text_bucket, use_attention
from ..runtime.blocks import BlockRunner, StepContext
from ..runtime.cache import StepCacheRunner, resolve_policy
from ..runtime.cuda_graphs import CudaGraphRunner, DecodeGraphs
from ..runtime.modulation import ZERO, batch_rows
from ..runtime.offload import BlockStreamer, ModelOffloader
from ..runtime.oom import run_in_chunks
from . import sampling as S
from .common import OUTPUT_TYPES, Generators, QwenImageOutput, postprocess, randn_tensor
from .decoding import DecodeMethods
from .diffusers_compat import DiffusersMethods
from .loras import LoraMethods
from .placement import PlacementMethods
from .prompts import PromptConds
from .row_loras import RowLoraMethods
from .state import SharedState, view
from .tasks import Capabilities, model_capabilities, view_class

log = logging.getLogger("qwenfast")


class PipelineBase(
    SharedState, DiffusersMethods, PromptConds, LoraMethods, RowLoraMethods, PlacementMethods, DecodeMethods
):
    """Shared machinery; see the module docstring. Subclasses define `__call__` and the conditioning,
    and declare what they load and can do (`folder_kinds`, `needs`, `checkpoints`, `CAPABILITIES`:
    pipeline/tasks.py). diffusers' pipeline methods (`.to()`, `enable_model_cpu_offload`, `interrupt`,
    ...) come from `DiffusersMethods` (diffusers_compat.py), prompt conditioning from `PromptConds`
    (prompts.py), LoRAs from `LoraMethods` (loras.py) and `RowLoraMethods` (row_loras.py), memory
    planning and offload from `PlacementMethods` (placement.py); the loaded model's attributes live in
    one state its task views share (state.py)."""

    folder_kinds: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    checkpoints = ""
    CAPABILITIES: Capabilities

    def __init__(
        self,
        transformer,
        vae,
        text_encoder: TextEncoder,
        scheduler_config: SchedulerConfig,
        *,
        model_path: str = "",
        defaults: dict | None = None,
        options: EngineOptions | None = None,
        device: torch.device | str | None = None,
        extra: dict | None = None,
    ):
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.scheduler_config = scheduler_config
        self.model_path = model_path
        self.extra = dict(extra or {})  # the model folder's qwenfast.json
        self.defaults = {"height": 1024, "width": 1024, "num_inference_steps": 50, "true_cfg_scale": 4.0}
        self.defaults.update(defaults or {})
        # scheduler fields every call uses (set by apply_preset or by hand); a call's own
        # `scheduler_overrides=` wins key by key
        self.scheduler_overrides: dict = {}
        self.progress_bar = True
        self.vae_scale_factor = vae.cfg.scale_factor
        self._graphs = CudaGraphRunner(transformer)
        self._decode_graphs = DecodeGraphs(vae, pool_of=self._graphs)  # decode_per_image with graphs on
        self._block_runners: dict = {}  # step-cache policy (None: none) -> its block runner, kept
        self._compute_device = torch.device(device) if device is not None else transformer.device
        self._options = EngineOptions()  # what the loaded weights are now; configure() moves from here
        self._block_streamer: BlockStreamer | None = None
        self._parallel = None  # runtime.parallel.ParallelGroups when options.parallel is set
        self._vae_offloader: ModelOffloader | None = None
        self.memory_plan = None  # runtime.tiers.VramPlan when options.vram_gib planned the memory
        self._row_adapters = None  # per-row LoRAs once enabled (pipeline/row_loras.py)
        self._step_cache_off = False  # inside `step_cache_bypassed()`
        opts = options if options is not None else EngineOptions.from_env()
        self.configure(
            **{f.name: getattr(opts, f.name) for f in fields(opts)}
        )  # not asdict: keeps nested configs

    # ---------------------------------------------------------------- options
    @property
    def options(self) -> EngineOptions:
        """The engine options in force (read-only: change them with `configure`)."""
        return self._options

    @property
    def offload(self) -> str:
        return self._options.offload

    def configure(self, **changes: Any) -> EngineOptions:
        """Change engine options (`EngineOptions` field names) and rebuild what depends on them.

        FP8 and offload go one way only (FP8 quantises the weights; offload none -> model -> blocks);
        impossible changes raise `ConfigureError` saying what to do instead. Returns the new options.
        """
        old = self._options
        new = old.replace(**changes)
        if new.text_bucket == "auto":  # a number from here on (runtime/attention.py)
            new = new.replace(
                text_bucket=auto_text_bucket(
                    new.cuda_graphs, new.parallel, self.transformer, self._compute_device
                )
            )
        check_transition(old, new)
        self.transformer.set_modulation_cache(new.modulation_cache)  # before offload: it decides what streams
        if new.weights == "auto" or (
            new.vram_gib is not None and (new.vram_gib, new.weights) != (old.vram_gib, old.weights)
        ):
            new = self._plan_memory(old, new)  # the plan's weights and offload, checked again
            check_transition(old, new)
        if self.row_loras is not None and (
            (new.fp8, new.int8) != (old.fp8, old.int8)
            or (new.offload == "blocks") != (old.offload == "blocks")
        ):  # the adapters' stacks point at the layers the weights or the offload would replace
            raise ConfigureError(
                "per-row LoRAs are enabled: choose weights and offload before enable_row_loras"
            )
        if new.fp8 and not old.fp8:
            if old.offload == "blocks":
                raise ConfigureError("FP8 cannot be enabled after offload='blocks'; enable it first")
            self._fp8_layers = self._quantize()
        if new.int8 and not old.int8:
            if old.offload == "blocks":
                raise ConfigureError("INT8 cannot be enabled after offload='blocks'; enable it first")
            self._int8_layers = self._quantize("int8")
        if new.offload != old.offload:
            self._set_offload(old.offload, new, self._compute_device)
        elif new.offload == "blocks" and new.offload_budget != old.offload_budget:
            self._stream_blocks(self._compute_device, new)  # plan the resident blocks again
        if new.parallel != old.parallel:
            from ..runtime.parallel import ParallelGroups

            heads = self.transformer.cfg.num_attention_heads
            if new.parallel is not None and heads % new.parallel.ulysses:
                ok = [g for g in range(2, heads + 1) if heads % g == 0]
                raise OptionsError(
                    f"ulysses={new.parallel.ulysses} must divide the model's {heads} attention heads "
                    f"(possible: {ok})"
                )

            self._parallel = ParallelGroups(new.parallel) if new.parallel is not None else None
        if new.parallel is not None and new.parallel.world > 1:
            # the cfg split rides on the batched CFG forward
            new = new.replace(batched_cfg=True if new.parallel.cfg == 2 else new.batched_cfg)
        if new.cache != old.cache:
            # one runner per policy for the pipeline's life: the graphs captured under each stay valid
            # across switches (a server's per-request `cache`), as their keys hold their runner
            self._block_runners.setdefault(resolve_policy(old.cache), self.transformer.block_runner)
            runner = self._runner_for(resolve_policy(new.cache))
            runner.reset_stats()  # its counters count from this configure on, as a new one's
            self.transformer.set_block_runner(runner)
        self.transformer.set_fused(new.fused)
        self.text_encoder.cuda_graphs = new.cuda_graphs and new.offload == "none"
        self._graphs.resize(new.graph_slots)
        self.transformer.set_key_lengths(bool(new.text_bucket))
        if getattr(self.vae, "untiled_oom", None) is not None and new.changed(old):
            self.vae.untiled_oom = None  # memory is laid out anew: an untiled decode may fit again
        if new.changed(old) & {
            "fp8",
            "int8",
            "offload",
            "offload_budget",
            "fused",
            "attention",
            "kernels",
            "cuda_graphs",
            "text_bucket",
        }:
            self._graphs.clear()  # captured with the old weights (addresses) / kernels
            self._decode_graphs.clear()
            self._clear_modulations()
        self._options = new
        return new

    def _clear_modulations(self) -> None:
        """The weights changed (LoRA, FP8, a new load): every table entry is stale."""
        table = self.transformer.modulation_table
        if table is not None:
            table.clear()

    def enable_fp8(self) -> int:
        """Run the transformer blocks' big Linears as FP8 e4m3 GEMMs (rowwise scales, Hopper/Ada):
        `configure(fp8=True)`. About 1.8x faster GEMMs; not bitwise diffusers any more. One-way. LoRAs
        (loaded before or after) run unmerged beside the FP8 GEMMs and can be switched and unloaded
        at any time. Returns the number of FP8 layers."""
        self.configure(fp8=True)
        return getattr(self, "_fp8_layers", 0)

    def _quantize(self, fmt: str = "fp8") -> int:
        """The block Linears to FP8 or INT8 (unless the loader made them FP8 already); active LoRAs move
        from fused bf16 to unmerged beside the 8-bit GEMMs. Returns the number of 8-bit layers."""
        from ..kernels.fp8_linear import quantize_model
        from ..kernels.int8_linear import quantize_model_int8
        from ..kernels.lowbit import LowBitLinear

        m = getattr(self, "_lora_manager", None)
        m = m if m is not None and m.model is self.transformer else None  # (a copy's replaced transformer)
        if m is not None and m.active:
            m.unfuse_all()  # bitwise bf16 base first: quantise the base, not base + LoRA
        (quantize_model_int8 if fmt == "int8" else quantize_model)(self.transformer)
        if m is not None:
            m.rebind()
        return sum(isinstance(x, LowBitLinear) for x in self.transformer.modules())

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph and its memory pool, and the modulation table (before
        measuring memory, say, or after changing `pipe.transformer`'s weights by hand)."""
        self._graphs.clear()
        self._decode_graphs.clear()
        self._clear_modulations()

    def graph_stats(self) -> dict:
        """The transformer's CUDA graphs so far: captures, replays, how many are resident now and how many
        were dropped as stale (captured against a step cache's buffers before it reallocated them); and the
        per-image VAE decode's captures."""
        g = self._graphs
        return {
            "captures": g.captures,
            "replays": g.replays,
            "resident": len(g.graphs),
            "stale": g.stale,
            "decode_captures": self._decode_graphs.captures,
            "decode_resident": len(self._decode_graphs.graphs),
            "log": list(g.log),  # the last captures: (monotonic time, shapes, allocated GiB before, after)
        }

    @contextlib.contextmanager
    def _engine(self) -> Iterator[None]:
        """Kernel and attention backends of this pipeline's options for the duration of a call."""
        o = self._options
        with contextlib.ExitStack() as stack:
            if o.kernels is not None:
                stack.enter_context(use_backend(o.kernels))
            if o.attention is not None:
                stack.enter_context(use_attention(o.attention))
            yield

    def for_task(self, task: str):
        """This loaded model under the pipeline class of `task` ("img2img" / "inpaint" for text-to-image
        models, "edit-inpaint" for edit models): a thin object over the same model state (weights,
        options, graphs, LoRAs, caches; pipeline/state.py), so a `configure` or `load_lora` on either
        is seen by both. `self` when its class runs `task`."""
        cls = view_class(type(self), task)
        return self if type(self) is cls else view(self, cls)

    @property
    def capabilities(self) -> Capabilities:
        """What this loaded model can do (pipeline/tasks.py): its class's declaration answered for its
        folder, with every task `for_task` reaches. What the CLI and the server read."""
        return model_capabilities(self)

    def _capabilities_of(self, cls: type) -> Capabilities:
        """`cls.CAPABILITIES` answered for this model's folder; a class whose limits depend on the folder
        (edit models) declares its rule here."""
        return cls.CAPABILITIES

    @classmethod
    def check_folder(cls, path: Path) -> list[str]:
        """What is missing or broken in a model folder this class loads ([] when it looks complete)."""
        from ..loading.diffusers_folder import inspect_folder

        return inspect_folder(path)[1]

    # ---------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def vae_dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    @property
    def block_runner(self) -> BlockRunner:
        return self.transformer.block_runner

    def size_note(self, width: int, height: int) -> str | None:
        """A one-line note when width x height is far from the size the model was trained at (its
        qwenfast.json `"trained_size": [W, H]`, as the 128² demo has), else None. For the CLI and the
        server to show once; the call itself does not warn (see `qwenfast.validation.size_note`)."""
        from ..validation import parse_trained_size, size_note

        return size_note(
            parse_trained_size(self.extra.get("trained_size"), self.model_path or "qwenfast.json"),
            width,
            height,
        )

    # ---------------------------------------------------------------- presets
    @contextlib.contextmanager
    def step_cache_bypassed(self) -> Iterator[None]:
        """Calls inside run as if no step cache were configured, and leave the configured cache's state
        alone: the server runs a short uncached request between two steps of a cached batch this way
        (server/batcher.py). Same images as a call with `cache=None` configured: inside, the transformer
        runs the very block runner a `configure(cache=None)` hands it (kept per policy, `configure`), so
        its forwards replay the CUDA graphs captured without a cache. (The cached runner told to skip
        its cache computed the same, but its graphs were keyed on it: every size and batch of short
        request run inside a cached batch was captured again, during the load, an eager forward's
        memory on top each time.)"""
        prev, runner = self._step_cache_off, self.transformer.block_runner
        plain = self._runner_for(None) if self._options.cache is not None else runner
        self._step_cache_off = True
        self.transformer.set_block_runner(plain)
        try:
            yield
        finally:
            self.transformer.set_block_runner(runner)
            self._step_cache_off = prev

    def _runner_for(self, policy) -> BlockRunner:
        """The block runner kept for step-cache `policy` (None: no cache), made the first time it is asked
        for: one per policy for the pipeline's life, so the CUDA graphs captured under each (keyed by their
        runner) stay valid across switches."""
        if policy not in self._block_runners:
            self._block_runners[policy] = StepCacheRunner(policy) if policy is not None else BlockRunner()
        return self._block_runners[policy]

    def apply_preset(self, name: str) -> None:
        """Sampling defaults for a distilled LoRA (`qwenfast.config.PRESETS`): steps, true CFG and scheduler fields.

        Sets `self.defaults` (explicit call arguments still win) and `self.scheduler_overrides`.
        """
        from ..config import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        p = PRESETS[name]
        self.defaults.update(num_inference_steps=p.steps, true_cfg_scale=p.true_cfg_scale)
        self.scheduler_overrides = dict(p.scheduler_overrides)

    def scheduler_config_for(self, overrides: dict | None = None) -> SchedulerConfig:
        """The scheduler config of one call: checkpoint config <- `self.scheduler_overrides` <- `overrides`."""
        merged = {**self.scheduler_overrides, **(overrides or {})}
        return self.scheduler_config.replace(**merged) if merged else self.scheduler_config

    # ---------------------------------------------------------------- conditioning pieces
    def encode_prompt(
        self, prompts: list[str], num_images_per_prompt: int = 1, max_sequence_length: int = 512
    ):
        emb, mask = self.text_encoder.encode(prompts, max_sequence_length=max_sequence_length)
        return self._repeat(emb, mask, num_images_per_prompt)

    def _repeat(self, emb, mask, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        emb = emb.to(self.device, self.dtype).repeat_interleave(n, dim=0)
        if mask is not None:
            mask = mask.to(self.device).repeat_interleave(n, dim=0)
        return emb, mask

    def initial_latents(
        self, B: int, h: int, w: int, generator: Generators, latents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Packed starting noise (B, h/2*w/2, 64) drawn as diffusers draws it, or the caller's `latents`."""
        if latents is None:
            noise = randn_tensor((B, 1, 16, h, w), generator, self.device, self.dtype)
            return S.pack_latents(noise[:, 0])
        want = (B, (h // 2) * (w // 2), 64)
        if tuple(latents.shape) != want:
            raise ValueError(f"latents must have shape {want} (packed), got {tuple(latents.shape)}")
        return latents.to(self.device, self.dtype)

    # ---------------------------------------------------------------- the shared generation path
    def _forward(
        self,
        x,
        emb,
        mask,
        t,
        img_shapes,
        step: StepContext | None = None,
        shard: tuple[int, int] | None = None,
        additional_t_cond: torch.Tensor | None = None,
        block_residuals: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """What the denoise core calls: the transformer, replayed as a CUDA graph where possible.
        `additional_t_cond` (Layered) and `block_residuals` (ControlNet) go to the transformer as is."""
        if step is not None and self._step_cache_off:
            step = dataclasses.replace(step, cache=False)
        kw = {"step": step, "shard": shard, "block_residuals": block_residuals}
        mods = self._modulations(t, step, additional_t_cond)
        if mods is not None:
            kw["modulations"] = mods
        if self._options.cuda_graphs and x.is_cuda:
            return self._graphs(x, emb, mask, t, img_shapes, additional_t_cond, **kw)
        return self.transformer(x, emb, mask, t, img_shapes, additional_t_cond, **kw)

    def _modulations(
        self, t: torch.Tensor, step: StepContext | None, additional_t_cond: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Every block's modulation rows for this forward from the modulation table, or None (no
        table, or a call from outside the denoise core: no step; Layered's extra condition). The
        denoise core gives all rows one timestep; its sigma (a host float) is the key."""
        table = self.transformer.modulation_table
        if table is None or step is None or additional_t_cond is not None:
            return None
        compute = self.transformer.modulation_entries
        e = table.get(step.sigma, t[:1], compute)
        z = table.get(ZERO, t[:1] * 0, compute) if self.transformer.cfg.zero_cond_t else None
        return batch_rows(e, t.shape[0], z)

    def _fill_modulations(
        self, sig: torch.Tensor, dtype: torch.dtype, keys: list[float] | None = None
    ) -> None:
        """Table entries for every step of the schedule `sig` in one pass over the blocks (under
        offload the modulation weights cross PCIe once per new schedule, not once per step), with
        the timesteps exactly as the denoise core will hand them to the forward. keys: `sig[:-1]` as
        host floats where the caller has them (reading them from the device would wait for every
        queued kernel, the prompt encode's, before the table's GEMMs could be queued)."""
        table = self.transformer.modulation_table
        if table is None or len(sig) < 2:
            return
        ts = S.timesteps_from_sigmas(sig)
        keys = sig[:-1].tolist() if keys is None else keys
        tvals = [S.model_timestep(ts[j], 1, dtype) for j in range(len(ts))]
        if self.transformer.cfg.zero_cond_t:
            keys, tvals = [*keys, ZERO], [*tvals, tvals[0] * 0]
        table.fill(keys, tvals, self.transformer.modulation_entries)

    def _core_forward(self):
        """The forward the denoise core gets: `_forward`, or its multi-GPU wrapper."""
        if self._parallel is None:
            return self._forward
        from ..runtime.parallel import ParallelForward

        return ParallelForward(self._forward, self._parallel)

    def _generate(
        self,
        *,
        B: int,
        h: int,
        w: int,
        cond: S.TextCond,
        uncond: S.TextCond | None,
        cfg_scale: float,
        steps: int,
        generator,
        latents,
        output_type: str,
        sigmas,
        scheduler_overrides: dict | None,
        callback: Callable | None,
        ref: tuple[torch.Tensor, list] | None = None,
        forward_for: Callable[[Callable, int, int], Callable] | None = None,
        start: Callable | None = None,
        step_end: S.StepEndHook | None = None,
    ) -> QwenImageOutput:
        """Noise for the whole batch, then the denoise core (split on OOM), then decode.

        h, w: latent grid (pixels / 8, even). ref: (packed reference latents (B, M, 64), their
        (frames, h/2, w/2) shapes) for edits. forward_for(core forward, i, j): the forward for rows
        i..j of the batch, for conditioning that lives beside the forward (ControlNet latents), so
        that a chunk of an OOM-split batch sees its own rows. start: img2img / inpainting,
        `start(noise (B, N, 64), sigmas) -> (first latents, the sigmas to run, blend or None)`; a blend
        is a per-step hook of `denoise` with `rows(i, j)` giving the hook of batch rows i..j. step_end:
        the denoise core's step-end hook for the whole batch (diffusers' `callback_on_step_end`).
        """
        par = self._options.parallel
        if par is not None and par.cfg == 2 and uncond is None:
            raise ValueError(
                f"parallel {par} splits true CFG over two ranks, but this call has no CFG (give a "
                "negative prompt and true_cfg_scale > 1, or use --parallel ulysses=N alone)"
            )
        x = self.initial_latents(B, h, w, generator, latents)  # (B, h/2*w/2, 64)
        img_shapes = [(1, h // 2, w // 2), *(ref[1] if ref is not None else [])]
        sig_host = S.get_sigmas(self.scheduler_config_for(scheduler_overrides), steps, x.shape[1], sigmas)
        sig = sig_host.to(self.device)
        blend = None
        if start is not None:  # starts part-way along the schedule, from the image
            x, sig, blend = start(x, sig)
            sig_host = None
        events: list[str] = []
        with self._engine():
            self._fill_modulations(sig, x.dtype, None if sig_host is None else sig_host[:-1].tolist())
            x = self._denoise_batch(
                self._core_forward(),
                x,
                sig,
                img_shapes,
                cond,
                uncond,
                cfg_scale,
                None if ref is None else ref[0],
                callback,
                forward_for=forward_for,
                blend=blend,
                events=events,
                step_end=step_end,
            )
            info = {"oom_backoff": events} if events else {}
            if output_type == "latent":
                return QwenImageOutput(images=x, info=info)
            return QwenImageOutput(images=postprocess(self.decode_latents(x, h, w), output_type), info=info)

    def _denoise_batch(
        self,
        forward: Callable,
        x: torch.Tensor,
        sig: torch.Tensor,
        img_shapes: list,
        cond: S.TextCond,
        uncond: S.TextCond | None,
        cfg_scale: float,
        ref_latents: torch.Tensor | None,
        callback: Callable | None,
        *,
        forward_for: Callable | None = None,
        blend=None,
        guidance: Callable = S.true_cfg,
        events: list[str] | None = None,
        step_end: S.StepEndHook | None = None,
        batched_cfg: bool | str | None = None,
    ) -> torch.Tensor:
        """The denoise core over the batch x (B, N, C), split into row chunks on CUDA OOM (the `oom`
        option): each chunk gets its rows of the conditioning, of `forward_for(forward, i, j)` and of
        `blend.rows(i, j)`, and a split batch's callbacks and step-end hook still see the whole batch
        (the hook's changes go back to each chunk's rows). `batched_cfg`: None = the option's. Call
        inside `_engine()`."""
        B = x.shape[0]
        held: list[torch.Tensor] = []  # the whole batch's latents (B, N, C), made once a batch is split

        bucket = self._options.text_bucket if self.transformer.takes_key_lengths else 0

        def chunk(i: int, j: int) -> torch.Tensor:
            cb, hook = callback, step_end
            if (i, j) != (0, B) and (callback is not None or step_end is not None) and not held:
                held.append(x.clone())
            if callback is not None and (i, j) != (0, B):  # a split batch: callbacks see the whole batch

                def cb(k, n, xc, _i=i, _j=j):  # noqa: E306
                    held[0][_i:_j] = xc
                    callback(k, n, held[0])

            if step_end is not None and (i, j) != (0, B):
                hook = S.rows_hook(step_end, held[0], cond, i, j)
            fwd = forward if forward_for is None else forward_for(forward, i, j)
            return S.denoise(
                fwd,
                x[i:j],
                sig,
                img_shapes,
                cond.rows(i, j).bucketed(bucket),
                None if uncond is None else uncond.rows(i, j).bucketed(bucket),
                cfg_scale,
                None if ref_latents is None else ref_latents[i:j],
                self._cfg_batching() if batched_cfg is None else batched_cfg,
                cb,
                progress=self._progress(),
                guidance=guidance,
                blend=None if blend is None else blend.rows(i, j),
                step_end=hook,
            )

        try:
            if self._options.oom != "backoff":  # per call: nothing stays switched on afterwards
                return chunk(0, B)
            parts = run_in_chunks(chunk, B, events=events)
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        finally:
            self._rows_done()  # a per-row LoRA selection ends with its call (pipeline/row_loras.py)

    # ---------------------------------------------------------------- checks
    def _check(self, height, width, steps, n, output_type, max_sequence_length, sigmas) -> tuple[int, int]:
        for name, v in (("height", height), ("width", width)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 16:
                raise ValueError(f"`{name}` must be an integer >= 16 (pixels), got {v!r}")
        mult = self.vae_scale_factor * 2
        if height % mult or width % mult:
            warnings.warn(
                f"height and width must be multiples of {mult}; {height}x{width} is floored to "
                f"{height // mult * mult}x{width // mult * mult} (as diffusers does)",
                stacklevel=3,
            )
        if sigmas is None and (
            not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1
        ):
            raise ValueError(f"`num_inference_steps` must be an integer >= 1, got {steps!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"`num_images_per_prompt` must be an integer >= 1, got {n!r}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if not 1 <= max_sequence_length <= 1024:
            raise ValueError(f"`max_sequence_length` must be in 1..1024, got {max_sequence_length}")
        return S.latent_hw(height, width, self.vae_scale_factor)
