#!/usr/bin/env bash
# Brings a Debian 12 machine (no GPU needed) to a working dflash build. Idempotent: every step
# checks first and says what it does; a second run only rebuilds what changed.
#
#   tools/setup.sh            system packages, .venv (torch 2.11.0, transformers, ...), build/
#
# Settings (environment):
#   DFLASH_BUILD_DIR   build directory (default: build)
#   DFLASH_NO_APT=1    never call apt-get (fail if something is missing)
#   DFLASH_VENV        virtual environment (default: .venv); DFLASH_PYTHON: a python whose
#                      torch to use instead (GPU machines: the system torch), skips the venv
#   DFLASH_CMAKE_ARGS  extra arguments for cmake (e.g. -DDFLASH_WITH_CUDA=OFF)
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[setup] $*" >&2; }

TORCH_VERSION=2.11.0
APT_PACKAGES=(build-essential cmake ninja-build git python3 python3-venv python3-dev
  openmpi-bin libopenmpi-dev libyaml-cpp-dev libfmt-dev libgtest-dev googletest
  slurmctld slurmd slurm-client munge libpmix-dev shellcheck iproute2
  wamerican)  # /usr/share/dict/words: topic prompts (tools/make_prompts.py)
PIP_PACKAGES=("torch==${TORCH_VERSION}" "transformers>=4.56" safetensors tokenizers numpy pytest jinja2
  tensorboard matplotlib tqdm
  gguf accelerate)  # gguf, accelerate: transformers' GGUF loader (tools/get_smollm2.py)

# ---- system packages ------------------------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${DFLASH_NO_APT:-0}" = 1 ]; then say "missing packages: ${missing[*]} (DFLASH_NO_APT=1)"; exit 1; fi
  say "installing system packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "system packages: present"
fi

# ---- Python environment (LibTorch comes from the torch wheel) -------------------------------
if [ -n "${DFLASH_PYTHON:-}" ]; then
  PY=$DFLASH_PYTHON
  say "using $PY (DFLASH_PYTHON); no virtual environment"
else
  VENV=${DFLASH_VENV:-.venv}
  PY=$VENV/bin/python
  # the stamp is keyed on the package list: adding a package re-runs pip (which installs only
  # what is missing) on an existing venv
  stamp=$VENV/.dflash-setup-$(printf '%s\n' "${PIP_PACKAGES[@]}" | cksum | cut -d' ' -f1)
  if [ ! -x "$PY" ]; then
    say "creating virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
  if [ ! -e "$stamp" ]; then
    say "installing into $VENV: ${PIP_PACKAGES[*]} (torch is a large download the first time)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "${PIP_PACKAGES[@]}"
    "$PY" -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"
    touch "$stamp"
  else
    say "virtual environment $VENV: present (torch ${TORCH_VERSION}, ${#PIP_PACKAGES[@]} packages)"
  fi
fi

# ---- configure and build ----------------------------------------------------------------------
BUILD=${DFLASH_BUILD_DIR:-build}
# absolute, but not through symlinks: a venv's python is a link to the base interpreter
PY_ABS=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
if [ ! -f "$BUILD/build.ninja" ]; then
  say "configuring $BUILD"
  # shellcheck disable=SC2086
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDFLASH_PYTHON="$PY_ABS" \
    ${DFLASH_CMAKE_ARGS:-} >/dev/null
fi
say "building $BUILD (ninja, $(nproc) cores)"
cmake --build "$BUILD" -j "$(nproc)" ${DFLASH_BUILD_TARGETS:+--target $DFLASH_BUILD_TARGETS}
say "done"
