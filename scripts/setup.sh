#!/usr/bin/env bash
# Installs what is missing of hyperparallel's build and run dependencies (DESIGN section 2).
# A no-op when everything is present; runs `apt-get update` once, only when something is missing.
set -euo pipefail

PACKAGES=(
  g++ cmake ninja-build ccache pkg-config
  libtorch-dev          # LibTorch (tensors, autograd, nn, c10d)
  libgloo-dev           # headers ProcessGroupGloo needs
  libopenblas0-pthread  # fast BLAS: without it matmul runs ~30x slower
  libgtest-dev libgmock-dev
  libcli11-dev nlohmann-json3-dev
  iproute2              # ip netns / tc for the project's own link emulation
  python3-torch         # tests cross-check hp-cp-run against PyTorch (torch.save/torch.load)
  python3-dev pybind11-dev  # the hyperparallel Python extension (build/python)
  python3-pytest        # its tests, run through ctest
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all dependencies present"
  exit 0
fi

echo "setup: missing packages: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=sudo
  else
    echo "setup: not root and no password-less sudo; install them with:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
else
  SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "setup: installed ${missing[*]}"
