#!/usr/bin/env bash
# A trial of Jupyter Book 2 (mystmd) on this book, in a scratch folder, with its own virtual environment.
# Not part of `make test`: it installs a second environment (about 2 minutes) and changes nothing in the
# repository. The findings it prints are written up in docs/jupyter-book-2.md.
#
#   scripts/try_jupyter_book2.sh [SCRATCH]        (default /tmp/ac-jb2-trial)
#
# What it does, in order:
#   1. a venv in SCRATCH/venv with jupyter-book 2.1.7 (it drives mystmd on /usr/bin/node, v18 or newer);
#   2. a copy of the book's sources in SCRATCH/src (book/, references.bib, _config.yml, _toc.yml, _static/);
#   3. `jupyter-book init`, answering yes to its offer to upgrade a Jupyter Book 1 project (it writes myst.yml
#      from _config.yml and _toc.yml and hides the old files) and no to starting a server;
#   4. `jupyter-book build --site --strict` (the content stage: parse, number, cite, cross-reference) and
#      `jupyter-book build --html` (the static site, which needs the book-theme template), each timed;
#   5. the same book built by Jupyter Book 1 from .venv (clean, strict, as `make book`), timed, into SCRATCH/jb1;
#   6. a summary: warnings by kind, what the content stage kept (citations, numbered equations, outputs by
#      type), and the weight of a chapter page in the JB1 site.
# Timings depend on the machine's load: the script prints the load average beside them.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRATCH="${1:-/tmp/ac-jb2-trial}"
JB2_VERSION="2.1.7"
mkdir -p "$SCRATCH"
SCRATCH="$(cd "$SCRATCH" && pwd)"
REPORT="$SCRATCH/report.txt"
: > "$REPORT"
say() { echo "$*" | tee -a "$REPORT"; }
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$2"; }

say "# Jupyter Book 2 trial, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, node $(node --version 2>/dev/null || echo missing)"

# 1. The JB2 environment.
if [ ! -x "$SCRATCH/venv/bin/jupyter-book" ]; then
  python3 -m venv "$SCRATCH/venv"
  "$SCRATCH/venv/bin/pip" install -q "jupyter-book==$JB2_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
fi
say "jupyter-book (JB2): $("$SCRATCH/venv/bin/jupyter-book" --version 2>&1 | tail -1)"

# 2. A copy of the sources (no build outputs, no vendored JavaScript: JB2 brings its own theme).
rm -rf "$SCRATCH/src" && mkdir -p "$SCRATCH/src/_static"
cp -r "$ROOT/book" "$ROOT/references.bib" "$ROOT/_config.yml" "$ROOT/_toc.yml" "$SCRATCH/src/"
cp "$ROOT/_static/ac.css" "$ROOT/_static/favicon.svg" "$SCRATCH/src/_static/"
cd "$SCRATCH/src" || exit 1

# 3. The upgrade JB2 offers for a JB1 project (two prompts: upgrade? yes; start a server? no).
(sleep 5; printf 'y\n'; sleep 10; printf 'n\n') | "$SCRATCH/venv/bin/jupyter-book" init > "$SCRATCH/init.log" 2>&1
if [ -f myst.yml ]; then say "upgrade: wrote myst.yml ($(wc -l < myst.yml) lines)"; else say "upgrade: no myst.yml (see init.log)"; fi

# 4. JB2 builds.
load() { cut -d' ' -f1-3 /proc/loadavg; }
for stage in site html; do
  rm -rf _build
  t0=$(now)
  "$SCRATCH/venv/bin/jupyter-book" build --"$stage" --strict < /dev/null > "$SCRATCH/jb2-$stage.log" 2>&1
  rc=$?
  say "JB2 build --$stage --strict: exit $rc in $(elapsed "$t0" "$(now)") s (load average $(load))"
  grep -m1 -E "failed, reason|ENOTFOUND" "$SCRATCH/jb2-$stage.log" | sed 's/^/    /' | tee -a "$REPORT"
done
rm -rf _build && "$SCRATCH/venv/bin/jupyter-book" build --site < /dev/null > "$SCRATCH/jb2-site.log" 2>&1
say "JB2 messages by kind (errors ⛔, warnings ⚠️), numbers and names masked:"
grep -E "⚠️|⛔" "$SCRATCH/jb2-site.log" | sed -E 's/^ *- //; s/"[^"]*"/"…"/g; s/:[0-9]+(:[0-9]+)?//g; s/[0-9]+_[a-z_]+\.ipynb/NN.ipynb/' \
  | sort | uniq -c | sort -rn | sed 's/^/    /' | tee -a "$REPORT"

# 6a. What the content stage kept (the JSON the template would render).
python3 - "$SCRATCH/src/_build/site/content" <<'EOF' | tee -a "$REPORT"
import collections, json, pathlib, sys
count = collections.Counter()
def walk(node):
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "cite":
            count["citations"] += 1
            count["citations with an error"] += bool(node.get("error"))
        if kind == "math" and node.get("label"):
            count["labelled equations"] += 1
            count["labelled equations numbered"] += bool(node.get("enumerator"))
        if kind == "output":
            for entry in node.get("jupyter_data", {}).get("data", {}) or {}:
                count[f"outputs carrying {entry}"] += 1
        if kind == "mystDirective":
            count[f"directives left unparsed: {node.get('name')}"] += 1
        for value in node.values():
            walk(value)
    elif isinstance(node, list):
        for value in node:
            walk(value)
folder = pathlib.Path(sys.argv[1])
for page in sorted(folder.glob("*.json")):
    walk(json.loads(page.read_text()))
print("JB2 content stage kept:")
for key, value in sorted(count.items()):
    print(f"    {key}: {value}")
EOF

# 5. The same book with Jupyter Book 1 (the project's .venv), clean and strict.
if [ -x "$ROOT/.venv/bin/jupyter-book" ]; then
  cd "$ROOT" || exit 1
  rm -rf "$SCRATCH/jb1"
  t0=$(now)
  .venv/bin/jupyter-book build . -W -n --keep-going --path-output "$SCRATCH/jb1" > "$SCRATCH/jb1.log" 2>&1
  rc=$?
  say "JB1 build -W -n --keep-going (clean): exit $rc in $(elapsed "$t0" "$(now)") s (load average $(load))"
  # 6b. Page weight: the chapter's HTML plus every local stylesheet, script and image it names (fonts and
  # MathJax's on-demand extensions left out), and the whole site folder.
  python3 - "$SCRATCH/jb1/_build/html" <<'EOF' | tee -a "$REPORT"
import pathlib, re, sys
site = pathlib.Path(sys.argv[1])
for name in ("book/01_kernel_regression.html", "book/quiz.html"):
    page = site / name
    html = page.read_text()
    total, seen = page.stat().st_size, set()
    for ref in re.findall(r'(?:href|src)="([^"#?]+)', html):
        path = (page.parent / ref).resolve()
        if path.suffix in (".css", ".js", ".png", ".svg", ".jpg") and path.is_file() and path not in seen:
            seen.add(path)
            total += path.stat().st_size
    print(f"JB1 page weight {name}: {total / 1e6:.2f} MB ({len(seen)} files besides the HTML)")
size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
print(f"JB1 site folder: {size / 1e6:.1f} MB in {sum(1 for p in site.rglob('*') if p.is_file())} files")
EOF
else
  say "JB1: .venv missing (run make venv) - not timed"
fi
say "report: $REPORT"
