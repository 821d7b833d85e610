#!/usr/bin/env bash
# Set up xpk (the GKE TPU workload launcher) in its own venv, .venv-xpk (or $XPK_VENV): its pins (google-cloud-*,
# kubernetes, packaging, ...) conflict with the project's lock, so it never goes into .venv. `dflash launch xpk`
# finds it there. xpk also needs gcloud, kubectl and docker on PATH for real launches (not for --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
source bin/_python.sh
XPK_VERSION=${XPK_VERSION:-1.16.0}
venv=${XPK_VENV:-.venv-xpk}
py=$(find_python)
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
echo '*' > "$venv/.gitignore"  # keep the venv out of git status
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "xpk==$XPK_VERSION"
"$venv/bin/xpk" version 2>/dev/null || true
echo "xpk $XPK_VERSION in $venv: dflash launch xpk uses $venv/bin/xpk" >&2
