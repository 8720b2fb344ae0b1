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
    broken = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    assert main(["doctor", "--model", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "diffusion_pytorch_model.safetensors" in out


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "qwenfast.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "generate" in r.stdout and "doctor" in r.stdout
