"""Prompt encoding with Qwen2.5-VL: transformers' model, diffusers' template and masking rules.

The conditioning is the last hidden state of the language model over a chat template, with the
template's system prefix dropped (34 tokens for text-to-image). Padding is removed per prompt and
re-added on the right, and the mask becomes None when every token is real, exactly as diffusers'
`QwenImagePipeline._get_qwen_prompt_embeds` + `encode_prompt` do; the mask decides whether the
transformer attends with a mask at all, so this affects speed as well as results.

An LRU cache keyed by (prompt, template, max_sequence_length) makes a repeated prompt (and the
fixed negative prompt of a CFG run) free.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
T2I_DROP = 34
TOKENIZER_MAX_LENGTH = 1024
# Edit models: the user turn starts with the image placeholders (one per image); 64 prefix tokens dropped.
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_DROP = 64
IMAGE_PAD = "<|image_pad|>"
VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"


VISION_TOWER = ("model.visual.", "visual.")  # Qwen2.5-VL's vision tower (transformers 5 and 4 names)


class TextEncoder:
    """Tokenizer + Qwen2.5-VL language model; `encode(prompts)` -> (embeds, mask or None)."""

    def __init__(self, model, tokenizer, cache_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.cuda_graphs = True  # text-only encodes replay a CUDA graph on CUDA (runtime/cuda_graphs.py)
        self._graphs = None
        # offload (runtime/offload.py), set by the pipeline: the weights outside the decoder layers
        # come in for each encode through `offloader.on_device()`; the layers stream through hooks
        self.offloader = None
        self.layer_streamer = None
        self._host_parts: tuple[str, ...] | None = None

    def decoder_layers(self) -> torch.nn.ModuleList | None:
        """The language model's decoder layers (offload streams them; the memory planner sizes them)."""
        return decoder_layers(self.model)

    def resident(self, images: bool = True) -> contextlib.AbstractContextManager[torch.nn.Module | None]:
        """Context in which the weights are on the compute device (a no-op unless offloaded).
        `images=False`: a text-only use, which leaves the vision tower (1.35 GB at 7B) on the host."""
        if self.offloader is None:
            return contextlib.nullcontext()
        return self.offloader.on_device(leave=() if images else self.host_parts())

    def host_parts(self) -> tuple[str, ...]:
        """Name prefixes a text-only encode under offload leaves on the host: the vision tower, the LM
        head (never run: the encode reads the hidden states before it) and the token embedding (looked
        up on the host, so a prompt's few rows cross PCIe instead of its 1.09 GB table; `_hidden`).
        Found once (a walk over the model's modules), then kept."""
        if self._host_parts is None:
            lm = language_model(self.model)
            if lm is None or not isinstance(getattr(lm, "embed_tokens", None), torch.nn.Module):
                self._host_parts = VISION_TOWER
            else:
                names = {id(m): n for n, m in self.model.named_modules()}
                parts = (lm.embed_tokens, getattr(self.model, "lm_head", None))
                self._host_parts = VISION_TOWER + tuple(
                    names[id(m)] + "." for m in parts if m is not None and id(m) in names
                )
        return self._host_parts

    def _embeds_on_host(self) -> bool:
        """Whether an offloaded text-only encode looks its token rows up on the host (`host_parts`)."""
        return self.offloader is not None and len(self.host_parts()) > len(VISION_TOWER)

    @classmethod
    def from_pretrained(
        cls, text_encoder_dir: Path, tokenizer_dir: Path, device: torch.device | str, dtype: torch.dtype
    ) -> TextEncoder:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        from ..errors import CheckpointError

        try:
            tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except Exception as e:  # transformers raises many types here; the message is what matters
            raise CheckpointError(f"cannot load the tokenizer from {tokenizer_dir}: {e}") from e
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per tensor is noise next to ours
        try:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(text_encoder_dir), dtype=dtype)
        except Exception as e:
            raise CheckpointError(f"cannot load the text encoder from {text_encoder_dir}: {e}") from e
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        model = model.to(device).eval().requires_grad_(False)
        return cls(model, tok)

    @property
    def device(self) -> torch.device:
        """The compute device (offloaded: the one the weights come to, not the host they live on)."""
        if self.offloader is not None:
            return self.offloader.device
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _hidden(self, texts: list[str], drop: int) -> list[torch.Tensor]:
        """Each text's last hidden states, real tokens only, template prefix dropped. The token mask
        stays on the host (the tokenizer's): which rows are real is known there, so nothing here waits
        for the GPU and the caller's next host work (drawing the noise on a CPU generator) runs while
        the encoder does."""
        host = self.tokenizer(
            texts, max_length=TOKENIZER_MAX_LENGTH + drop, padding=True, truncation=True, return_tensors="pt"
        )
        mask = host.attention_mask.bool()  # (B, T) on the host
        tok = host.to(self.device)
        graphs = self._graph_runner() if self.cuda_graphs and tok.input_ids.is_cuda else None
        if graphs is not None and self.tokenizer.padding_side == "right":
            hidden = graphs(tok.input_ids, host.attention_mask)  # (B, T, D), rows past the mask unused
        elif self._embeds_on_host():
            # offloaded: the embedding table stayed on the host (`host_parts`); only the language model
            # runs (no LM head), from the looked-up rows: the same states as the full model's last one
            lm = language_model(self.model)
            x = torch.nn.functional.embedding(tok.input_ids.cpu(), lm.embed_tokens.weight).to(self.device)
            hidden = lm(inputs_embeds=x, attention_mask=tok.attention_mask, use_cache=False).last_hidden_state
        else:
            out = self.model(
                input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True
            )
            hidden = out.hidden_states[-1]  # (B, T, D): the language model's normed last state
        return [real_rows(h, m)[drop:] for h, m in zip(hidden, mask)]  # template prefix dropped

    def _graph_runner(self):
        """The language model's graph runner, or None where the model is not Qwen2.5-VL-shaped."""
        if self._graphs is None:
            from ..runtime.cuda_graphs import TextEncoderGraphs

            lm = language_model(self.model)
            pad = self.tokenizer.pad_token_id
            if lm is None or pad is None:
                self._graphs = False
            else:
                self._graphs = TextEncoderGraphs(lm, pad)
        return self._graphs or None

    @torch.no_grad()
    def encode(
        self,
        prompts: list[str],
        max_sequence_length: int = 512,
        template: str = T2I_TEMPLATE,
        drop: int = T2I_DROP,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, L, D) embeddings right-padded with zeros, and a (B, L) long mask or None if all ones."""
        todo = [p for p in dict.fromkeys(prompts) if (p, template, drop) not in self._cache]
        with self.resident(images=False):
            fresh = dict(zip(todo, self._hidden([template.format(p) for p in todo], drop))) if todo else {}
        for p, h in fresh.items():
            self._put((p, template, drop), h)
        seqs = [
            (fresh[p] if p in fresh else self._get((p, template, drop)))[:max_sequence_length]
            for p in prompts
        ]
        return pad_embeddings(seqs)

    @torch.no_grad()
    def encode_with_images(
        self,
        prompts: list[str],
        images: list,
        image_processor: Any,  # a transformers Qwen2-VL image processor (slow, fast or PIL class)
        template: str = EDIT_TEMPLATE,
        drop: int = EDIT_DROP,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Edit conditioning: each prompt (already holding one `VISION_SLOT` per image) is encoded
        together with the same PIL `images`, as diffusers' edit pipelines do with a batch of one.

        The `<|image_pad|>` placeholder is expanded here to one token per merged vision patch (what
        `Qwen2VLProcessor` does), so only the image processor is needed, not torchvision.
        """
        digest = image_digest(images)
        keys = [(p, template, drop, digest) for p in prompts]
        todo = [k for k in dict.fromkeys(keys) if k not in self._cache]
        if todo:  # every new prompt in one batched forward (padding masked)
            with self.resident():
                hs = self._hidden_vl(
                    [template.format(k[0]) for k in todo], [images] * len(todo), image_processor, drop
                )
            fresh = dict(zip(todo, hs))
            for k, h in fresh.items():
                self._put(k, h)
        else:
            fresh = {}
        return pad_embeddings([fresh[k] if k in fresh else self._get(k) for k in keys])

    def _hidden_vl(
        self, texts: list[str], images: list[list], image_processor, drop: int
    ) -> list[torch.Tensor]:
        """Last hidden states (template prefix dropped) of each text with its own list of PIL images."""
        flat = [im for ims in images for im in ims]
        vis = image_processor(images=flat, return_tensors="pt")
        grid = vis["image_grid_thw"]  # (n_images, 3): t, h, w in patches
        merge = image_processor.merge_size**2
        expanded, g = [], 0
        for text, ims in zip(texts, images):
            parts = text.split(IMAGE_PAD)
            if len(parts) - 1 != len(ims):
                raise ValueError(
                    f"the prompt holds {len(parts) - 1} image placeholders for {len(ims)} images"
                )
            counts = [int(grid[g + i].prod()) // merge for i in range(len(ims))]
            expanded.append(parts[0] + "".join(IMAGE_PAD * c + rest for c, rest in zip(counts, parts[1:])))
            g += len(ims)
        tok = self.tokenizer(expanded, padding=True, return_tensors="pt").to(self.device)
        out = self.model(
            input_ids=tok.input_ids,
            attention_mask=tok.attention_mask,
            pixel_values=vis["pixel_values"].to(self.device),
            image_grid_thw=grid.to(self.device),
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1]  # (B, T, D)
        mask = tok.attention_mask.bool()
        return [h[m][drop:] for h, m in zip(hidden, mask)]

    def clear_cache(self) -> None:
        """Forget every cached prompt embedding."""
        self._cache.clear()

    def _put(self, key, value):
        if self.cache_size <= 0:
            return
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _get(self, key):
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        raise KeyError(key)


def language_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """Qwen2.5-VL's text decoder inside `Qwen2_5_VLForConditionalGeneration` (transformers 4.5x and 5
    layouts: `.model.language_model`; older: `.model`), or None for other models."""
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None) or inner
    return lm if isinstance(getattr(lm, "layers", None), torch.nn.ModuleList) else None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The language model's decoder layers (what offload streams), or None for other models."""
    lm = language_model(model)
    return None if lm is None or len(lm.layers) == 0 else lm.layers


