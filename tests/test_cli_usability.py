"""The command line as a newcomer meets it: --version, defaults in every --help, one size rule and one
message with the server, flags named as typed, --parallel checked before any process starts, a note
for flags that do nothing here, where to get models the CLI cannot find, how to install a missing
extra, and the demo models' paths from Python."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import qwenfast
from qwenfast import validation as V
from qwenfast.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _sub(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


def _help(*names: str) -> str:
    p = build_parser()
    for n in names:
        p = p._subparsers._group_actions[0].choices[n]
    return " ".join(p.format_help().split())


def _error(argv: list[str], capsys) -> str:
    """The one `error:` line of a refused command (exit status 2, no traceback)."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    return err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"qwenfast {qwenfast.__version__}"


@pytest.mark.parametrize("cmd, wants", [
    (["serve"], ["--port PORT TCP port (default: 8000)", "(default: 64)", "(default: 4)", "(default: 600.0)",
                 f"(default: {V.MAX_SIDE})", "(default: 3600.0)", "(default: 120.0)", "(default: info)"]),
    (["generate"], ["(default: out.png)", "(default: 0.0)", "(default: 1.0)"]),
    (["edit"], ["(default: edited.png)"]),
    (["layers"], ["(default ./layers)", "(default 4)", "(default: 640)"]),
    (["bench", "serve"], ["(default: 8)", "(default 1 2 4 8; mixed: 4 8 16)"]),
    (["export", "onnx"], ["(default 1024)", "default cpu", "(default fp32)"]),
])  # fmt: skip
def test_help_shows_defaults(cmd, wants):
    h = _help(*cmd)
    for w in wants:
        assert w in h, (w, h)
    assert "(default: None)" not in h and "(default: False)" not in h and "(default: True)" not in h


def test_every_option_with_a_default_says_it():
    """Every option of every command whose default is a value (not None / a switch) shows it in --help."""

    def parsers(p, path=()):
        yield path, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    yield from parsers(sp, (*path, name))

    missing = []
    for path, p in parsers(build_parser()):
        for a in p._actions:
            if not a.option_strings or a.nargs == 0 or a.default in (None, [], argparse.SUPPRESS) or a.help is None:
                continue
            if "default" not in p.formatter_class("x")._get_help_string(a):
                missing.append(f"{' '.join(path)} {a.option_strings[-1]}")
            if a.help == "" or a.help is None:
                missing.append(f"{' '.join(path)} {a.option_strings[-1]} has no help")
    undocumented = [f"{' '.join(path)} {a.option_strings[-1]}" for path, p in parsers(build_parser())
                    for a in p._actions if a.option_strings and a.help is None and a.default not in (None, False)]  # fmt: skip
    assert not missing and not undocumented, missing + undocumented


def test_bench_help_does_not_call_cpu_benches_gpu_only():
    top = _help()
    assert "benchmarks (GPU)" not in top
    bench = _help("bench")
    assert re.search(r"quality .{0,120}CPU or GPU", bench) and re.search(r"serve .{0,120}CPU or GPU", bench), bench


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("size, rule", [
    ("100x100", "100x100: width and height must be multiples of 16; nearest: 96x96 or 112x112"),
    ("4096x4096", f"4096x4096: width and height must be in 16..{V.MAX_SIDE}"),
    ("2048x2056", f"2048x2056: width and height must be in 16..{V.MAX_SIDE}"),
])  # fmt: skip
def test_cli_and_server_refuse_the_same_sizes_with_the_same_message(size, rule, capsys, tmp_path):
    pytest.importorskip("pydantic")
    from qwenfast.server.options import Limits
    from qwenfast.server.schemas import APIError, validate

    err = _error(["generate", "x", "--size", size, "-o", str(tmp_path / "o.png")], capsys)
    assert f"argument --size: {rule}" in err, err
    with pytest.raises(APIError) as e:
        validate({"prompt": "x", "size": size}, Limits(), {"width": 128, "height": 128})
    assert e.value.status == 400 and e.value.code == "invalid_size" and e.value.message == f"`size` {rule}"
    assert not (tmp_path / "o.png").exists()


def test_one_default_max_side():
    from qwenfast.server.options import Limits

    assert Limits().max_side == V.MAX_SIDE and Limits().max_pixels == V.MAX_PIXELS
    a = _sub("serve").parse_args([])
    assert a.max_size == V.MAX_SIDE


