"""`qwenfast serve --row-loras N`: text-to-image requests with different LoRAs share one batch, each row
with its own; a request whose LoRA file is broken gets a 400 and its batch-mates their images (CPU, a
tiny FP8 pipeline, emulated)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from qwenfast import EngineOptions, QwenImagePipeline  # noqa: E402

from .test_lora_rows import _lora  # noqa: E402
from .test_server import GatedPipe, Senders, _wait, assert_same_image, png_pixels, running  # noqa: E402

TINY = Path(__file__).resolve().parent / "assets" / "tiny-random"
OK = {"prompt": "a cat", "size": "32x32", "steps": 1}


def test_requests_with_different_loras_share_a_batch(tmp_path):
    pipe = QwenImagePipeline.from_pretrained(TINY, device="cpu", dtype=torch.float32,
                                             options=EngineOptions(fp8=True))  # fmt: skip
    pipe.progress_bar = False
    save_file(_lora(1, 4), tmp_path / "a.safetensors")
    save_file(_lora(2, 8), tmp_path / "b.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    gated = GatedPipe(pipe)
    bodies = {
        "a": {**OK, "seed": 1, "lora": [{"name": "a", "strength": 0.7}]},
        "b": {**OK, "seed": 2, "lora": [{"name": "b", "strength": 1.0}]},
        "none": {**OK, "seed": 3},
        "bad": {**OK, "seed": 4, "lora": [{"name": "bad", "strength": 1.0}]},
    }
    with running(gated, max_batch=4, lora_dir=str(tmp_path), row_loras=2) as (base, _):
        assert pipe.row_loras is not None and pipe.row_loras.slots == 2
        gated.gate.clear()
        send = Senders(base)
        send.start("first", {**OK, "seed": 9})
        assert gated.entered.wait(30)
        for k, b in bodies.items():
            send.start(k, b)
        _wait(lambda: httpx.get(base + "/health").json()["queue"]["images"] == 4)
        gated.gate.set()
        send.join()
    res = send.res
    assert res["bad"].status_code == 400 and res["bad"].json()["error"]["code"] == "invalid_lora"
    assert str(tmp_path) not in res["bad"].text  # no host paths in answers
    assert all(res[k].status_code == 200 for k in ("first", "a", "b", "none")), {
        k: r.text[:200] for k, r in res.items()
    }
    # one batch after the first request: the three good ones together, whatever their LoRAs
    assert [len(c["prompts"]) for c in gated.calls] == [1, 3]
    for k, body in bodies.items():
        if k == "bad":
            continue
        loras = [[(x["name"], x["strength"]) for x in body.get("lora", [])]]
        want = pipe(prompt=[OK["prompt"]], negative_prompt=[" "], height=32, width=32, num_inference_steps=1,
                    generator=[torch.Generator("cpu").manual_seed(body["seed"])], output_type="pil",
                    loras=loras).images[0]  # fmt: skip
        assert_same_image(png_pixels(res[k].json()["data"][0]["b64_json"]), np.asarray(want), k)



def test_a_graph_server_pads_prompts_where_that_is_free(monkeypatch):
    """`qwenfast serve` without --text-bucket asks for text_bucket="auto": 64-token buckets with CUDA
    graphs where key lengths cost attention nothing (FlashAttention-3), 0 elsewhere and without graphs;
    --text-bucket N is taken as given; configure resolves "auto" to a number."""
    import argparse

    from qwenfast.options import EngineOptions
    from qwenfast.runtime import attention
    from qwenfast.server.engine import load_pipeline, server_engine_options
    from qwenfast.server.options import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert server_engine_options(p.parse_args([])).text_bucket == "auto"
    assert server_engine_options(p.parse_args(["--text-bucket", "0"])).text_bucket == 0
    pipe = load_pipeline(None, "cpu", None, EngineOptions(cuda_graphs=True, text_bucket="auto"))
    assert pipe.options.text_bucket == 0  # no FA3 on a CPU
    monkeypatch.setattr(attention, "key_lengths_free", lambda device: True)
    assert load_pipeline(None, "cpu", None, EngineOptions(cuda_graphs=True, text_bucket="auto")).options.text_bucket == 64
    assert load_pipeline(None, "cpu", None, EngineOptions(cuda_graphs=False, text_bucket="auto")).options.text_bucket == 0
    assert pipe.configure(text_bucket="auto").text_bucket == 64
