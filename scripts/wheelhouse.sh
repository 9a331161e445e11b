#!/usr/bin/env bash
# The offline bundle for a GPU server without internet (README: "On a GPU server without
# internet"): binary wheels of moment (built from this checkout) and of everything it needs at run
# time except torch, for one CPython and manylinux x86-64, plus kvikio for one CUDA major, and
# DIR/manifest.json (name, version, file, sha256, why of each). Run where pip reaches an index:
#   scripts/wheelhouse.sh DIR [--python X.Y] [--cuda 12|13] [--skip a,b] [--no-pulp] [--no-kvikio]
# --python: the server's Python (default: this one's); --cuda: the major of the server's torch
# (torch.version.cuda; default 13); --skip: packages the server has already (numpy,numba, ...);
# --no-pulp: without PuLP (only --milp-solver pulp-cbc needs it); --no-kvikio: without kvikio.
# Prints each wheel and the bundle's size. Copy DIR to the server and run
# scripts/gpu_check.sh --offline DIR there. DIR must be empty or hold an earlier bundle (replaced).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/wheelhouse.sh DIR [--python X.Y] [--cuda 12|13] [--skip a,b] [--no-pulp] [--no-kvikio]" >&2; exit 2; }
DIR=$(realpath -m "$1")
shift
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
TARGET=$("$PY" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --python) TARGET=$2; shift 2 ;;
        --cuda | --skip) ARGS+=("$1" "$2"); shift 2 ;;
        --no-pulp | --no-kvikio) ARGS+=("$1"); shift ;;
        *) echo "wheelhouse: unknown option $1" >&2; exit 2 ;;
    esac
done
if [ -e "$DIR/manifest.json" ]; then  # an earlier bundle: only the files its manifest lists go
    "$PY" -c 'import json, os, sys; d = sys.argv[1]
for p in json.load(open(os.path.join(d, "manifest.json")))["packages"]:
    f = os.path.join(d, p["file"])
    os.path.exists(f) and os.remove(f)
os.remove(os.path.join(d, "manifest.json"))' "$DIR"
fi
if [ -d "$DIR" ] && [ -n "$(ls -A "$DIR")" ]; then
    echo "wheelhouse: $DIR holds files that are not a bundle's: give an empty or new folder" >&2
    exit 1
fi
mkdir -p "$DIR"
BUILD=$(mktemp -d "${TMPDIR:-/tmp}/moment-wheel.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT
# moment's own wheel (pure Python: one for every target); pip builds it with setuptools from the index.
"$PY" -m pip --disable-pip-version-check wheel --quiet --no-deps -w "$BUILD" . >&2
"$PY" scripts/wheelhouse.py build "$DIR" --moment-wheel "$BUILD"/moment-*.whl --python "$TARGET" \
    --python-exe "$PY" "${ARGS[@]}"
