"""Mutation audit of the test suite: do the tests catch these injected bugs?

    python tests/mutations.py            # every mutation; exit status 1 if any survives
    python tests/mutations.py --list     # what each mutation changes and which tests should catch it
    python tests/mutations.py taylor-factor-1 --keep   # one mutation; keep its copy to inspect
    python tests/mutations.py --no-baseline             # skip the runs of the unmutated tree first
    python tests/mutations.py --rev HEAD                # the committed tree, not the working tree's edits
    python tests/mutations.py --tests-rev HEAD~5        # the same mutations against an older suite

For each mutation this copies the package (`qwenfast/`), `tests/` and `pyproject.toml` to a fresh temporary
directory, applies one exact text replacement to one file (it fails loudly when the target text is not
there exactly once, so the script cannot rot silently into testing nothing), and runs the tests that
should catch it there: cwd and PYTHONPATH are the copy, and the child checks that `qwenfast` is imported
from the copy (qwenfast is installed editable from the checkout) before it starts pytest. A mutation is
"killed" when those tests fail (or hang past --timeout), "survived" when they pass. First, the same tests
run on an unmutated copy ("baseline") and must pass, so that "killed" means the mutation, not a broken
test or machine. Not collected by pytest (no test_ prefix).

Every mutation here survived the suite once (`--tests-rev eb2a8c1` shows it); each is kept as a
regression check of the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug it injects
    file: str  # relative to the repository root
    old: str  # exact text, present exactly once
    new: str
    tests: tuple[str, ...]  # test files (pytest node ids) that must fail
    select: str | None = None  # pytest -k expression, to keep a run short

    def apply(self, root: Path) -> None:
        path = root / self.file
        text = path.read_text()
        n = text.count(self.old)
        if n != 1:
            raise SystemExit(f"mutation {self.name}: the target text is in {self.file} {n} times (want exactly 1); "
                             f"update the mutation to the current code:\n{self.old}")  # fmt: skip
        path.write_text(text.replace(self.old, self.new))


MUTATIONS = (
    Mutation(
        name="taylor-factor-1",
        what="static step cache: the Taylor extrapolation factor is always 1, whatever the gap between full steps",
        file="qwenfast/runtime/cache.py",
        old="f.fill_((step.step - full[-1]) / gap if gap else 0.0)",
        new="f.fill_(1.0 if gap else 0.0)",
        tests=("tests/test_step_cache.py", "tests/test_step_cache21.py"),
    ),
    Mutation(
        name="max-loras-unchecked",
        what="server: a request may name any number of LoRAs (the `max_loras` limit is not checked)",
        file="qwenfast/server/schemas.py",
        old="    if len(loras) > limits.max_loras:\n",
        new="    if False:  # mutation: no LoRA count limit\n",
        tests=("tests/test_server.py", "tests/test_server_hostile.py"),
        select="lora",
    ),
    Mutation(
        name="negative-broadcast-wrong-row",
        what="one negative prompt for several prompts: rows after the first get a blank negative instead",
        file="qwenfast/pipeline/common.py",
        old="        negs = negs * len(prompts)\n",
        new='        negs = negs + [" "] * (len(prompts) - 1)\n',
        tests=("tests/test_inputs.py",),
    ),
)


TESTS_REV: str | None = None  # --tests-rev: take tests/ from this git revision instead of the working tree
REV: str | None = None  # --rev: take the package, tests/ and pyproject.toml from this git revision


def _from_git(rev: str, paths: list[str], dst: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *paths], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive.stdout, check=True)


def copy_tree(dst: Path) -> None:
    """The package, tests/ and pyproject.toml into `dst`: from the working tree, or from git (--rev,
    --tests-rev; a shared checkout's uncommitted edits then stay out)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    if REV is not None:
        _from_git(REV, ["qwenfast", "pyproject.toml"], dst)
    else:
        shutil.copytree(ROOT / "qwenfast", dst / "qwenfast", ignore=ignore, symlinks=True)
        shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    tests_rev = TESTS_REV or REV
    if tests_rev is None:
        shutil.copytree(ROOT / "tests", dst / "tests", ignore=ignore, symlinks=True)
    else:
        _from_git(tests_rev, ["tests"], dst)


# Run in the child: fail unless qwenfast comes from the mutated copy, then run pytest.
CHILD = """
import sys
from pathlib import Path
import qwenfast
root = Path(sys.argv[1]).resolve()
where = Path(qwenfast.__file__).resolve()
if root not in where.parents:
    sys.exit(f"qwenfast imported from {where}, not from the mutated copy under {root}")
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def run_tests(tests: tuple[str, ...], select: str | None, mutation: Mutation | None = None, keep: bool = False,
              timeout: float = 1800) -> tuple[bool, float, str]:  # fmt: skip
    """Run `tests` (-k `select`) on a fresh copy of the tree, with `mutation` applied (None: the tree as
    it is) -> (passed, seconds, pytest's output). A hung run counts as not passed."""
    name = mutation.name if mutation else "baseline"
    tmp = Path(tempfile.mkdtemp(prefix=f"qwenfast-mutation-{name}-"))
    try:
        copy_tree(tmp)
        if mutation:
            mutation.apply(tmp)
        env = dict(os.environ, PYTHONPATH=str(tmp) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("CI", None)  # the CI skip guard is not what is audited here
        args = [*tests, "-q", "-p", "no:cacheprovider"] + (["-x"] if mutation else []) + (["-k", select] if select else [])
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp), *args], cwd=tmp, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a hung test run: the tests do not pass; end its process group
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return False, time.monotonic() - t0, out + f"\n(timed out after {timeout} s)"
        took = time.monotonic() - t0
        if "not from the mutated copy" in out:
            raise SystemExit(out)
        if proc.returncode not in (0, 1):  # 2: interrupted, 3: internal error, 4: usage, 5: no tests collected
            raise SystemExit(f"{name}: pytest exited with {proc.returncode}:\n{out[-3000:]}")
        return proc.returncode == 0, took, out
    finally:
        if keep:
            print(f"  (kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def summary(out: str) -> str:
    """pytest's last line ("2 failed, 5 passed in 18.24s")."""
    return next((ln.strip("= ") for ln in reversed(out.splitlines()) if " in " in ln and ("passed" in ln or "failed" in ln)), "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--keep", action="store_true", help="keep each mutated copy")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs of the unmutated tree")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mutation's test run (a hang counts as killed)")
    ap.add_argument("--rev", metavar="REV", help="the package and tests of git revision REV (e.g. HEAD: leaves a "
                    "shared checkout's uncommitted edits out) instead of the working tree")  # fmt: skip
    ap.add_argument("--tests-rev", metavar="REV",
                    help="run the tests of git revision REV (e.g. an older commit: did its suite catch these?)")
    ap.add_argument("-k", dest="select", metavar="EXPR", help="pytest -k expression for every run, in place of each "
                    "mutation's own (e.g. to run one test of an older suite)")  # fmt: skip
    a = ap.parse_args(argv)
    global TESTS_REV, REV
    TESTS_REV, REV = a.tests_rev, a.rev
    chosen = [m for m in MUTATIONS if not a.names or m.name in a.names]
    if a.select:
        chosen = [dataclasses.replace(m, select=a.select) for m in chosen]
    unknown = set(a.names) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutation(s) {sorted(unknown)}; --list shows them")
    if a.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.what}\n  {m.file}; caught by {' '.join(m.tests)}" + (f" -k {m.select!r}" if m.select else ""))
        return 0
    if not a.no_baseline:  # "killed" means something only where the same tests pass on the tree as it is
        for tests, select in dict.fromkeys((m.tests, m.select) for m in chosen):
            ok, took, out = run_tests(tests, select, timeout=a.timeout)
            print(f"{'baseline':32} {'PASSED' if ok else 'FAILED':9} ({took:.0f} s; {summary(out)}; {' '.join(tests)}"
                  + (f" -k {select!r})" if select else ")"))  # fmt: skip
            if not ok:
                print(out[-4000:])
                raise SystemExit("the tests fail without any mutation: fix them first (or pass --no-baseline)")
    survived = []
    for m in chosen:
        passed, took, out = run_tests(m.tests, m.select, m, a.keep, a.timeout)
        verdict = "survived" if passed else "killed"
        if a.verbose:
            print(out)
        print(f"{m.name:32} {verdict.upper():9} ({took:.0f} s; {summary(out)})")
        if passed:
            survived.append(m.name)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations killed" +
          (f"; survived: {', '.join(survived)}" if survived else ""))  # fmt: skip
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
