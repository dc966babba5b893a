#!/usr/bin/env bash
# Build the pinned llama.cpp (llama-server, llama-quantize and its GGUF converter) once into the eaglekit
# cache and print the folder; later runs find the stamp and return at once (a different CPU rebuilds: the
# build is native). Only the package registry is needed: the source is the llama-cpp-python sdist's
# vendor/llama.cpp. Needs cmake and a C++ compiler (ninja if present). ~4-6 minutes on 2 cores.
#   bash scripts/llama_cpp.sh            # -> ~/.cache/eaglekit/llama.cpp-0.3.36
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m eaglekit.engines.llama_cpp
