# Sourced by bin/ scripts: find a Python >= 3.12 (DFLASH_PYTHON wins; 3.12 preferred, pyenv installs too).
_py_ok() { command -v "$1" >/dev/null 2>&1 && "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
_pyenv_python() {  # newest pyenv-installed CPython matching minor version $1
  command -v pyenv >/dev/null 2>&1 || return 1
  local v
  for v in $(pyenv versions --bare 2>/dev/null | grep -E "^3\.$1(\.[0-9]+)?$" | sort -V -r); do
    if [ -x "$(pyenv root)/versions/$v/bin/python3" ]; then echo "$(pyenv root)/versions/$v/bin/python3"; return 0; fi
  done
  return 1
}
find_python() {
  local c minor
  if [ -n "${DFLASH_PYTHON:-}" ] && _py_ok "$DFLASH_PYTHON"; then command -v "$DFLASH_PYTHON"; return 0; fi
  for minor in 12 13 14; do
    if _py_ok "python3.$minor"; then command -v "python3.$minor"; return 0; fi
    if c=$(_pyenv_python "$minor"); then echo "$c"; return 0; fi
  done
  if _py_ok python3; then command -v python3; return 0; fi
  echo "no Python >= 3.12 found: install python3.12 or set DFLASH_PYTHON=/path/to/python3.12" >&2
  return 1
}
