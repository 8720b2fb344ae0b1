"""Tiny random Qwen-Image pipelines, built fully offline.

Used by the tests (to compare qwenfast against diffusers) and to make the package's embedded
default model. Nothing here is imported by the engine; diffusers / transformers / tokenizers are
imported inside the functions.

- :func:`build_tokenizer` trains a small byte-level BPE (Qwen2 pre-tokenisation) on a fixed
  built-in English corpus and adds Qwen's special tokens. The Qwen-Image prompt-template prefixes
  tokenise to exactly 34 (text-to-image) and 64 (edit) tokens, like the real Qwen tokenizer, so the
  pipelines' ``drop_idx`` removes exactly the system prompt.
- :func:`build_text_encoder` makes a tiny ``Qwen2_5_VLForConditionalGeneration``.
- :func:`build_tiny_pipeline` assembles a diffusers ``QwenImagePipeline`` and optionally saves it
  with the real Hugging Face folder layout.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffusers import (
        AutoencoderKLQwenImage,
        DiffusionPipeline,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import (
        PreTrainedTokenizerBase,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2TokenizerFast,
        Qwen2VLProcessor,
    )

# Qwen2 pre-tokenisation regex (same as transformers' Qwen2Tokenizer).
_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Qwen2 / Qwen2.5-VL added tokens, in the real tokenizer's order (ids 151643... there; here they
# follow the trained vocabulary). (token, special)
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)

# The system texts of the diffusers prompt templates (copied verbatim from diffusers 0.42.1).
T2I_SYSTEM_TEXT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:"
)
EDIT_SYSTEM_TEXT = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate."
)

_CORPUS_WORDS = """
red green blue yellow orange purple pink brown black white gray grey cyan magenta violet gold silver
beige teal navy maroon olive turquoise crimson dark light bright pale colorful colourful
circle square triangle rectangle cube sphere cone cylinder star heart hexagon oval line dot ring
pyramid diamond cross arrow spiral wave grid stripe stripes pattern
left right top bottom middle center centre above below under over behind front next near far
inside outside between corner edge side upper lower beside around across along
big small large tiny huge little tall short long wide narrow thick thin round flat sharp soft
cat dog bird fish horse cow tree flower house car boat sky sun moon cloud clouds mountain river
sea ocean beach forest city street road window door table chair cup book lamp ball box bottle
man woman child person people girl boy face hand hat dress shirt shoes glasses sign logo poster
photo photograph painting drawing sketch picture illustration render scene view portrait landscape
a an the of and or with in on at to by for from is are was were be it its this that these those
one two three four five six seven eight nine ten many some few several each every all no
very quite more most less holding sitting standing walking running flying floating lying looking
wearing reading writing says saying hello world text word letters font style art realistic
cartoon anime watercolor oil digital cinematic detailed simple clean sharp blurry shiny matte
wooden metal glass stone paper plastic fabric water fire snow grass sand light shadow
morning evening night day sunset sunrise summer winter spring autumn rain fog
high quality best masterpiece ultra resolution background foreground close up wide angle shot
make change turn add remove replace keep same new old into color shape size texture quantity
""".split()

_CORPUS_SENTENCES = (
    T2I_SYSTEM_TEXT,
    EDIT_SYSTEM_TEXT,
    "system",
    "user",
    "assistant",
    "Picture 1: Picture 2: Picture 3:",
    "A red circle on the left of a blue square.",
    "A small green triangle above a large yellow rectangle, white background.",
    "Two cats sitting next to a tall tree under a bright blue sky.",
    "A photo of a dog holding a sign that says hello world.",
    "A cute cat wearing a tiny hat, watercolor painting, highly detailed.",
    "Three orange spheres in the middle of a dark gray room, soft light.",
    "Make the sky purple and add a moon in the top right corner.",
    "Change the color of the car to red; keep the background the same.",
    "Turn the picture into a pencil sketch.",
    'Remove the person on the right. Replace the text with "Qwen".',
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9",
    "Negative prompt: blurry, low quality, ugly, deformed, text, watermark.",
)


def _corpus() -> list[str]:
    lines = list(_CORPUS_SENTENCES)
    words = sorted(set(_CORPUS_WORDS))
    # Each word alone, with a leading space, and capitalised, so that " word", "word" and " Word"
    # all become single tokens.
    lines += [" ".join(words)]
    lines += words
    lines += [" ".join(w.capitalize() for w in words)]
    return lines


_BPE_VOCAB_LIMIT = 2048  # training stops earlier (~1741) once every corpus pre-token is one token


def build_tokenizer() -> Qwen2TokenizerFast:
    """A small Qwen2-style byte-level BPE tokenizer (``transformers.Qwen2TokenizerFast``), made offline.

    Deterministic: the same vocabulary and merges every run. Special tokens follow the trained
    vocabulary; ``<|endoftext|>`` is the pad token, ``<|im_end|>`` the eos token (as Qwen2.5-VL),
    padding on the right.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(
        models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_LIMIT,
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, s in QWEN_ADDED_TOKENS if s])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, s in QWEN_ADDED_TOKENS if not s])

    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="right",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        errors="replace",
        add_prefix_space=False,
    )
    return tokenizer


