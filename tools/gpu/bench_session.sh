# One device call for the served-model benchmark (issues 13/14): carry [".kernelpack", ".servepack"], then
#   bash tools/gpu/bench_session.sh [LAYERS] [MODES]      (default: 24 layers, "graph eager"; env ROUNDS, SETTINGS, LIMIT,
#   BENCH_ARGS: more serve_bench options, e.g. --aftermath, or --measure prefill: more rounds of that alone)
# Eager full capture writes GBs a round: for the eager table, SETTINGS=off,flight LIMIT=400 in a call of its own.
# At most four servers of the 24-layer model fit one 80 GB H100 (five: start-up KV-cache OOM, 2026-12-08).
# serve_bench: capture off / flight recorder armed / full capture, three servers on the one GPU, interleaved rounds.
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
LAYERS=${1:-24}; MODES=${2:-graph eager}; M=/tmp/serve/gpt-oss-${LAYERS}l
[ -f $M/config.json ] || step model 150 python3 tools/models/make_gpt_oss.py $M --layers $LAYERS
for mode in $MODES; do rm -rf /tmp/serve-bench-$mode
    step bench_$mode ${LIMIT:-280} python3 tools/bench/serve_bench.py --model $M --mode $mode --rounds ${ROUNDS:-5} --settings ${SETTINGS:-off,flight,full} --budget-s $(( ${LIMIT:-280} - 45 )) ${BENCH_ARGS:-} \
        --out /tmp/serve-bench-$mode --json "$OUT/bench-$mode.json"
    for s in $(echo "${SETTINGS:-off,flight,full}" | tr , ' '); do  # every server's log, a failed one's included
        tail -c 40000 /tmp/serve-bench-$mode/$s/server.log > "$OUT/bench-$mode-$s.log" 2>/dev/null; done
    rm -rf /tmp/serve-bench-$mode/full/captures
done
grep -E "^=== |serve_bench|^setting|^off |^flight|^full |^[~=>] " "$OUT/all.log" | cut -c1-400 | tail -40
