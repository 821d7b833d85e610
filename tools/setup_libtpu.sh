#!/usr/bin/env bash
# Fetch libtpu (the TPU compiler and runtime; the version jax[tpu] pins for the locked jax) into a cache directory,
# outside every venv, so that `dflash launch compile --backend tpu` can compile for TPU topologies on a machine
# without TPUs (docs/decisions.md D20). About 600 MB unpacked. Prints the path of libtpu.so.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${LIBTPU_VERSION:-0.0.50}
dest=${LIBTPU_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash/libtpu-$version}
venv_py=${DFLASH_VENV:-.venv}/bin/python
[ -x "$venv_py" ] || { source bin/_python.sh; venv_py=$(find_python); }
if [ ! -f "$dest/libtpu/libtpu.so" ]; then
  "$venv_py" -m pip install -q --no-deps --target "$dest" "libtpu==$version.*"
fi
echo "$dest/libtpu/libtpu.so"
