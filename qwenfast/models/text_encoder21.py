"""Prompt (and condition-image) encoding for Qwen-Image-2.1 with transformers' Qwen3-VL.

What diffusers' `QwenImage21Pipeline._get_qwen_prompt_embeds` does, reproduced exactly: the raw
template string (not the chat template), one `<imageN><|vision_start|><|image_pad|><|vision_end|>`
slot per condition image (space-separated), RGBA images composited over white for the vision
tower, a batch left-padded, the last decoder layer's output *before* the final RMSNorm, each
prompt's real tokens with the system turn dropped (its length read from the chat template), right-
padded again with a key mask (None when nothing is padded) and the mask of image-slot positions.

No torchvision: the PIL image processor makes the pixel patches and `<|image_pad|>` is expanded
here to one token per merged patch (what `Qwen3VLProcessor` does), with `mm_token_type_ids` built
the way the processor builds it. The pre-norm state: for the duration of the encode a forward hook
on the language model's final norm returns the norm's input, as diffusers does. That gives the same
`hidden_states[-1]` on every transformers 5.x (before 5.18 that entry is tied to the normed
`last_hidden_state`; the config flag `tie_last_hidden_states` only exists from 5.18 on, so it alone
gave the normed state on older versions).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
T2I_TEMPLATE = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


def ti2i_template(n_images: int) -> str:
    """The image-conditioned template with `n_images` slots, as diffusers builds it."""
    slots = "<image1>" + IMAGE_SLOT + "".join(f" <image{i}>{IMAGE_SLOT}" for i in range(2, n_images + 1))
    return T2I_TEMPLATE.replace("user\n{}", "user\n" + slots + "{}")


def flatten_rgba(im):
    """RGBA composited over white (the vision tower was trained so); other modes converted to RGB."""
    from PIL import Image

    if im.mode == "RGBA":
        white = Image.new("RGB", im.size, (255, 255, 255))
        white.paste(im, mask=im.getchannel("A"))
        return white
    return im if im.mode == "RGB" else im.convert("RGB")


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)


class TextEncoder21:
    """Tokenizer + PIL image processor + Qwen3-VL; `encode(prompts, images)` -> (emb, mask, slots)."""

    def __init__(self, model, tokenizer, image_processor, chat_template: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.cuda_graphs = (
            True  # text-only encodes replay a CUDA graph on CUDA (set by the pipeline's options)
        )
        self._graphs = None
        self.offloader = None
        self.layer_streamer = None
        self._lm = _language_model(model)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.drop_idx = self._system_tokens(chat_template)

    def _system_tokens(self, chat_template: str | None) -> int:
        """Tokens of the rendered system turn (diffusers' `_drop_idx`)."""
        msg = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if template is None:  # Qwen's template renders the system turn like the raw template does
            text = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        else:
            text = self.tokenizer.apply_chat_template(msg, chat_template=template, tokenize=False)
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    @classmethod
    def from_pretrained(cls, text_encoder_dir: Path, processor_dir: Path, device, dtype) -> TextEncoder21:
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        from transformers.utils import logging as hf_logging

        from ..errors import CheckpointError

        processor_dir = Path(processor_dir)
        try:
            tok = AutoTokenizer.from_pretrained(str(processor_dir))
            improc = Qwen2VLImageProcessorPil.from_pretrained(str(processor_dir))
        except Exception as e:  # transformers raises many types; the message is what matters
            raise CheckpointError(f"cannot load the Qwen3-VL processor from {processor_dir}: {e}") from e
        template = None
        if (processor_dir / "chat_template.jinja").is_file():
            template = (processor_dir / "chat_template.jinja").read_text()
        elif (processor_dir / "chat_template.json").is_file():
            template = json.loads((processor_dir / "chat_template.json").read_text()).get("chat_template")
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model = Qwen3VLForConditionalGeneration.from_pretrained(str(text_encoder_dir), dtype=dtype)
        except Exception as e:
            raise CheckpointError(
                f"cannot load the Qwen3-VL text encoder from {text_encoder_dir}: {e}"
            ) from e
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        return cls(model.to(device).eval().requires_grad_(False), tok, improc, template)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def decoder_layers(self):
        return getattr(_language_model(self.model), "layers", None)

    def resident(self):
        return self.offloader.on_device() if self.offloader is not None else contextlib.nullcontext()

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list | None = None) -> tuple[torch.Tensor, ...]:
        """(emb (B, L, D) right-padded, mask (B, L) long or None, slots (B, L) bool image-slot positions).

        `images`: PIL condition images (already resized), the same set for every prompt."""
        prompts = [p if p else " " for p in prompts]  # Qwen has no bos token: "" would encode nothing
        if not images:
            texts, vis = [T2I_TEMPLATE.format(p) for p in prompts], None
        else:
            template = ti2i_template(len(images))
            flat = [flatten_rgba(im) for _ in prompts for im in images]
            vis = self.image_processor(images=flat, return_tensors="pt")
            merge = self.image_processor.merge_size**2
            counts = [int(g.prod()) // merge for g in vis["image_grid_thw"]]
            texts, k = [], 0
            for p in prompts:
                parts = template.format(p).split(IMAGE_PAD)
                if len(parts) - 1 != len(images):
                    raise ValueError(f"the prompt {p!r} itself contains {IMAGE_PAD}; remove it")
                texts.append(
                    parts[0] + "".join(IMAGE_PAD * counts[k + i] + rest for i, rest in enumerate(parts[1:]))
                )
                k += len(images)
        graphs = self._graph_runner() if vis is None else None
        # diffusers left-pads a batch; a graph needs real tokens first (causal attention: a pad after
        # them never reaches them, and positions count from 0 either way)
        side = "right" if graphs is not None else "left"
        tok = self.tokenizer(texts, padding=True, padding_side=side, return_tensors="pt")
        ids, attn = tok.input_ids.to(self.device), tok.attention_mask.to(self.device)
        if graphs is not None:
            return self._gather(graphs(ids, attn), ids, attn)
        kwargs = {}
        if vis is not None:
            kwargs = {
                "pixel_values": vis["pixel_values"].to(self.device, self.model.dtype),
                "image_grid_thw": vis["image_grid_thw"].to(self.device),
                "mm_token_type_ids": (ids == self.image_token_id).to(torch.int32),
            }
        from ..runtime.cuda_graphs import final_norm_input

        with final_norm_input(self._lm), self.resident():
            # logits of one position only: the LM head over every token (151k x 4096) is never read
            out = self.model(
                input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1, **kwargs
            )
        return self._gather(out.hidden_states[-1], ids, attn)  # (B, T, D), before the final norm

    def _graph_runner(self):
        """The language model's CUDA-graph runner for text-only encodes, or None (off, not on CUDA,
        offloaded, or no pad token)."""
        if not self.cuda_graphs or self.offloader is not None or self.layer_streamer is not None:
            return None
        if self.device.type != "cuda":
            return None
        if self._graphs is None:
            from ..runtime.cuda_graphs import TextEncoderGraphs

            pad = self.tokenizer.pad_token_id
            self._graphs = False if pad is None else TextEncoderGraphs(self._lm, pad, pre_norm=True)
        return self._graphs or None

    def _gather(
        self, hidden: torch.Tensor, ids: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Each prompt's real tokens (system turn dropped), right-padded again with a key mask."""
        m = attn.bool()
        seqs = [h[r][self.drop_idx :] for h, r in zip(hidden, m)]
        slots = [(i[r] == self.image_token_id)[self.drop_idx :] for i, r in zip(ids, m)]
        L = max(s.shape[0] for s in seqs)
        emb = torch.stack([torch.cat([s, s.new_zeros(L - s.shape[0], s.shape[1])]) for s in seqs])
        mask = torch.stack([torch.arange(L, device=emb.device) < s.shape[0] for s in seqs]).long()
        slot = torch.stack([torch.cat([s, s.new_zeros(L - s.shape[0])]) for s in slots])
        return emb, (None if bool(mask.all()) else mask), slot