def text_encoder_config(
    tokenizer: PreTrainedTokenizerBase, hidden_size: int = 64, num_layers: int = 2
) -> dict[str, Any]:
    """Keyword arguments for a tiny ``Qwen2_5_VLConfig`` (flat text keys + ``vision_config``)."""
    num_heads = 4
    if hidden_size % (2 * num_heads) != 0:
        raise ValueError(f"hidden_size must be a multiple of {2 * num_heads}, got {hidden_size}")
    head_dim = hidden_size // num_heads
    # mrope_section splits the head_dim/2 rotary frequencies among (t, h, w) like the real [16, 24, 24].
    h = 3 * (head_dim // 2) // 8
    mrope_section = [head_dim // 2 - 2 * h, h, h]
    assert sum(mrope_section) == head_dim // 2 and min(mrope_section) > 0, mrope_section
    ids = tokenizer.convert_tokens_to_ids
    text_config = {
        "model_type": "qwen2_5_vl_text",
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads // 2,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.05,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": num_layers,
        "attention_dropout": 0.0,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section},
        "rope_theta": 1000000.0,
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "tie_word_embeddings": False,
    }
    vision_config = {
        "model_type": "qwen2_5_vl_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
        "out_hidden_size": hidden_size,
        "fullatt_block_indexes": [1],
        "hidden_act": "silu",
        "initializer_range": 0.05,
    }
    return {
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
        "tie_word_embeddings": False,
    }


def _randomize(
    module: torch.nn.Module,
    generator: torch.Generator,
    norm_scale: float = 0.1,
    bias_std: float | None = None,
) -> None:
    """Make weights that default initialisation leaves trivial non-trivial.

    Every parameter of a normalisation module (class name containing "norm": LayerNorm, RMSNorm,
    Qwen2RMSNorm, QwenImageRMS_norm, ...) becomes ~1 +- norm_scale (weights, gammas) or
    ~0 +- norm_scale (biases), so a loader that drops or mis-maps them gives visibly different
    results. With ``bias_std``, all other biases are redrawn from N(0, bias_std) (transformers
    initialises them to zero).
    """
    with torch.no_grad():
        for mod in module.modules():
            is_norm = "norm" in type(mod).__name__.lower()
            for leaf, p in mod.named_parameters(recurse=False):
                if is_norm:
                    noise = torch.randn(p.shape, generator=generator) * norm_scale
                    p.copy_(noise if leaf == "bias" else 1.0 + noise)
                elif leaf == "bias" and bias_std is not None:
                    p.copy_(torch.randn(p.shape, generator=generator) * bias_std)


def build_text_encoder(
    tokenizer: PreTrainedTokenizerBase, seed: int = 0, hidden_size: int = 64, num_layers: int = 2
) -> Qwen2_5_VLForConditionalGeneration:
    """A tiny random ``Qwen2_5_VLForConditionalGeneration`` (fp32, eval mode) matching ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        **text_encoder_config(tokenizer, hidden_size=hidden_size, num_layers=num_layers)
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed + 1000)
    _randomize(model, gen, bias_std=config.text_config.initializer_range)
    return model.eval()


SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

VAE_CONFIG: dict[str, Any] = {
    "base_dim": 16,
    "z_dim": 16,
    "dim_mult": [1, 1, 1, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}


def build_transformer(
    joint_attention_dim: int,
    *,
    seed: int = 0,
    num_layers: int = 2,
    zero_cond_t: bool = False,
    heads: int = 2,
    **extra: Any,
) -> QwenImageTransformer2DModel:
    """A tiny random ``QwenImageTransformer2DModel`` (inner dim 64, head dim 32, rope axes (8, 12, 12));
    ``extra``: more config fields (Layered's ``use_layer3d_rope`` / ``use_additional_t_cond``)."""
    from diffusers import QwenImageTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=num_layers,
            attention_head_dim=32,
            num_attention_heads=heads,
            joint_attention_dim=joint_attention_dim,
            axes_dims_rope=(8, 12, 12),
            zero_cond_t=zero_cond_t,
            **extra,
        )
    gen = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        # Variance-preserving Linear weights (PyTorch's default init is ~1/sqrt(3) of that), and the
        # attention output projections doubled, so that text, timestep and RoPE positions visibly
        # change the prediction (relative change ~14% / ~40% / ~6%) while its std stays ~1.
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                gain = 2.0 if name.endswith(("to_out.0", "to_add_out")) else 1.0
                mod.weight.normal_(0.0, gain / mod.in_features**0.5, generator=gen)
    _randomize(model, gen, norm_scale=0.1)
    return model.eval()


def build_vae(*, seed: int = 0, input_channels: int = 3) -> AutoencoderKLQwenImage:
    """A tiny random ``AutoencoderKLQwenImage`` (base_dim 16, z_dim 16, 8x spatial compression) with
    seeded non-trivial ``latents_mean`` / ``latents_std`` and perturbed RMS-norm gammas
    (``input_channels`` 4: Qwen-Image-Layered's RGBA VAE)."""
    from diffusers import AutoencoderKLQwenImage

    gen = torch.Generator().manual_seed(seed + 3000)
    z_dim = VAE_CONFIG["z_dim"]
    latents_mean = [round(v, 4) for v in (torch.randn(z_dim, generator=gen) * 0.5).tolist()]
    latents_std = [round(v, 4) for v in (0.5 + 2.5 * torch.rand(z_dim, generator=gen)).tolist()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoencoderKLQwenImage(
            **VAE_CONFIG, latents_mean=latents_mean, latents_std=latents_std, input_channels=input_channels
        )
    _randomize(model, gen, norm_scale=0.1)
    with torch.no_grad():  # more contrast in the decoded images (std ~0.15 -> ~0.45 in [-1, 1])
        model.decoder.conv_out.weight.mul_(3.0)
        model.decoder.conv_out.bias.mul_(3.0)
    return model.eval()


def build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


# Qwen-Image-Edit's processor settings (CLIP mean/std are the class defaults).
_IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def _install_processor_saver(processor) -> None:
    """transformers cannot save a Qwen2VLProcessor without a video processor (which needs
    torchvision): give this instance a ``save_pretrained`` writing the tokenizer files and
    ``preprocessor_config.json`` (the files :func:`load_processor` reads back), plus a
    ``video_preprocessor_config.json`` like the real checkpoints carry."""
    import json

    def save_pretrained(
        save_directory: str | os.PathLike, safe_serialization: bool = True, **kwargs: Any
    ) -> None:
        os.makedirs(save_directory, exist_ok=True)
        processor.tokenizer.save_pretrained(save_directory)
        processor.image_processor.save_pretrained(save_directory)
        ip = processor.image_processor
        video = {
            "video_processor_type": "Qwen2VLVideoProcessor",
            "processor_class": "Qwen2VLProcessor",
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": list(ip.image_mean),
            "image_std": list(ip.image_std),
            "rescale_factor": ip.rescale_factor,
            "resample": 3,
            "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
            "patch_size": ip.patch_size,
            "temporal_patch_size": ip.temporal_patch_size,
            "merge_size": ip.merge_size,
        }
        with open(os.path.join(save_directory, "video_preprocessor_config.json"), "w") as f:
            json.dump(video, f, indent=2, sort_keys=True)

    processor.save_pretrained = save_pretrained


def build_processor(tokenizer: PreTrainedTokenizerBase) -> Qwen2VLProcessor:
    """A ``Qwen2VLProcessor`` (PIL image processor, no video processor) for the edit pipelines.

    transformers 5 insists on a torchvision video processor; its class check is relaxed while
    constructing so that ``video_processor=None`` is accepted (the edit pipelines use images only).
    """
    from transformers import Qwen2VLProcessor

    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # transformers 4.x
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    image_processor = ImageProcessor(**_IMAGE_PROCESSOR_CONFIG)
    original = Qwen2VLProcessor.__dict__.get("check_argument_for_proper_class")

    def lenient(self: Qwen2VLProcessor, argument_name: str, argument: Any) -> Any:  # as transformers' check
        if argument is None and argument_name == "video_processor":
            return None
        return super(Qwen2VLProcessor, self).check_argument_for_proper_class(argument_name, argument)

    Qwen2VLProcessor.check_argument_for_proper_class = lenient
    try:
        processor = Qwen2VLProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=None
        )
    finally:
        if original is None:
            del Qwen2VLProcessor.check_argument_for_proper_class
        else:
            Qwen2VLProcessor.check_argument_for_proper_class = original
    _install_processor_saver(processor)
    return processor


def load_processor(folder: str | os.PathLike) -> Qwen2VLProcessor:
    """Reload a processor folder written by :func:`build_tiny_pipeline` (``<path>/processor``)
    without torchvision; pass it as ``processor=`` to the edit pipelines' ``from_pretrained``."""
    from transformers import Qwen2Tokenizer

    return build_processor(Qwen2Tokenizer.from_pretrained(folder))


_PIPELINE_CLASSES = {
    None: "QwenImagePipeline",
    "edit": "QwenImageEditPipeline",
    "edit-plus": "QwenImageEditPlusPipeline",
}


def build_tiny_pipeline(
    path: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    zero_cond_t: bool = False,
    edit: str | None = None,
    transformer_layers: int = 2,
    heads: int = 2,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> DiffusionPipeline:
    """A tiny random diffusers Qwen-Image pipeline, optionally saved to ``path``.

    ``edit``: None -> ``QwenImagePipeline``; "edit" -> ``QwenImageEditPipeline``; "edit-plus" ->
    ``QwenImageEditPlusPipeline`` (with a torchvision-free processor, see :func:`build_processor`).
    All weights are seeded by ``seed`` (built in fp32, then cast to ``dtype``). With ``path`` the
    pipeline is saved with ``save_pretrained(path, safe_serialization=True, max_shard_size=...)``,
    giving the Hugging Face folder layout; a small ``max_shard_size`` (e.g. "200KB") shards the
    transformer (and text encoder) with ``*.safetensors.index.json`` files.
    """
    import diffusers

    if edit not in _PIPELINE_CLASSES:
        raise ValueError(f"edit must be one of {list(_PIPELINE_CLASSES)}, got {edit!r}")
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer, seed=seed)
    components = {
        "scheduler": build_scheduler(),
        "vae": build_vae(seed=seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": build_transformer(
            text_encoder.config.text_config.hidden_size,
            seed=seed,
            num_layers=transformer_layers,
            zero_cond_t=zero_cond_t,
            heads=heads,
        ),
    }
    if edit is not None:
        components["processor"] = build_processor(tokenizer)
    pipe = getattr(diffusers, _PIPELINE_CLASSES[edit])(**components)
    if dtype != torch.float32:
        from diffusers.utils import logging as d_logging

        verbosity = d_logging.get_verbosity()
        d_logging.set_verbosity_error()  # silences a spurious "should be kept in float32: []" warning
        try:
            pipe.to(dtype=dtype)
        finally:
            d_logging.set_verbosity(verbosity)
    pipe.set_progress_bar_config(disable=True)
    if path is not None:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Writing model shards" bars of transformers' save_pretrained
        try:
            pipe.save_pretrained(os.fspath(path), safe_serialization=True, max_shard_size=max_shard_size)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    return pipe
