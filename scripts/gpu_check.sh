#!/usr/bin/env bash
# Validate moment's GPU path on a GPU server in one command, within about five minutes, and
# write OUT/report.md, OUT/report.json and OUT/steps.log (default OUT: ./gpu-check):
#   scripts/gpu_check.sh --offline DIR [OUT]              on the GPU server, no network
#   scripts/gpu_check.sh --offline DIR --self-test [OUT]  on any machine, CPU only (CI runs it)
#   scripts/gpu_check.sh [OUT]                            where $PYTHON already has moment's needs
# DIR is the bundle scripts/wheelhouse.sh wrote (README: "On a GPU server without internet").
# Python: $PYTHON, else python3, with its own torch (CUDA, at least moment's bound). Nothing is
# installed into that environment: the bundle's wheels that it cannot already import at a
# satisfying version go, with pip --no-index --no-deps --target, into a scratch folder put on
# PYTHONPATH beside this checkout. The steps and their time limits: scripts/gpu_check.py. Each
# step's exit status, time and figures go into the report as it ends; a killed check still
# leaves the report of the steps before. --self-test: builds DIR for this Python when DIR is
# missing or empty (from pip's cache or the index), makes a venv holding only torch (the CPU
# build, constraints-cpu.txt), and runs every step with the CPU device. The exit status is the
# number of steps that were not ok. Scratch data goes to $TMPDIR (the read-engine file to
# $BENCH_DIR: point it at an NVMe mount to measure it). $GPU_CHECK_SECONDS: the whole check's
# budget (default 300; 1800 for the self-test).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE="" SELF_TEST=0 OUT=gpu-check
while [ $# -gt 0 ]; do
    case $1 in
        --offline) BUNDLE=${2:?--offline needs the bundle folder}; shift 2 ;;
        --self-test) SELF_TEST=1; shift ;;
        -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
        -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) OUT=$1; shift ;;
    esac
done
if [ "$SELF_TEST" = 1 ] && [ -z "$BUNDLE" ]; then
    echo "gpu_check: --self-test needs --offline DIR (the bundle it builds and installs)" >&2
    exit 2
fi
PY=${PYTHON:-python3}
if ! PY=$(command -v "$PY"); then
    echo "gpu_check: no Python interpreter ${PYTHON:-python3}: set PYTHON to the one with the site's PyTorch" >&2
    exit 1
fi
if ! mkdir -p "$OUT" || ! OUT=$(cd "$OUT" && pwd) || ! [ -w "$OUT" ]; then
    echo "gpu_check: cannot write the report folder $OUT (give a writable OUT outside a read-only checkout)" >&2
    exit 1
fi
BUDGET=${GPU_CHECK_SECONDS:-$([ "$SELF_TEST" = 1 ] && echo 1800 || echo 300)}
DEADLINE=$(($(date +%s) + BUDGET))
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moment-gpu-check.XXXXXX") || exit 1
HELPER=$REPO/scripts/gpu_check.py
finish() {  # the report is always finished, and the scratch data (ours: WORK) removed
    trap - EXIT TERM INT HUP
    "$PY" "$HELPER" finish "$OUT" --seconds "$SECONDS" >/dev/null 2>&1 || {
        echo "# moment GPU check: the report could not be finished with $PY; see $OUT/steps.log" >>"$OUT/report.md"
    }
    cat "$OUT/report.md" 2>/dev/null
    local failed
    failed=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["failed"])' "$OUT/report.json" 2>/dev/null || echo 1)
    rm -rf "$WORK"
    exit "$failed"
}
trap finish EXIT
trap 'exit 1' TERM INT HUP

