# One device call for the served flight-recorder proof (issues 13/14): carry [".kernelpack", ".servepack"], then
#   bash tools/gpu/flight_session.sh
# A poisoned 2-layer gpt-oss (expert 5 of layer 0 decodes to non-finite, reached only by the word "zebra") is
# served in vLLM's default CUDA-graph mode with the flight recorder armed; after a normal mixed workload, two
# requests are biased to emit "zebra" first, so the fault first appears at a decode step replayed from a graph.
# Then: the flight file's info/ls, `moereplay expand` (the real vLLM layer function re-run under capture) and
# `moereplay run` on the regenerated kernel calls of the bad one.
# Everything is logged to $OUT/all.log; summaries, the flight file and the expanded one (when small) and server log
# tails come back. MODEL_ARGS: more make_gpt_oss.py options (a small model for a bundled capture, e.g. "--hidden 256
# --intermediate 256 --experts 8 --top-k 2 --heads 4 --kv-heads 2"). FLIGHT_ENV: MOEREPLAY_* settings for the server,
# space-separated KEY=VALUE (the harness passes none of this shell's own). FAULT_AT=prefill: the word in the middle of
# two 160-word prompts instead, so the first bad call is an eager prefill (with
# FLIGHT_ENV="MOEREPLAY_FLIGHT_LEAN_BYTES=64K"
# a lean call: its bytes kept only because its check failed).
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
W=/tmp/serve; mkdir -p $W
step models 60 python3 tools/models/make_gpt_oss.py $W/gpt-oss-bad --layers 2 --poison 0:5 $MODEL_ARGS
ENVS=""; for kv in $FLIGHT_ENV; do ENVS="$ENVS --env $kv"; done  # e.g. FLIGHT_ENV="MOEREPLAY_FLIGHT_GRAPH_BATCH=0" (a record node per layer call)
step graph_flight 200 python3 tools/gpu/serve_gpu.py --model $W/gpt-oss-bad --mode graph --capture flight \
    --out $W/graph --requests 8 --fault-word zebra --fault-at ${FAULT_AT:-decode} $ENVS
G=$(ls -S $W/graph/captures/*.zst 2>/dev/null | head -1)
if [ -n "$G" ]; then
    step flight_info 30 python3 -m moereplay info "$G"
    step flight_ls 30 python3 -m moereplay ls "$G"
    # the layer calls of the first trigger: its history and the bad call (`ls --json`: flight.trigger)
    CALLS=$(python3 -m moereplay ls "$G" --json | python3 -c '
import json, sys
rows = json.load(sys.stdin)
first = next((i for i, r in enumerate(rows) if r["context"].get("flight", {}).get("trigger")), len(rows) - 1)
print(" ".join("--call " + str(r["index"]) for r in rows[: first + 1]))')
    step expand 120 python3 -m moereplay expand "$G" -o $W/expanded.zst $CALLS --backend pack:$MOEREPLAY_PACK \
        --json-out $W/expand.json
    KCALLS=$(python3 -c '
import json
calls = json.load(open("/tmp/serve/expand.json"))["calls"]
print(" ".join("--call " + str(k) for k in calls[-1]["kernel_calls"]))')
    step run 90 bash -c "python3 -m moereplay run $W/expanded.zst $KCALLS --backend pack:$MOEREPLAY_PACK \
        --json-out $W/run.json"
    # every regenerated kernel call: a padded batch's calls say which rows were padding and leave them unjudged
    step run_all 200 bash -c "python3 -m moereplay run $W/expanded.zst --all --backend pack:$MOEREPLAY_PACK \
        --json-out $W/run_all.json > $W/run_all.txt 2>&1"
    python3 - $W/run_all.json >> "$OUT/all.log" 2>&1 <<'PY'
import json, sys
reports = json.load(open(sys.argv[1]))["reports"]
for rep in reports:
    base = next((r for r in rep["results"] if r["label"] == "baseline"), None)
    padding = [n for n in rep.get("notes", []) if "padding" in n]
    if base is not None:
        print(f"run_all call {rep['call']} {rep['op']}: {base['verdict']} bit_exact={base['bit_exact']} "
              f"rows={base['rows']} nan={base['nan']} inf={base['inf']} " + (padding[0] if padding else "(no padding)"))
print(f"run_all: {len(reports)} calls, {sum(1 for r in reports if any('padding' in n for n in r.get('notes', [])))} "
      "with a padding note")
PY
    [ $(stat -c %s "$G") -lt 16000000 ] && cp "$G" "$OUT/graph-flight.zst"
    [ -f $W/expanded.zst ] && [ $(stat -c %s $W/expanded.zst) -lt 16000000 ] && cp $W/expanded.zst "$OUT/expanded.zst"
fi
for d in graph limits; do cp $W/$d/summary.json "$OUT/$d-summary.json" 2>/dev/null
    tail -c 150000 $W/$d/server.log > "$OUT/$d-server.log" 2>/dev/null; done
cp $W/expand.json $W/run.json $W/run_all.txt "$OUT/" 2>/dev/null
grep -E "^=== |serve_gpu|fault request|layers:|counters|plugin:|expand|bit-exact|verdict|run_all" "$OUT/all.log" | cut -c1-400 | tail -80
