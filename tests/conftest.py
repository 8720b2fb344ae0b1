"""Shared fixtures: tiny random Qwen-Image pipelines built offline with diffusers and saved in the
real Hugging Face layout, then loaded by qwenfast. Built once per test session (a few seconds)."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

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


def assert_close_finite(actual, desired, *, rtol: float = 0.0, atol: float = 0.0, msg: str = "") -> None:
    """Two of our paths agree: the same shape (and dtype, for two tensors), every value finite in both
    (NaN never equals NaN here, nor inf inf: numpy's assert_allclose and assert_array_equal let NaN
    equal NaN by default), then |actual - desired| <= atol + rtol * |desired| elementwise (both 0:
    equal). numpy arrays or torch tensors; compared in float64."""
    import numpy as np

    def arr(x):
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().double().numpy()
        return np.asarray(x, dtype=np.float64)

    if isinstance(actual, torch.Tensor) and isinstance(desired, torch.Tensor):
        assert actual.dtype == desired.dtype, f"{msg} dtype {actual.dtype} != {desired.dtype}"
    a, d = arr(actual), arr(desired)
    assert a.shape == d.shape, f"{msg} shape {a.shape} != {d.shape}"
    for name, x in (("actual", a), ("desired", d)):
        bad = ~np.isfinite(x)
        assert not bad.any(), f"{msg} {name} has {int(bad.sum())} non-finite values of {x.size}"
    np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, equal_nan=False, err_msg=msg)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "NaN/inf in output"
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# CI runs every test: only GPU-only tests may skip there (.ci/run sets CI=true)

# The skip reasons of GPU-only tests, exactly as the tests give them: on a CPU these skip, and nothing else
# may. A new skip reason fails CI until it is listed here (and is GPU-only). Skipif reasons (true on CPU):
GPU_ONLY_REASONS = (
    "needs CUDA",
    "needs CUDA and triton",
    "needs CUDA (a parameter's data cannot move between CPU and meta)",
    "CUDA graphs need a GPU",
    "the fast paths need a GPU",
    "needs an FP8 GPU",
    "needs an FP8 GPU (sm_89+)",
    "needs a CUDA GPU with FP8 attention (sm_90+)",
)
# pytest.skip() reasons reached only on a GPU (with a detail after the colon), as regular expressions
GPU_ONLY_PATTERNS = (
    r"(cudnn|fa3) FP8 engine unavailable on this GPU box: .*",
    r"(cudnn|fa3) did not take the joint shape: .*",
    r"FA3 not installed or not a Hopper GPU: auto runs cuDNN \(checked above\)",
    r"FA3 not installed or not a Hopper GPU: key lengths run as a mask there",
)
GPU_ONLY = re.compile("|".join([*map(re.escape, GPU_ONLY_REASONS), *GPU_ONLY_PATTERNS]), re.S)  # fullmatch
# Kernel cases that run in Triton's CPU interpreter are skipped in the outer process on purpose and run in a
# child process (TRITON_INTERPRET=1) by test_interpreter_subprocess of the same file, which must then pass.
INTERP_ONLY = re.compile(r"TRITON_INTERPRET=1|under the interpreter")
MUST_PASS_IN_CI = ("tests/test_server.py::test_web_page_in_headless_chromium",
                   "tests/test_kernels.py::test_interpreter_subprocess",
                   "tests/test_fp8_fused.py::test_interpreter_subprocess",
                   "tests/test_int8.py::test_interpreter_subprocess",
                   "tests/test_lora_rows.py::test_interpreter_subprocess",
                   "tests/test_vae_fast.py::test_interpreter_subprocess",
                   "tests/test_transformer21_paths.py::test_interpreter_subprocess")  # fmt: skip


def _interp_only(item) -> bool:
    """A kernel case that runs only in Triton's interpreter child: skipped here by an INTERP_ONLY skipif."""
    return any(m.args and m.args[0] is True and INTERP_ONLY.search(m.kwargs.get("reason", ""))
               for m in item.iter_markers("skipif"))  # fmt: skip


def interpreter_cases(request) -> list[str]:
    """The names of the cases of the calling test's file that its test_interpreter_subprocess must run in
    the child: collected again here from the file's parametrisation, the items skipped in this process by
    an INTERP_ONLY reason (the ones InterpreterCases moves). The runner requires exactly these to pass."""
    names: list[str] = []

    def walk(node):
        for x in node.collect():
            if isinstance(x, pytest.Item):
                if _interp_only(x):
                    names.append(x.name)
            else:
                walk(x)

    walk(request.node.getparent(pytest.Module))
    assert names, "no interpreter cases collected: the runner would check nothing"
    return names


def chromium_path() -> str | None:
    """A Chromium for the page test: Debian's (`apt-get install chromium`, what .ci/run installs) or another
    on PATH; None lets playwright use its own browser (`playwright install chromium`)."""
    for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"):
        if Path(p).exists():
            return p
    return shutil.which("chromium") or shutil.which("chromium-browser")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _reason(report) -> str:
    r = report.longrepr
    text = r[2] if isinstance(r, tuple) and len(r) == 3 else str(r)
    return text.removeprefix("Skipped: ")


