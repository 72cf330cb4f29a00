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