# ------------------------------------------------------------------------------------ flags named as typed
def test_cli_errors_name_flags_and_the_server_names_fields(tmp_path, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "in.png")
    img = ["--image", str(tmp_path / "in.png"), "-o", str(tmp_path / "o.png")]
    assert _error(["generate", "x", *img, "--strength", "1.5"], capsys) == "error: --strength must be in 0..1, got 1.5\n"
    assert _error(["generate", "x", *img, "--strength", "0", "--steps", "4"], capsys) == \
        "error: --strength 0 with 4 steps leaves 0 denoising steps; raise --strength or --steps\n"  # fmt: skip
    assert _error(["layers", str(tmp_path / "in.png"), "--layers", "20"], capsys) == \
        "error: --layers must be in 1..16, got 20\n"  # fmt: skip
    for argv in (["generate", "x", "--cfg", "-1"], ["generate", "x", "--steps", "500"], ["edit", "a.png", "--prompt",
                 "x", "--seed", "-3"], ["layers", "a.png", "--resolution", "100"]):  # fmt: skip
        err = _error(argv, capsys)
        assert err.startswith("error: --") and "`" not in err, err
    with pytest.raises(ValueError) as e:  # the server's wording of the same rule (app.py's `_task_size`)
        V.check_strength(0.0, 4, name="`strength`", steps_name="`steps`")
    assert str(e.value) == "`strength` 0 with 4 steps leaves 0 denoising steps; raise `strength` or `steps`"


# ---------------------------------------------------------------------------------------------- --parallel
@pytest.mark.parametrize("cmd", [["generate", "x"], ["edit", "a.png", "--prompt", "x"]])
def test_parallel_layout_is_checked_before_any_process_starts(cmd, capsys, monkeypatch):
    from qwenfast import launch

    def no_spawn(*a, **k):
        raise AssertionError("a process was started for a layout the model cannot run")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    err = _error([*cmd, "--parallel", "ulysses=5", "--device", "cpu"], capsys)
    assert err == ("error: --parallel: ulysses=5 must divide the model's 3 attention heads; valid: ulysses=1, "
                   "ulysses=3 (each with cfg=1 or cfg=2)\n")  # fmt: skip
    assert _error([*cmd, "--parallel", "cfg=3", "--device", "cpu"], capsys).startswith("error: --parallel cfg=3: ")


def test_serve_checks_the_layout_before_starting(capsys, monkeypatch):
    pytest.importorskip("fastapi")
    from qwenfast import launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("spawned"))
    assert "valid: ulysses=1, ulysses=3" in _error(["serve", "--parallel", "ulysses=2", "--device", "cpu"], capsys)


def test_ulysses_choices_include_one():
    assert V.ulysses_choices(24) == [1, 2, 3, 4, 6, 8, 12, 24] and V.ulysses_choices(3) == [1, 3]


