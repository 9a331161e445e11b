#!/usr/bin/env bash
# Validate moment's GPU path on a GPU server, in one command; writes OUT/report.md (default
# ./gpu-check/report.md) and the logs beside it:
#   1. the GPU tests (pytest -m gpu: CUDA feature store with posix and kvikio, a one-GPU run,
#      two nccl ranks where there are two GPUs, UVA sampling from registered host memory against
#      GPU-resident sampling: tests/test_uva.py);
#   2. `moment demo` on demo-sized data, one epoch, one rank on every GPU of the machine;
#   3. one epoch of the demo's data with the graph in registered host memory (--sampling uva),
#      and one with CPU-cache rows staged on the host (--host-gather stage), one rank on every
#      GPU, against the demo's own run (graph on the GPU, CPU-cache rows gathered by the GPU);
#   4. scripts/bench_features.py --device cuda on the demo's placed data, with --io posix and
#      --io kvikio (kvikio: pip install -e '.[gpu]');
#   5. scripts/bench_readers.py --direct: the file reader's engines (io_uring, pread, python) and
#      a C pthread loop, random 4 KiB O_DIRECT reads of a 4 GiB scratch file made in $BENCH_DIR
#      (default OUT: point it at a folder on the NVMe SSDs to measure them).
# Each step's exit status goes in the report; the script's exit status is the number of steps
# that failed. Run from the repository root:  scripts/gpu_check.sh [OUT]
# Python: $PYTHON, else the .venv that `make test` / `make demo` create, else python on PATH.
set -uo pipefail

OUT=${1:-gpu-check}
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPORT=$OUT/report.md
failed=0

if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: no CUDA GPU visible to $PY (nvidia-smi and torch.cuda.is_available()): nothing to check" >&2
    exit 1
fi
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

step() {  # step NAME LOG COMMAND...: run, record the exit status
    local name=$1 log=$2
    shift 2
    local start=$SECONDS
    "$@" >"$log" 2>&1
    local rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    echo "| $name | $rc | $((SECONDS - start)) s | $(basename "$log") |" >>"$OUT/steps.md"
    return 0
}

{
    echo "# moment GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "## Machine"
    echo
    echo '```'
    nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id,driver_version --format=csv
    "$PY" - <<'EOF'
import importlib.util, platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA (torch) {torch.version.cuda}, "
      f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
if importlib.util.find_spec("kvikio"):
    import kvikio, kvikio.defaults as d
    print(f"kvikio {kvikio.__version__}: compat mode preferred {d.is_compat_mode_preferred()}, "
          f"gds_threshold {d.get('gds_threshold')}, num_threads {d.get('num_threads')}")
else:
    print("kvikio: not installed (pip install -e '.[gpu]')")
EOF
    echo '```'
} >"$REPORT"
echo "| step | exit | time | log |" >"$OUT/steps.md"
echo "|---|---|---|---|" >>"$OUT/steps.md"

# -m gpu replaces pyproject's "-m 'not slow'": every gpu test runs, slow or not; -rs lists the skipped ones and why
step "pytest -m gpu" "$OUT/pytest-gpu.log" "$PY" -m pytest -p no:cacheprovider -q -rs -m gpu tests
step "moment demo, 1 epoch on $NGPU GPU(s)" "$OUT/demo.log" \
    "$PY" -m moment demo --workdir "$OUT/demo" --epochs 1 --nproc "$NGPU"
step "moment train --sampling uva, 1 epoch on $NGPU GPU(s)" "$OUT/train-uva.log" \
    "$PY" -m moment train --plan "$OUT/demo/plan.json" --data "$OUT/demo/placed" --epochs 1 --nproc "$NGPU" \
    --metrics-json "$OUT/train-uva.json" -- --hidden 128 --sampling uva
step "moment train --host-gather stage, 1 epoch on $NGPU GPU(s)" "$OUT/train-stage.log" \
    "$PY" -m moment train --plan "$OUT/demo/plan.json" --data "$OUT/demo/placed" --epochs 1 --nproc "$NGPU" \
    --metrics-json "$OUT/train-stage.json" -- --hidden 128 --host-gather stage
for io in posix kvikio; do
    step "bench_features --device cuda --io $io" "$OUT/bench-$io.log" \
        "$PY" scripts/bench_features.py "$OUT/demo/placed" --device cuda --io "$io" --rounds 3 \
        --json "$OUT/bench-$io.json"
done

step "bench_readers --direct in ${BENCH_DIR:-$OUT}" "$OUT/bench-readers.log" \
    "$PY" scripts/bench_readers.py --dir "${BENCH_DIR:-$OUT}" --direct --size-mb 4096 --reads 200000 \
    --threads 1,16,64 --rounds 2

{
    echo
    echo "## Steps ($failed failed)"
    echo
    cat "$OUT/steps.md"
    echo
    echo "## Figures"
    echo
    "$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
m = out / "demo" / "metrics.json"
if m.exists():
    doc = json.loads(m.read_text())
    e = doc["epochs"][-1] if doc["epochs"] else {}
    print(f"- training: {doc['world_size']} rank(s) ({'; '.join(doc['ranks'])}): {e.get('seeds_per_s', 0):,.0f} seeds/s, "
          f"{e.get('epoch_s', 0):.2f} s/epoch, measured {doc['measured_iteration_s']} s/iteration vs predicted "
          f"{doc['predicted_iteration_s']} s, test accuracy {doc['test_acc']}")
    print(f"  prediction note: {doc['prediction'].get('note')}")
else:
    print("- training: no metrics.json (see demo.log)")
runs = (("demo", out / "demo" / "metrics.json"), ("--sampling uva", out / "train-uva.json"),
        ("--host-gather stage", out / "train-stage.json"))
for name, f in runs:
    if f.exists():
        doc = json.loads(f.read_text())
        e = doc["epochs"][-1] if doc["epochs"] else {}
        print(f"- {name}: sampling {doc.get('sampling')}, {e.get('seeds_per_s', 0):,.0f} seeds/s, "
              f"data wait {e.get('data_wait_s')} s; {'; '.join(doc['ranks'])}")
for io in ("posix", "kvikio"):
    f = out / f"bench-{io}.json"
    if f.exists():
        b = json.loads(f.read_text())
        print(f"- bench_features --io {io}: store {b['store_gbps']:.3f} GB/s vs raw {b['raw_gbps']:.3f} GB/s "
              f"(ratio {b['ratio']:.2f}), {b['reader']} (engine {b.get('engine')}), modes {b['modes']}, "
              f"config {b['config']}, routes {b['routes']}")
    else:
        print(f"- bench_features --io {io}: no figures (see bench-{io}.log)")
log = out / "bench-readers.log"
lines = log.read_text().splitlines() if log.exists() else []
head = next((i for i, line in enumerate(lines) if line.startswith("threads")), None)
table = [] if head is None else lines[max(head - 1, 0) : head + 4]  # what was read, the header, 3 rows
print("- bench_readers (M reads/s):" + "".join(f"\n      {line}" for line in table) if table else "- bench_readers: no figures")
EOF
} >>"$REPORT"
rm -f "$OUT/steps.md"
cat "$REPORT"
exit "$failed"
