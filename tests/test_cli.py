"""The `qwenfast` command line: generate on the embedded model, doctor, and clear errors."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from qwenfast.cli import main
from qwenfast.pipeline.text_to_image import DEFAULT_MODEL


def test_generate_embedded_default_writes_png_with_metadata(tmp_path, capsys):
    out = tmp_path / "img.png"
    assert main(["generate", "a red circle", "-o", str(out), "--seed", "3", "--steps", "2", "--size", "64x48",
                 "--quiet"]) == 0  # fmt: skip
    im = Image.open(out)
    assert im.size == (64, 48) and im.mode == "RGB"
    assert im.text["prompt"] == "a red circle" and im.text["seed"] == "3" and im.text["steps"] == "2"
    assert im.text["size"] == "64x48" and im.text["cfg"] == "2.0" and im.text["model"] == str(DEFAULT_MODEL)
    assert im.text["negative_prompt"] == " "
    err = capsys.readouterr().err
    assert "embedded demo model" in err
    # same seed, same picture
    out2 = tmp_path / "img2.png"
    main(["generate", "a red circle", "-o", str(out2), "--seed", "3", "--steps", "2", "--size", "64x48", "--quiet"])
    assert np.array_equal(np.asarray(im), np.asarray(Image.open(out2)))


def test_generate_n_images_and_no_cfg(tmp_path):
    out = tmp_path / "many.png"
    assert main(["generate", "blue", "-o", str(out), "--n", "2", "--cfg", "1", "--steps", "1", "--size", "32x32",
                 "--quiet"]) == 0  # fmt: skip
    assert (tmp_path / "many-0.png").is_file() and (tmp_path / "many-1.png").is_file()
    assert Image.open(tmp_path / "many-0.png").text["negative_prompt"] == ""


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["generate", "x", "--size", "100"], "WIDTHxHEIGHT"),
        (["generate", "x", "--steps", "0"], "must be >= 1"),
        (["generate", "x", "--n", "two"], "whole number"),
    ],
)
def test_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_bad_model_folder_is_one_line_error(tmp_path, capsys):
    assert main(["generate", "x", "--model", str(tmp_path), "-o", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "model_index.json" in err


def test_bad_dtype(tmp_path, capsys):
    assert main(["generate", "x", "--dtype", "int4", "-o", str(tmp_path / "o.png")]) == 2
    assert "dtype 'int4'" in capsys.readouterr().err


def test_doctor(tmp_path, capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "complete (text-to-image)" in out
    assert "attention    FA3" in out and "8-bit engines:" in out
    assert "\nparallel     " in out and "GPU" in out.split("\nparallel     ")[1].splitlines()[0]
    broken = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    assert main(["doctor", "--model", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "diffusion_pytorch_model.safetensors" in out


def test_doctor_says_what_parallel_can_use(monkeypatch):
    import torch

    from qwenfast.cli_tools import _parallel_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _parallel_line().startswith("0 GPUs: one-GPU runs only")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    line = _parallel_line()
    assert line.startswith("4 GPUs: cfg=2, ulysses=2, ulysses=3, ulysses=4, cfg=2,ulysses=2;") and "peer memory" in line
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: {i, j} != {1, 3})
    assert "NCCL all-to-alls (no P2P" in _parallel_line()


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "qwenfast.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "generate" in r.stdout and "doctor" in r.stdout


# ---------------------------------------------------------------------------------------------
# sizes, value rules shared with the server, wrong model kind, corrupt weights


def test_size_off_the_multiple_is_refused_naming_the_nearest_sizes(tmp_path, capsys):
    out = tmp_path / "odd.png"
    with pytest.raises(SystemExit) as e:  # refused, as the server refuses it (one rule: validation.check_size)
        main(["generate", "a red circle", "-o", str(out), "--seed", "1", "--steps", "1", "--size", "17x33", "--quiet"])
    assert e.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "argument --size: 17x33: width and height must be multiples of 16; nearest: 16x32 or 32x48" in err, err


def test_size_far_from_the_trained_size_gets_one_note(tmp_path, capsys):
    assert main(["generate", "a red circle", "-o", str(tmp_path / "s.png"), "--steps", "1", "--size", "64x64",
                 "--quiet"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("note: this model was trained at 128x128; 64x64 will likely give a flat, empty picture") == 1
    assert main(["generate", "a red circle", "-o", str(tmp_path / "d.png"), "--steps", "1", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "trained at" not in cap.err and "128x128;" in cap.out  # the default is the model's own size


@pytest.mark.parametrize(
    "size, far",
    [((128, 128), False), ((144, 112), False), ((160, 128), False), ((64, 64), True), ((192, 96), True),
     ((256, 256), True), ((96, 96), True), ((128, 208), True)],
)  # fmt: skip
def test_size_note_rule(size, far):
    from qwenfast.validation import size_note

    note = size_note((128, 128), *size)
    assert (note is not None) == far
    if far:
        assert f"trained at 128x128; {size[0]}x{size[1]} will likely give a flat, empty picture" in note
    assert size_note(None, *size) is None  # models without trained_size: never a note


def test_demo_models_know_their_trained_size():
    import json

    from qwenfast.pipeline.edit import DEFAULT_EDIT_MODEL
    from qwenfast.validation import parse_trained_size

    for folder in (DEFAULT_MODEL, DEFAULT_EDIT_MODEL):
        extra = json.loads((folder / "qwenfast.json").read_text())
        assert parse_trained_size(extra.get("trained_size")) == (128, 128), folder
    assert json.loads((DEFAULT_MODEL / "qwenfast.json").read_text())["defaults"]["width"] == 128
    with pytest.raises(ValueError, match="trained_size"):
        parse_trained_size([128, "x"])


def test_help_does_not_promise_1024_as_the_default():
    from qwenfast.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    for cmd in ("generate", "edit"):
        h = " ".join(sub[cmd].format_help().split())
        assert "default: model's, 1024x1024" not in h and "4.0)" not in h
        assert "128x128 for the embedded demo" in h and "1024x1024 for Qwen-Image" in h
        assert "20 for the embedded demo" in h and "2 for the embedded demo" in h


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--cfg", "-5"], "error: --cfg must be in 0..20, got -5"),
        (["--cfg", "nan"], "error: --cfg must be a finite number"),
        (["--cfg", "21"], "error: --cfg must be in 0..20, got 21"),
        (["--seed", "-1"], "error: --seed must be in 0..9223372036854775807, got -1"),
        (["--seed", str(2**63)], "error: --seed must be in 0..9223372036854775807"),
        (["--steps", "101"], "error: --steps must be in 1..100, got 101"),
    ],
)
def test_values_the_server_refuses_are_refused(argv, msg, tmp_path, capsys):
    for cmd in (["generate", "x"], ["edit", "in.png", "--prompt", "x"]):
        assert main([*cmd, *argv, "-o", str(tmp_path / "o.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(msg), err
    assert not (tmp_path / "o.png").exists()


def test_cli_and_server_share_one_rule():
    pytest.importorskip("pydantic")
    from qwenfast.server.options import Limits
    from qwenfast.server.schemas import APIError, validate

    d = {"width": 128, "height": 128, "num_inference_steps": 20, "true_cfg_scale": 2.0}
    for field, v, msg in (("true_cfg_scale", -5.0, "`true_cfg_scale` must be in 0..20, got -5"),
                          ("seed", -1, "`seed` must be in 0..9223372036854775807, got -1"),
                          ("steps", 101, "`steps` must be in 1..100, got 101"),
                          ("n", 9, "`n` must be in 1..4 (images per request), got 9")):  # fmt: skip
        with pytest.raises(APIError) as e:
            validate({"prompt": "x", field: v}, Limits(), d)
        assert e.value.status == 400 and e.value.param == field and e.value.message == msg
    with pytest.raises(APIError, match="multiples of 16") as e:
        validate({"prompt": "x", "size": "17x33"}, Limits(), d)
    assert e.value.param == "size"
    r = subprocess.run([sys.executable, "-c", "import sys, qwenfast.validation, qwenfast.server.options; "
                        "print(sorted({'torch', 'fastapi', 'qwenfast.cli'} & set(sys.modules)))"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_wrong_model_kind_names_the_right_command(tmp_path, capsys):
    from qwenfast.pipeline.edit import DEFAULT_EDIT_MODEL

    Image.new("RGB", (64, 64), "red").save(tmp_path / "in.png")
    assert main(["edit", str(tmp_path / "in.png"), "--prompt", "make it blue", "--model", str(DEFAULT_MODEL),
                 "-o", str(tmp_path / "o.png")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("error:") and "`qwenfast edit` needs an edit model" in err
    assert f"qwenfast generate \"PROMPT\" --model {DEFAULT_MODEL}" in err and "QwenImagePipeline" not in err
    assert main(["generate", "x", "--model", str(DEFAULT_EDIT_MODEL), "-o", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "`qwenfast generate` needs a text-to-image model" in err
    assert f"qwenfast edit IMAGE.png --prompt \"INSTRUCTION\" --model {DEFAULT_EDIT_MODEL}" in err
    assert "QwenImageEditPipeline" not in err


@pytest.mark.parametrize("damage", ["truncated", "random", "padded", "bad-header"])
def test_doctor_finds_corrupt_weights(damage, tmp_path, capsys):
    broken = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, broken)
    f = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "random":
        f.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif damage == "padded":
        f.write_bytes(data + b"\0" * 10)
    else:  # a tensor's offsets no longer match its shape
        header = data[8 : 8 + n].replace(b'"shape":[', b'"shape":[2,', 1)
        f.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])
    assert main(["doctor", "--model", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and f"{f}: cannot read safetensors file" in out


def test_doctor_checks_every_shard_of_an_index(tmp_path, capsys):
    import json

    from qwenfast.loading.weights import check_safetensors

    broken = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, broken)
    te = broken / "text_encoder"
    shard = te / "model-00001-of-00002.safetensors"
    (te / "model.safetensors").rename(shard)
    assert check_safetensors(shard) is None
    keys = list(json.loads(shard.read_bytes()[8 : 8 + int.from_bytes(shard.read_bytes()[:8], "little")]))
    index = {"metadata": {}, "weight_map": {k: shard.name for k in keys if k != "__metadata__"}}
    index["weight_map"]["lm.x"] = "model-00002-of-00002.safetensors"
    (te / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["doctor", "--model", str(broken)]) == 1
    assert "lists shards that are missing" in capsys.readouterr().out  # a shard the index names is missing
    del index["weight_map"]["lm.x"]
    (te / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["doctor", "--model", str(broken)]) == 0  # every listed shard there and sound
    capsys.readouterr()
    shard.write_bytes(shard.read_bytes()[:-1])  # one byte short
    assert main(["doctor", "--model", str(broken)]) == 1
    out = capsys.readouterr().out
    assert f"{shard}: cannot read safetensors file" in out and "describes" in out
    assert "cannot read safetensors file" in check_safetensors(shard)


def test_quality_path_filter_keeps_the_reference_first(monkeypatch):
    import qwenfast.demo.bench as demo_bench

    seen = {}

    def fake(model, n, device, paths):
        seen["names"] = [p[0] for p in paths]
        return [{"path": p[0], "score": 90.0, "gap": 0.0} for p in paths]

    monkeypatch.setattr(demo_bench, "quality_paths", fake)
    assert main(["bench", "quality", "--paths", "--path", "fp8", "--n", "2"]) == 0
    assert seen["names"][0] == "reference fp32" and len(seen["names"]) == 2 and "fp8" in seen["names"][1]
    with pytest.raises(SystemExit) as e:
        main(["bench", "quality", "--paths", "--path", "no-such-path"])
    assert "no code path matches" in str(e.value) and "bf16 + kernels" in str(e.value)


def test_bench_attention_quality_dry_run_on_cpu(capsys):
    """`qwenfast bench attention quality --device cpu`: the gate's code path with 8-bit attention (the
    CPU runs the joint path's torch engine), scored against the fp32 reference."""
    import torch

    assert main(["bench", "attention", "quality", "--n", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "quality_summary model=demo-t2i" in out and "attention=fp8" in out
    if not torch.cuda.is_available():
        assert main(["bench", "attention", "micro"]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().out


def test_bench_parallel_gpu_counts(monkeypatch):
    """`qwenfast bench parallel --gpus 2,4`: each count spawned in turn over GPUs 0..N-1 (a 4-GPU
    machine measures 1, 2 and 4 GPUs in one command); counts the machine cannot run are refused
    before anything starts."""
    import argparse

    import torch

    import qwenfast.benchmarks.parallel as P
    import qwenfast.launch as launch

    p = argparse.ArgumentParser()
    P.add_arguments(p)
    assert p.parse_args(["--gpus", "2,4"]).gpus == [2, 4] and p.parse_args([]).gpus is None
    with pytest.raises(SystemExit):
        p.parse_args(["--gpus", "two"])
    spawned = []
    monkeypatch.setattr(launch, "spawn", lambda fn, args, n, what: spawned.append((n, args[0])))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert P.run_from_args(p.parse_args(["--gpus", "2,4"])) == 0
    assert spawned == [(2, 2), (4, 4)]
    spawned.clear()
    assert P.run_from_args(p.parse_args([])) == 0 and spawned == [(4, 4)]
    for bad in ("1,4", "8"):
        with pytest.raises(ValueError, match="takes counts from 2 to the 4 visible GPUs"):
            P.run_from_args(p.parse_args(["--gpus", bad]))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs at least 2 GPUs; 1 visible"):
        P.run_from_args(p.parse_args([]))
    assert spawned == [(4, 4)]  # nothing started by the refused calls


@pytest.mark.parametrize("what", ["transformer", "pipeline"])
def test_bench_21_from_the_cli_on_cpu(tmp_path, what):
    """`qwenfast bench transformer|pipeline --model-type 2.1` run the Qwen-Image-2.1 benchmarks against
    diffusers (here their code on the CPU: one full-width block, a 64² image) and append their records."""
    import json

    cpu = ["--device", "cpu"] if what == "transformer" else ["--smoke"]
    assert main(["bench", what, "--model-type", "2.1", *cpu, "--results", str(tmp_path)]) == 0
    name = "qwenimage21.jsonl"  # both 2.1 benchmarks append to one file
    rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
    if what == "transformer":
        assert {r["dtype"] for r in rows} == {"bf16", "fp8"}
        bf16 = next(r for r in rows if r["dtype"] == "bf16")
        assert bf16["rel_err_cached"] <= 1e-2 and bf16["diffusers_cached_ms"] > 0 and bf16["ours_cached_graph_ms"] > 0
    else:
        turbo = next(r for r in rows if r["what"].endswith("turbo-4"))
        assert turbo["diffusers_s"] > 0 and turbo["ours_s"] > 0 and turbo["mean_abs_diff_vs_diffusers"] < 0.05
        assert {r.get("cache") for r in rows if "cache" in r} == {"off", "balanced", "fast"}


def test_bench_pipeline_size_goes_to_the_21_bench_and_is_refused_elsewhere(monkeypatch, capsys):
    """`--size 2048 --model-type 2.1` reaches the 2.1 bench's own --size (the GPU path, its bench stubbed);
    without --model-type 2.1 the flag is refused with what to use instead."""
    import torch

    import qwenfast.benchmarks.pipeline21 as p21

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(p21, "main", lambda argv: seen.append(argv))
    assert main(["bench", "pipeline", "--model-type", "2.1", "--size", "2048"]) == 0
    assert seen and seen[0][seen[0].index("--size") + 1] == "2048" and "--steps" in seen[0]
    assert main(["bench", "pipeline", "--size", "2048"]) == 2
    assert "--model-type 2.1" in capsys.readouterr().err
