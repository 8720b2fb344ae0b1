"""Shared fixtures: tiny random Qwen-Image pipelines built offline with diffusers and saved in the
real Hugging Face layout, then loaded by qwenfast. Built once per test session (a few seconds)."""

from __future__ import annotations

import warnings

import pytest
import torch

torch.manual_seed(0)
warnings.filterwarnings("ignore", message=".*should be kept in float32.*")


@pytest.fixture(scope="session")
def tiny_t2i(tmp_path_factory):
    """(diffusers pipeline, saved folder). Transformer and text encoder are sharded on disk."""
    pytest.importorskip("diffusers")
    from qwenfast.testing.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("models") / "tiny-qwen-image"
    ref = build_tiny_pipeline(path, seed=0, max_shard_size="200KB")
    ref.set_progress_bar_config(disable=True)
    return ref, path


@pytest.fixture(scope="session")
def qf_t2i(tiny_t2i):
    from qwenfast import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_t2i[1], device="cpu", dtype=torch.float32)
    pipe.progress_bar = False
    return pipe


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "NaN/inf in output"
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
