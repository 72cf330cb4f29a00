# Step runner for batched GPU runs (source after tools/gpu/device_setup.sh):
#
#   source tools/gpu/device_setup.sh > $OUT/all.log 2>&1; source tools/gpu/steps.sh
#   step capture 200 python3 -m pytest tests/gpu/test_capture_plugin.py -q -s -rA
#
# Each step appends its command, output, exit status and seconds to $OUT/all.log (one file comes back even when
# the call is cut at its time limit) and one summary line to stdout; `timeout` bounds it so one hung step cannot
# eat the rest of the call.
step() {
    local name="$1" limit="$2" started status
    shift 2
    echo "=== $name: $*" >> "$OUT/all.log"
    started=$(date +%s)
    timeout "$limit" "$@" >> "$OUT/all.log" 2>&1
    status=$?
    echo "=== $name rc=$status $(( $(date +%s) - started ))s" | tee -a "$OUT/all.log"
}

# fidelity RUN_JSON [WHAT]: one line into $OUT/all.log from a `moereplay run --json-out` file — how many of its
# calls' baselines replayed bit-exactly, and their verdicts ("served-capture fidelity: 47/47 calls bit-exact; …").
fidelity() {
python3 - "$1" "${2:-calls}" >> "$OUT/all.log" 2>&1 <<'PY'
import json, sys
reports = json.load(open(sys.argv[1]))["reports"]
base = [next(r for r in rep["results"] if r["label"] == "baseline") for rep in reports]
print(f"served-capture fidelity: {sum(1 for b in base if b['bit_exact'])}/{len(base)} {sys.argv[2]} bit-exact; "
      f"verdicts {sorted({b['verdict'] for b in base})}")
PY
}