class SkipGuard:
    """Under CI=true, fail the session when a test skips for a reason other than "no GPU" (a missing package,
    no Chromium, no triton...), or when a test of MUST_PASS_IN_CI was collected but did not pass."""

    def __init__(self, must_pass: tuple[str, ...] = MUST_PASS_IN_CI):
        self.must_pass = must_pass
        self.collected: set[str] = set()
        self.passed: set[str] = set()
        self.skips: list[tuple[str, str]] = []
        self.problems: list[str] = []

    def pytest_collectreport(self, report):
        if report.skipped:  # a whole module skipped (importorskip at the top)
            self.skips.append((report.nodeid, _reason(report)))

    def pytest_collection_finish(self, session):
        self.collected.update(i.nodeid for i in session.items)  # after -k / -m deselection

    def pytest_runtest_logreport(self, report):
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, _reason(report)))
        elif report.passed and report.when == "call":
            self.passed.add(report.nodeid)

    def check(self) -> list[str]:
        problems = []
        for nodeid, reason in self.skips:
            if GPU_ONLY.fullmatch(reason):
                continue
            if INTERP_ONLY.search(reason):
                runner = nodeid.split("::")[0] + "::test_interpreter_subprocess"
                if runner in self.passed:
                    continue
                reason += f" -- and {runner} did not pass"
            problems.append(f"{nodeid}: skipped: {reason}")
        problems += [f"{n}: did not pass" for n in self.must_pass if n in self.collected and n not in self.passed]
        return problems

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if not in_ci():
            return
        self.problems = self.check()
        if self.problems and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.problems:
            terminalreporter.section("CI=true: only GPU-only tests may skip", red=True)
            for line in self.problems:
                terminalreporter.line(line, red=True)


class InterpreterCases:
    """Kernel cases that run in Triton's CPU interpreter are skipped in the outer process (they need
    TRITON_INTERPRET=1 from the start) and run in the child process of their file's
    test_interpreter_subprocess. When that test is selected too, deselect them instead of reporting ~100
    skips that are not skips; the summary says where they ran."""

    def __init__(self):
        self.moved: dict[str, int] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        runners = {i.nodeid for i in items if i.name == "test_interpreter_subprocess"}
        keep, moved = [], []
        for item in items:
            runner = item.nodeid.split("::")[0] + "::test_interpreter_subprocess"
            if runner in runners and _interp_only(item):
                moved.append(item)
                self.moved[runner] = self.moved.get(runner, 0) + 1
            else:
                keep.append(item)
        if moved:
            config.hook.pytest_deselected(items=moved)
            items[:] = keep

    def pytest_terminal_summary(self, terminalreporter):
        for runner, n in self.moved.items():
            terminalreporter.line(f"{n} kernel cases run in Triton's interpreter inside {runner} (deselected here)")


class GpuSuite:
    """`QWENFAST_GPU_SUITE=1`: keep only the tests that touch CUDA (their source or markers name it), so a
    GPU machine runs the GPU part of the suite (e.g. under each `QWENFAST_ARCH`) without the CPU-only
    hour around it. A test that mentions CUDA only to skip on the CPU is kept too: it is a GPU test."""

    def pytest_collection_modifyitems(self, config, items):
        import inspect

        def touches_cuda(item) -> bool:
            if re.search(r"[\[-]cpu[\]-]", item.name):  # the CPU case of a test parametrised by device
                return False
            marks = " ".join(repr(m.args) + repr(m.kwargs) + m.name for m in item.iter_markers())
            try:
                src = inspect.getsource(item.function)
            except (OSError, TypeError):
                src = ""
            return bool(re.search(r"cuda|gpu", marks + src, re.I))

        keep = [i for i in items if touches_cuda(i)]
        dropped = [i for i in items if not touches_cuda(i)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep


def pytest_configure(config):
    config.pluginmanager.register(SkipGuard(), "qwenfast_ci_skip_guard")
    config.pluginmanager.register(InterpreterCases(), "qwenfast_interpreter_cases")
    if os.environ.get("QWENFAST_GPU_SUITE") == "1":
        config.pluginmanager.register(GpuSuite(), "qwenfast_gpu_suite")


# ---------------------------------------------------------------------------------------------
# Ray Serve: one local cluster of 2 simulated nodes per session (test_ray_serve.py, test_server_hostile.py)


class RayServeCluster:
    """A `ray.cluster_utils.Cluster` (head + 1 worker node, 2 logical CPUs each, no dashboard) with Serve's
    HTTP proxy on a free port; `deploy` runs a qwenfast app once per name and returns its base URL."""

    def __init__(self):
        import socket

        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        self.cluster.add_node(num_cpus=2)
        ray.init(address=self.cluster.address, logging_level="WARNING", log_to_driver=False)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": self.port})
        self.apps: dict[str, str] = {}

    def deploy(self, name: str, flags: dict, cfg=None, prefix: str | None = None) -> str:
        """Base URL of app `name` (deployed on first use) from `qwenfast serve` flags and an optional config."""
        from ray import serve

        from qwenfast.server.ray_app import application, args_from_dict

        if name not in self.apps:
            prefix = prefix or f"/{name}"
            serve.run(application(args_from_dict(flags), cfg, name=name), name=name, route_prefix=prefix)
            self.apps[name] = f"http://127.0.0.1:{self.port}{prefix.rstrip('/')}"
        return self.apps[name]

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)
        self.apps.pop(name, None)

    def shutdown(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="session")
def ray_serve():
    pytest.importorskip("ray.serve")
    c = RayServeCluster()
    yield c
    c.shutdown()
