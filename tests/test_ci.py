"""CI runs every test: the skip guard of conftest.py, the CI script and the [test] extra."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import InterpreterCases, SkipGuard, chromium_path, in_ci

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

def test_ok():
    pass

@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu_only():
    pass

@pytest.mark.skipif(True, reason="needs an FP8 GPU (sm_89+)")
def test_fp8_gpu():
    pass
'''


def _run(pytester, monkeypatch, ci: str | None, extra: str = "", must_pass=()):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makepyfile(test_suite=SUITE + extra)
    guard = SkipGuard(must_pass=must_pass)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[guard]), guard


def test_gpu_only_skips_pass_in_ci(pytester, monkeypatch):
    result, guard = _run(pytester, monkeypatch, "true")
    assert result.ret == 0 and not guard.problems
    result.assert_outcomes(passed=1, skipped=2)


@pytest.mark.parametrize("how", ["skipif", "importorskip", "runtime", "mentions-gpu"])
def test_other_skips_fail_ci(pytester, monkeypatch, how):
    extra = {
        "skipif": '\n@pytest.mark.skipif(True, reason="no headless Chromium can start here")\ndef test_page():\n    pass\n',
        # naming CUDA or a GPU is not enough: only the listed GPU-only reasons pass (conftest.GPU_ONLY_REASONS)
        "mentions-gpu": '\n@pytest.mark.skipif(True, reason="needs CUDA, or the cuDNN frontend on a GPU")\ndef test_x():\n    pass\n',
        "importorskip": '\ndef test_triton():\n    pytest.importorskip("no_such_module_qwenfast")\n',
        "runtime": '\ndef test_rt():\n    pytest.skip("triton is not installed")\n',
    }[how]
    result, guard = _run(pytester, monkeypatch, "true", extra)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert len(guard.problems) == 1 and "skipped" in guard.problems[0]
    assert "only GPU-only tests may skip" in result.stdout.str()
    # outside CI the same run passes: skips are fine on a developer's machine
    result, guard = _run(pytester, monkeypatch, None, extra)
    assert result.ret == 0 and not guard.problems


def test_every_listed_gpu_only_reason_is_a_reason_the_suite_gives():
    """conftest.GPU_ONLY_REASONS lists what tests really skip for (no stale entries that would let a new
    test skip for an old reason unnoticed), and is all about a GPU."""
    from .conftest import GPU_ONLY_PATTERNS, GPU_ONLY_REASONS

    text = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py")) + \
        (ROOT / "qwenfast" / "testing" / "interp.py").read_text()  # kernel_devices' default reason  # fmt: skip
    for reason in GPU_ONLY_REASONS:
        assert re.search(r"\breason=\(?\s*f?[\"']" + re.escape(reason) + "[\"']", text) or \
            f'"{reason}"' in text, reason  # fmt: skip
        assert re.search(r"CUDA|GPU", reason), reason
    assert all(re.search(r"GPU|cudnn|fa3|FA3", p) for p in GPU_ONLY_PATTERNS)


def test_interpreter_skips_need_their_subprocess_to_pass(pytester, monkeypatch):
    skipped_case = '\n@pytest.mark.skipif(True, reason="needs TRITON_INTERPRET=1 (subprocess)")\ndef test_k_interp():\n    pass\n'
    result, guard = _run(pytester, monkeypatch, "true", skipped_case)
    assert result.ret == pytest.ExitCode.TESTS_FAILED and "test_interpreter_subprocess did not pass" in guard.problems[0]
    result, guard = _run(pytester, monkeypatch, "true", skipped_case + "\ndef test_interpreter_subprocess():\n    pass\n")
    assert result.ret == 0 and not guard.problems


def test_required_tests_must_pass_in_ci(pytester, monkeypatch):
    result, guard = _run(pytester, monkeypatch, "true", must_pass=("test_suite.py::test_gpu_only",))
    assert result.ret == pytest.ExitCode.TESTS_FAILED and guard.problems == ["test_suite.py::test_gpu_only: did not pass"]
    result, guard = _run(pytester, monkeypatch, "true", must_pass=("test_suite.py::test_ok",))
    assert result.ret == 0


def test_ci_script_installs_chromium_and_runs_the_readme_command():
    run = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install torch==2\.13\.0 [^\n]+)\n```", readme)
    assert len(commands) == 2, commands  # the README's two set-up commands
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in run.splitlines()
    assert "apt-get install -y chromium" in run and "/usr/bin/chromium" in run


def test_test_extra_pulls_triton_and_playwright():
    block = re.search(r"^test = \[(.*?)\]\s*(#[^\n]*)?$", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    extra = re.findall(r'"([^"]+)"', re.sub(r"#[^\n]*", "", block.group(1)))  # (tomllib is Python 3.11+)
    names = {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0] for r in extra}
    assert {"triton", "playwright", "pytest", "diffusers"} <= names
    triton = next(r for r in extra if r.startswith("triton"))
    assert "3.7" in triton  # the triton torch 2.13 was released with (3.7.1)


@pytest.mark.skipif(not in_ci(), reason="checks the CI machine itself (CI=true)")
def test_ci_machine_has_what_the_suite_needs():
    pytest.importorskip("triton", reason="CI must install triton through the [test] extra")
    assert chromium_path() is not None, "no Chromium: .ci/run installs Debian's chromium"


def test_readme_and_docs_tell_real_users_where_the_models_are():
    readme = (ROOT / "README.md").read_text()
    models = (ROOT / "docs" / "models.md").read_text()
    for repo in ("Qwen/Qwen-Image", "Qwen/Qwen-Image-2512", "Qwen/Qwen-Image-Edit", "Qwen/Qwen-Image-Edit-2509",
                 "Qwen/Qwen-Image-Edit-2511", "Qwen/Qwen-Image-2.1", "Qwen/Qwen-Image-Layered",
                 "InstantX/Qwen-Image-ControlNet-Union", "InstantX/Qwen-Image-ControlNet-Inpainting",
                 "lightx2v/Qwen-Image-Lightning", "lightx2v/Qwen-Image-2512-Lightning",
                 "lightx2v/Qwen-Image-Edit-2511-Lightning", "Comfy-Org/Qwen-Image_ComfyUI"):  # fmt: skip
        assert f"`{repo}`" in readme, repo  # the README's model table names every repository
        assert re.search(rf"hf download {re.escape(repo)}[ `]", models), repo  # docs/models.md: its download command
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu130" in readme
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme  # PyPI's torch is CUDA
    assert 'pip install -e ".[gpu,server]"' in readme
    assert "trained on a synthetic world of coloured shapes at 128×128" in readme
    assert "qwenfast serve" in readme and '"size": "128x128"' in readme  # a server example the demo can answer
    assert "apt-get install chromium" in readme  # what the page test needs, said where the test command is


def test_interpreter_cases_are_deselected_when_their_subprocess_runs(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    case = '\nimport pytest\n@pytest.mark.skipif(True, reason="needs TRITON_INTERPRET=1 (subprocess)")\n' \
           '@pytest.mark.parametrize("i", [1, 2])\ndef test_k_interp(i):\n    pass\n'
    pytester.makepyfile(test_k=case + "\ndef test_interpreter_subprocess():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[InterpreterCases(), SkipGuard()])
    result.assert_outcomes(passed=1, deselected=2)
    assert "2 kernel cases run in Triton's interpreter inside test_k.py::test_interpreter_subprocess" in result.stdout.str()
    # without their subprocess in the run they stay skipped, and the CI guard refuses that
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "interp and not subprocess",
                                          plugins=[InterpreterCases(), SkipGuard()])  # fmt: skip
    result.assert_outcomes(skipped=2, deselected=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