def real_rows(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A copy of the rows of h (T, D) where the host mask (T,) is set, as `h[mask]` gives: copied as one
    slice when they are one run (what a tokenizer's padding leaves), so no device sync; any other mask
    gathers. (A copy, not a view: a cached prompt keeps its own rows, not the whole padded batch.)"""
    idx = mask.nonzero().flatten().tolist()  # host
    if idx and idx == list(range(idx[0], idx[-1] + 1)):
        return h[idx[0] : idx[-1] + 1].clone()
    return h[mask.to(h.device)]


def pad_embeddings(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad variable-length (L_i, D) sequences to (B, max L, D); mask None when all lengths equal
    (decided from the host-known lengths: no device sync)."""
    lengths = [s.shape[0] for s in seqs]
    L = max(lengths)
    emb = torch.stack(
        [torch.cat([s, s.new_zeros(L - n, s.shape[1])]) if n < L else s for s, n in zip(seqs, lengths)]
    )
    if min(lengths) == L:
        return emb, None
    mask = torch.stack([torch.arange(L, device=emb.device) < n for n in lengths]).long()
    return emb, mask


def image_digest(images: list) -> str:
    """A content hash of PIL images (mode, size, pixels) for the prompt cache key."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for im in images:
        h.update(f"{im.mode}{im.size}".encode())
        h.update(im.tobytes())
    return h.hexdigest()