if [ "$SELF_TEST" = 1 ]; then
    if [ ! -d "$BUNDLE" ] || [ -z "$(ls -A "$BUNDLE" 2>/dev/null)" ]; then
        TARGET=$("$PY" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
        echo "gpu_check: building the bundle for Python $TARGET into $BUNDLE" >&2
        PYTHON= "$REPO/scripts/wheelhouse.sh" "$BUNDLE" --python "$TARGET" --cuda 13 >"$WORK/wheelhouse.log" 2>&1 || {
            tail -5 "$WORK/wheelhouse.log" >&2
            echo "gpu_check: the bundle could not be built (log above)" >&2
            exit 1
        }
    fi
    # A fresh venv with torch alone, as a site's PyTorch environment: the bundle must bring the rest.
    "$PY" -m venv "$WORK/venv" && "$WORK/venv/bin/python" -m pip install -q -c "$REPO/constraints-cpu.txt" torch \
        >"$WORK/venv.log" 2>&1 || {
        tail -5 "$WORK/venv.log" >&2
        echo "gpu_check: the self-test's venv with torch could not be made (log above)" >&2
        exit 1
    }
    PY=$WORK/venv/bin/python
fi
BUNDLE=${BUNDLE:+$(cd "$BUNDLE" && pwd)}
"$PY" "$HELPER" start "$OUT" $([ "$SELF_TEST" = 1 ] && echo --self-test) || exit 1
# torch: importable, not older than moment's bound, with CUDA (the self-test takes a CPU build).
if ! TORCH=$("$PY" "$REPO/scripts/wheelhouse.py" torch ${BUNDLE:+--dir "$BUNDLE"} \
    --bound "$(grep -oE '"torch[<>=~!][^"]*"' "$REPO/pyproject.toml" | head -1 | tr -d '"')" \
    $([ "$SELF_TEST" = 1 ] && echo --cpu) 2>"$WORK/torch.log"); then
    grep '^gpu_check' "$WORK/torch.log" >&2 || tail -3 "$WORK/torch.log" >&2
    "$PY" "$HELPER" record "$OUT" --name torch --exit 1 --seconds 0 --command "$PY: import torch" --log "$WORK/torch.log"
    exit 1
fi

SCRATCH=$WORK/site
mkdir -p "$SCRATCH"
if [ -n "$BUNDLE" ]; then
    start=$SECONDS
    {
        FILES=$("$PY" "$REPO/scripts/wheelhouse.py" select "$BUNDLE") && if [ -z "$FILES" ]; then
            echo "nothing to install: $PY has every package at a satisfying version"
        elif "$PY" -m pip --version >/dev/null 2>&1; then
            # shellcheck disable=SC2086 # one wheel path a line, none with spaces (wheel names)
            timeout -k 5 120 "$PY" -m pip --isolated --disable-pip-version-check install --quiet --no-index \
                --no-deps --no-compile --target "$SCRATCH" $FILES
        else  # no pip: a wheel is a zip of what goes into site-packages
            "$PY" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$SCRATCH" $FILES
        fi
    } >"$WORK/install.log" 2>&1
    rc=$?
    "$PY" "$HELPER" record "$OUT" --name install --exit "$rc" --seconds $((SECONDS - start)) \
        --command "pip install --no-index --no-deps --target SCRATCH (the wheels of $BUNDLE that $PY lacks)" \
        --log "$WORK/install.log"
    [ "$rc" = 0 ] || tail -n 3 "$WORK/install.log" >&2  # e.g. a package the bundle skipped and this Python lacks
fi
export PYTHONPATH=$SCRATCH:$REPO${PYTHONPATH:+:$PYTHONPATH}
# cuda.pathfinder (libkvikio's loader) looks for NVIDIA's wheel libraries (libcufile) in
# site-packages only, never in PYTHONPATH folders: the scratch folder's go on the loader's path.
for lib in "$SCRATCH"/nvidia/*/lib "$SCRATCH"/nvidia/*/lib64; do
    [ -d "$lib" ] && export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
cd "$REPO" || exit 1
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
"$PY" "$HELPER" machine "$OUT" --torch "$TORCH"
# In the background: a TERM to this script reaches the step runner at once (bash runs a trap
# only after its foreground child ends), which records the step it kills.
"$PY" "$HELPER" run "$OUT" --work "$WORK" --ngpu "$NGPU" --deadline "$DEADLINE" ${BENCH_DIR:+--bench-dir "$BENCH_DIR"} \
    $([ "$SELF_TEST" = 1 ] && echo "--self-test --scale 4") &
RUNNER=$!
trap 'kill -TERM "$RUNNER" 2>/dev/null; wait "$RUNNER"; exit 1' TERM INT HUP
wait "$RUNNER"
