"""Mutation audit of the test suite: do the tests catch these injected bugs?

    python tests/mutations.py            # every mutation; exit status 1 if any survives
    python tests/mutations.py --list     # what each mutation changes and which tests should catch it
    python tests/mutations.py taylor-factor-1 --keep   # one mutation; keep its copy to inspect

For each mutation this copies the package (`qwenfast/`), `tests/` and `pyproject.toml` to a fresh temporary
directory, applies one exact text replacement to one file (it fails loudly when the target text is not
there exactly once, so the script cannot rot silently into testing nothing), and runs the tests that
should catch it there: cwd and PYTHONPATH are the copy, and the child checks that `qwenfast` is imported
from the copy (qwenfast is installed editable from the checkout) before it starts pytest. A mutation is
"killed" when those tests fail, "survived" when they pass. Not collected by pytest (no test_ prefix).

Every mutation here survived the suite once; each is kept as a regression check of the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
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


def copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("qwenfast", "tests"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore, symlinks=True)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")


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


def run(m: Mutation, keep: bool, verbose: bool) -> tuple[str, float, str]:
    """('killed' | 'survived', seconds, the tail of pytest's output)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"qwenfast-mutation-{m.name}-"))
    try:
        copy_tree(tmp)
        m.apply(tmp)
        env = dict(os.environ, PYTHONPATH=str(tmp) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("CI", None)  # the CI skip guard is not what is audited here
        args = [*m.tests, "-q", "-x", "-p", "no:cacheprovider"] + (["-k", m.select] if m.select else [])
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp), *args], cwd=tmp, env=env,
                              capture_output=True, text=True)  # fmt: skip
        took = time.monotonic() - t0
        out = proc.stdout + proc.stderr
        if "not from the mutated copy" in out:
            raise SystemExit(out)
        if proc.returncode not in (0, 1):  # 2: interrupted, 3: internal error, 4: usage, 5: no tests collected
            raise SystemExit(f"mutation {m.name}: pytest exited with {proc.returncode}:\n{out[-3000:]}")
        if verbose:
            print(out)
        return ("survived" if proc.returncode == 0 else "killed"), took, out
    finally:
        if keep:
            print(f"  (kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--keep", action="store_true", help="keep each mutated copy")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not a.names or m.name in a.names]
    unknown = set(a.names) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutation(s) {sorted(unknown)}; --list shows them")
    if a.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.what}\n  {m.file}; caught by {' '.join(m.tests)}" + (f" -k {m.select!r}" if m.select else ""))
        return 0
    survived = []
    for m in chosen:
        verdict, took, out = run(m, a.keep, a.verbose)
        summary = next((ln for ln in reversed(out.splitlines()) if " in " in ln and ("passed" in ln or "failed" in ln)), "")
        print(f"{m.name:32} {verdict.upper():9} ({took:.0f} s; {summary.strip('= ')})")
        if verdict == "survived":
            survived.append(m.name)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations killed" +
          (f"; survived: {', '.join(survived)}" if survived else ""))  # fmt: skip
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
