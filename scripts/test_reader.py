"""Run every chapter as a reader would: a fresh environment with Colab's versions, the library installed from
a git URL of a clean clone (not editable), each notebook executed alone in an empty folder, no triton.

Usage: python scripts/test_reader.py [--keep]      (``make test-reader``)

Steps: (1) clone the repository's HEAD into .reader/src; (2) create .reader/venv (Python 3.11) and install
tests/reader-requirements.txt, then ``attention-core[book,pretrained] @ git+file://.../.reader/src``;
(3) for each book/*.ipynb, copy it alone into .reader/run/<name>/ and execute it with nbclient in that venv's
kernel. Prints one line per chapter and the lines where a chapter says what it skips; exits 1 if any chapter
failed. The environment is kept between runs (delete .reader/ to start over); --keep keeps executed copies.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".reader"
VENV = WORK / "venv"
PY = VENV / "bin" / "python"

RUNNER = r'''
import sys, time, json
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
path = sys.argv[1]
nb = nbformat.read(path, as_version=4)
for cell in nb.cells:  # start clean: after an error, later cells must not show the stored outputs
    if cell.cell_type == "code":
        cell.outputs, cell.execution_count = [], None
client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}})
start = time.perf_counter()
try:
    client.execute()
    status = "ok"
except CellExecutionError as err:
    status = "FAILED: " + str(err).strip().splitlines()[-1][:300]
skips = []
for cell in nb.cells:
    for out in cell.get("outputs", []):
        text = out.get("text", "") if out.get("output_type") == "stream" else ""
        skips += [line for line in text.splitlines() if line.lower().startswith(("skipped", "skipping"))]
nbformat.write(nb, path)
print(json.dumps({"status": status, "seconds": round(time.perf_counter() - start, 1), "skips": skips}))
'''


def run(cmd: list, **kwargs) -> None:
    subprocess.run(cmd, check=True, **kwargs)


def setup() -> None:
    if (WORK / "src").exists():
        shutil.rmtree(WORK / "src")
    run(["git", "clone", "--quiet", str(ROOT), str(WORK / "src")])
    if not PY.exists():
        run([sys.executable, "-m", "venv", str(VENV)])
    run([str(PY), "-m", "pip", "install", "-q", "--upgrade", "pip"])  # an old pip misreads `name[extra] @ git+file:`
    run([str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r",
         str(ROOT / "tests" / "reader-requirements.txt")])
    # Not editable, from a git URL, with its dependencies resolved, as the chapters' Colab cell installs it.
    run([str(PY), "-m", "pip", "uninstall", "-q", "-y", "attention-core"], stderr=subprocess.DEVNULL)
    run([str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"attention-core[book,pretrained] @ git+file://{WORK / 'src'}"])
    run([str(PY), "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"], stdout=subprocess.DEVNULL)
    missing = subprocess.run([str(PY), "-c", "import importlib.util as u; print(u.find_spec('triton') is None)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if missing != "True":
        raise SystemExit("the reader environment must not have triton")


def main(argv: list | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the executed copies in .reader/run")
    args = parser.parse_args(argv)
    setup()
    probe = ("import torch, numpy, matplotlib, ipywidgets, transformers, sentence_transformers as s; "
             "print(torch.__version__, numpy.__version__, matplotlib.__version__, ipywidgets.__version__, "
             "transformers.__version__, s.__version__)")
    versions = subprocess.run([str(PY), "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    print("reader environment: torch {} numpy {} matplotlib {} ipywidgets {} transformers {} "
          "sentence-transformers {}; no triton".format(*versions), flush=True)
    paths = args.notebooks or sorted((ROOT / "book").glob("*.ipynb"))
    failed = []
    for path in paths:
        folder = WORK / "run" / path.stem
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        copy = folder / path.name
        shutil.copy(path, copy)  # the notebook alone, as in Colab: no repository files beside it
        res = subprocess.run([str(PY), "-c", RUNNER, str(copy), str(folder)], capture_output=True, text=True,
                             cwd=folder, env={"PATH": f"{VENV / 'bin'}:/usr/bin:/bin", "HOME": str(WORK),
                                              "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
        line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
        try:
            report = json.loads(line)
        except ValueError:
            report = {"status": "FAILED: " + (res.stderr.strip().splitlines() or ["no output"])[-1], "seconds": 0,
                      "skips": []}
        print(f"{path.name:36s} {report['status']:6s} {report['seconds']:6.1f} s", flush=True)
        for skip in report["skips"]:
            print(f"    {skip}")
        if report["status"] != "ok":
            failed.append(path.name)
        if not args.keep:
            shutil.rmtree(folder)
    print(f"{len(paths) - len(failed)} of {len(paths)} chapters ran in the reader's environment"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