# --------------------------------------------------------------------------------- flags that do nothing here
def test_cpu_no_op_flags_get_a_note(tmp_path, capsys):
    out = tmp_path / "o.png"
    assert main(["generate", "a small red circle at the top left, blue background", "--size", "32x32", "--steps", "1",
                 "--device", "cpu", "--quiet", "--offload", "blocks", "--fp8", "--preset", "lightning-4",
                 "-o", str(out)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "note: --offload blocks does nothing on the CPU" in err and "running without it" in err
    assert "note: --fp8 on the CPU is emulated" in err
    assert "note: --preset lightning-4 is the sampling recipe of a distilled LoRA" in err and "--lora" in err
    assert out.exists() and Image.open(out).text["preset"] == "lightning-4"


def test_no_note_where_the_flags_do_something(capsys, monkeypatch):
    from qwenfast.cli_common import engine_notes

    monkeypatch.setenv("QWENFAST_ARCH", "sm_90")  # a card where --fp8 runs FP8 GEMMs (sm_86 gets a note)
    a = argparse.Namespace(preset="lightning-4", lora=[("x.safetensors", 1.0)], device="cuda", offload="blocks",
                           offload_budget=None, fp8=True)  # fmt: skip
    engine_notes(a)
    assert capsys.readouterr().err == "" and a.offload == "blocks"


def test_fp8_on_a_card_without_fp8_gemms_says_what_runs(capsys, monkeypatch):
    from qwenfast.cli_common import engine_notes

    for card, noted in (("sm_86", True), ("sm_80", True), ("sm_89", False), ("sm_90", False)):
        monkeypatch.setenv("QWENFAST_ARCH", card)
        engine_notes(argparse.Namespace(preset=None, lora=None, device="cuda", offload=None, offload_budget=None,
                                        fp8=True))  # fmt: skip
        err = capsys.readouterr().err
        assert ("weight-only" in err and card in err and "--int8" in err) is noted, (card, err)
    monkeypatch.delenv("QWENFAST_ARCH")
    engine_notes(argparse.Namespace(preset=None, lora=None, device="cpu", offload=None, offload_budget=None,
                                    fp8=False, int8=True))  # fmt: skip
    assert "note: --int8 on the CPU is emulated" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- models the CLI lacks
def test_layers_says_where_to_get_qwen_image_layered(tmp_path, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "in.png")
    hint = "hf download Qwen/Qwen-Image-Layered --local-dir /models/Qwen-Image-Layered"
    for extra in ([], ["--model", str(tmp_path / "nope")], ["--model", qwenfast.DEMO_MODEL]):
        err = _error(["layers", str(tmp_path / "in.png"), *extra], capsys)
        assert "Qwen/Qwen-Image-Layered" in err and hint in err, err


def test_controlnet_errors_name_the_instantx_nets(tmp_path, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "c.png")
    for extra in (["--control", str(tmp_path / "c.png")],
                  ["--control", str(tmp_path / "c.png"), "--controlnet", str(tmp_path / "nope")]):  # fmt: skip
        err = _error(["generate", "x", *extra, "-o", str(tmp_path / "o.png")], capsys)
        assert "InstantX/Qwen-Image-ControlNet-Union" in err and "InstantX/Qwen-Image-ControlNet-Inpainting" in err


# ------------------------------------------------------------------------------------------ extras, demo paths
def test_missing_server_extra_is_one_line_with_both_install_forms(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    err = _error(["serve"], capsys)
    assert err == ("error: `qwenfast serve` needs the server extra (fastapi is missing): pip install "
                   "'qwenfast[server]' (or, from a checkout: pip install -e \".[server]\")\n")  # fmt: skip


def test_every_install_hint_comes_from_one_helper():
    """No hand-written `pip install 'qwenfast[...]'` outside validation.install_hint."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in [*(ROOT / "qwenfast").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")]
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"pip install (-e )?['\"]?(qwenfast|\.)\[", line) and p.name != "validation.py"]  # fmt: skip
    assert not hits, hits


def test_demo_model_paths_without_torch():
    code = ("import sys, qwenfast; print(qwenfast.DEMO_MODEL); print(qwenfast.DEMO_EDIT_MODEL); "
            "print('torch' in sys.modules)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    t2i, edit, torch_loaded = r.stdout.split()
    assert torch_loaded == "False", r.stderr
    assert Path(t2i, "model_index.json").is_file() and Path(edit, "model_index.json").is_file()
    assert t2i == qwenfast.DEMO_MODEL and isinstance(qwenfast.DEMO_MODEL, str)
    assert "DEMO_MODEL" in qwenfast.__all__ and "DEMO_EDIT_MODEL" in qwenfast.__all__
    from qwenfast.pipeline.common import DEFAULT_MODEL
    from qwenfast.pipeline.edit import DEFAULT_EDIT_MODEL

    assert Path(qwenfast.DEMO_MODEL) == DEFAULT_MODEL and Path(qwenfast.DEMO_EDIT_MODEL) == DEFAULT_EDIT_MODEL


def test_output_name_is_checked_before_loading(tmp_path, capsys):
    """-o out.jpg used to get PNG bytes under a .jpg name; -o FOLDER failed only after generating."""
    err = _error(["generate", "x", "-o", str(tmp_path / "out.jpg")], capsys)
    assert "qwenfast writes PNG files" in err and "out.png" in err and not (tmp_path / "out.jpg").exists()
    err = _error(["edit", "a.png", "--prompt", "x", "-o", str(tmp_path)], capsys)
    assert err == f"error: -o {tmp_path} is a folder; give a file name such as {tmp_path / 'out.png'}\n"


def test_serve_refuses_a_busy_port_before_loading(capsys, monkeypatch):
    """uvicorn found the port taken only after the model had loaded, and exited 3 under an 'open http://...'."""
    pytest.importorskip("fastapi")
    import socket

    from qwenfast.server import run

    monkeypatch.setattr(run, "load_pipeline", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _error(["serve", "--port", str(port), "--device", "cpu"], capsys)
    assert err == f"error: cannot listen on 127.0.0.1:{port}: in use (another server?); pick another --port\n"


def test_serve_max_cfg_batch_reaches_the_server_config():
    pytest.importorskip("pydantic")
    from qwenfast.server.options import config_from_args

    assert config_from_args(_sub("serve").parse_args([])).max_cfg_batch is None  # default: --max-batch's
    cfg = config_from_args(_sub("serve").parse_args(["--max-batch", "8", "--max-cfg-batch", "2"]))
    assert (cfg.max_batch, cfg.max_cfg_batch) == (8, 2)
    with pytest.raises(SystemExit):
        _sub("serve").parse_args(["--max-cfg-batch", "0"])
