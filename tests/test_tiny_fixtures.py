"""The tiny offline Qwen-Image fixtures (qwenfast.testing.tiny) behave like real checkpoints."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from qwenfast.testing.tiny import (  # noqa: E402
    QWEN_ADDED_TOKENS,
    SCHEDULER_CONFIG,
    build_tiny_pipeline,
    build_tokenizer,
    load_processor,
)

T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPTS = ["a red cat", "a big blue square on the left of a tiny green star"]


@pytest.fixture(scope="module")
def saved_t2i(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "qwen-image"
    pipe = build_tiny_pipeline(path, max_shard_size="200KB")
    return pipe, path


def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer()
    assert 1000 <= len(tok) <= 2100
    assert tok.padding_side == "right" and tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    # deterministic
    assert tok.backend_tokenizer.to_str() == build_tokenizer().backend_tokenizer.to_str()
    # prompt-template prefixes tokenise like the real Qwen tokenizer (diffusers drops 34 / 64 tokens)
    assert len(tok(T2I_TEMPLATE.split("{}")[0]).input_ids) == 34

    tok.save_pretrained(tmp_path)
    text = T2I_TEMPLATE.format("A zebra <|vision_start|><|image_pad|><|vision_end|> says 'hi' 42 日本")
    ids = tok(text).input_ids
    for cls in (transformers.AutoTokenizer, transformers.Qwen2Tokenizer):
        re = cls.from_pretrained(tmp_path)
        assert re(text).input_ids == ids
        assert re.pad_token_id == tok.pad_token_id and re.padding_side == "right"
        for name, _special in QWEN_ADDED_TOKENS:
            (tid,) = re(name).input_ids  # a single id
            assert tid == tok.convert_tokens_to_ids(name) >= tok.vocab_size
    assert tok.decode(ids) == text

    batch = tok(PROMPTS, max_length=1058, padding=True, truncation=True, return_tensors="pt")
    assert batch.attention_mask[0].tolist()[-1] == 0 and batch.input_ids[0, -1].item() == tok.pad_token_id


def test_saved_layout(saved_t2i, tmp_path):
    _, path = saved_t2i
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    for rel in (
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "vae/config.json",
        "text_encoder/config.json",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "scheduler/scheduler_config.json",
    ):
        assert (path / rel).is_file(), rel
    shards = sorted((path / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) > 1
    weight_map = json.loads((path / "transformer/diffusion_pytorch_model.safetensors.index.json").read_text())
    assert {p.name for p in shards} == set(weight_map["weight_map"].values())
    sched = json.loads((path / "scheduler/scheduler_config.json").read_text())
    assert {k: sched[k] for k in SCHEDULER_CONFIG} == SCHEDULER_CONFIG
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 8 * 2**20

    # edit-plus: processor folder written without torchvision, reloadable with load_processor
    edit_path = tmp_path / "edit-plus"
    build_tiny_pipeline(edit_path, edit="edit-plus", zero_cond_t=True)
    index = json.loads((edit_path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert json.loads((edit_path / "transformer/config.json").read_text())["zero_cond_t"] is True
    proc = load_processor(edit_path / "processor")
    assert proc.image_processor.patch_size == 14 and proc.image_processor.merge_size == 2


def _run(pipe, **kw):
    return pipe(
        prompt=PROMPTS,
        negative_prompt=["blurry", "low quality, ugly"],
        true_cfg_scale=4.0,
        height=48,
        width=80,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
        **kw,
    ).images


def test_diffusers_reload_same_output(saved_t2i):
    import diffusers

    pipe, path = saved_t2i
    out = _run(pipe)
    assert out.shape == (2, 48, 80, 3) and np.isfinite(out).all() and out.std() > 0.05
    assert not np.allclose(out[0], out[1], atol=1e-2)

    re = diffusers.QwenImagePipeline.from_pretrained(path)
    re.set_progress_bar_config(disable=True)
    np.testing.assert_allclose(_run(re), out, atol=1e-5, rtol=0)
    # mmapped safetensors are not 64-byte aligned, which can change CPU GEMM kernels at the ulp
    # level; with freshly allocated (aligned) weights the outputs are bit-identical.
    for module in (re.transformer, re.vae, re.text_encoder):
        for p in module.parameters():
            p.data = p.data.clone()
    assert np.array_equal(_run(re), out)

    # the text encoder's last hidden state is the final-normed output of its language model
    tok = pipe.tokenizer([T2I_TEMPLATE.format(p) for p in PROMPTS], padding=True, return_tensors="pt")
    with torch.no_grad():
        full = pipe.text_encoder(
            input_ids=tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True
        )
        base = pipe.text_encoder.model(input_ids=tok.input_ids, attention_mask=tok.attention_mask)
    assert torch.equal(full.hidden_states[-1], base.last_hidden_state)
