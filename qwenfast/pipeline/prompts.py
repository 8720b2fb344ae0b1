"""Prompt conditioning as diffusers' Qwen-Image pipelines build it: from prompt texts or from
caller-encoded `prompt_embeds` (+ masks), with the negative prompt for true CFG, repeated per image.
A mixin of `PipelineBase`, so every pipeline with a Qwen2.5-VL text encoder shares one rule set
(diffusers' `check_inputs` and `encode_prompt`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .common import as_prompt_list, negative_prompts
from .sampling import TextCond

log = logging.getLogger("qwenfast")


class PromptConds:
    """`_prompt_conds` and `_given_embeds` (see the module docstring); needs `encode_prompt`,
    `_repeat` and `transformer` from `PipelineBase`."""

    def _prompt_conds(
        self,
        prompt,
        negative_prompt,
        cfg_scale: float,
        n: int,
        max_sequence_length: int | None,
        prompt_embeds=None,
        prompt_embeds_mask=None,
        negative_prompt_embeds=None,
        negative_prompt_embeds_mask=None,
        encode: Callable | None = None,
    ) -> tuple[TextCond, TextCond | None, int]:
        """The call's prompt conditioning, as diffusers builds it: (cond, uncond or None, number of
        prompts), each repeated `n` times per prompt. Texts go through `encode(texts)` (default: the
        text encoder, cut to `max_sequence_length`); caller-encoded embeddings are used as they are (cut
        to `max_sequence_length` unless it is None, as the edit pipelines do). True CFG needs
        `cfg_scale` > 1 and a negative prompt (text or embeddings); one negative serves every prompt."""
        check_prompt_args(prompt, prompt_embeds, negative_prompt, negative_prompt_embeds)
        if encode is None:
            encode = lambda texts: self.encode_prompt(texts, n, max_sequence_length)  # noqa: E731
        if prompt_embeds is None:
            prompts = as_prompt_list(prompt, "prompt")
            cond = TextCond(*encode(prompts))
        else:
            cond = TextCond(*self._given_embeds(prompt_embeds, prompt_embeds_mask, n, max_sequence_length))
            prompts = [""] * prompt_embeds.shape[0]
        negs = None if negative_prompt_embeds is not None else negative_prompts(prompts, negative_prompt)
        has_neg = negs is not None or negative_prompt_embeds is not None
        if cfg_scale > 1 and not has_neg:
            log.info("true_cfg_scale=%s but no negative_prompt: classifier-free guidance is off", cfg_scale)
        elif cfg_scale <= 1 and has_neg:
            log.info("negative_prompt is given but classifier-free guidance is off since true_cfg_scale <= 1")
        if not (cfg_scale > 1 and has_neg):
            return cond, None, len(prompts)
        if negs is not None:
            return cond, TextCond(*encode(negs)), len(prompts)
        ne, nm = negative_prompt_embeds, negative_prompt_embeds_mask
        if ne.shape[0] == 1 < len(prompts):  # one negative for every prompt, as for texts
            ne = ne.expand(len(prompts), -1, -1)
            nm = None if nm is None else nm.expand(len(prompts), -1)
        if ne.shape[0] != len(prompts):
            raise ValueError(f"got {ne.shape[0]} negative_prompt_embeds rows for {len(prompts)} prompts")
        return cond, TextCond(*self._given_embeds(ne, nm, n, max_sequence_length)), len(prompts)

    def _given_embeds(
        self, emb: torch.Tensor, mask: torch.Tensor | None, n: int, max_sequence_length: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Caller-encoded prompt embeddings (B, L, D) and mask (B, L) -> repeated per image, as diffusers'
        `encode_prompt` treats them: cut to `max_sequence_length` (None: not cut), no mask when every
        token is real."""
        if not isinstance(emb, torch.Tensor) or emb.ndim != 3:
            raise ValueError(
                f"prompt embeddings must be a (batch, tokens, dim) tensor, got {getattr(emb, 'shape', emb)}"
            )
        dim = self.transformer.cfg.joint_attention_dim
        if emb.shape[2] != dim:
            raise ValueError(
                f"prompt embeddings have width {emb.shape[2]}, this model's text width is {dim} "
                "(encode the prompt with this model's text encoder)"
            )
        emb = emb[:, :max_sequence_length]
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
                raise ValueError(
                    f"prompt masks must be (batch, tokens) tensors, got {getattr(mask, 'shape', mask)}"
                )
            mask = mask[:, :max_sequence_length].to(emb.device, torch.long)  # (B, L)
            if tuple(mask.shape) != tuple(emb.shape[:2]):
                raise ValueError(
                    f"prompt mask shape {tuple(mask.shape)} does not match embeddings {tuple(emb.shape)}"
                )
            if bool(mask.all()):
                mask = None
        return self._repeat(emb, mask, n)


def check_prompt_args(prompt, prompt_embeds, negative_prompt, negative_prompt_embeds) -> None:
    """diffusers' `check_inputs` rules for prompts: exactly one of `prompt` / `prompt_embeds`, at most
    one of `negative_prompt` / `negative_prompt_embeds`."""
    if prompt is not None and prompt_embeds is not None:
        raise ValueError("give either `prompt` or `prompt_embeds`, not both (as in diffusers)")
    if prompt is None and prompt_embeds is None:
        raise ValueError("give `prompt` (text) or `prompt_embeds` (encoded); both are None")
    if negative_prompt is not None and negative_prompt_embeds is not None:
        raise ValueError(
            "give either `negative_prompt` or `negative_prompt_embeds`, not both (as in diffusers)"
        )
