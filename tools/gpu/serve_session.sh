# One device call for the served-model proof (issues 13/14): carry [".kernelpack", ".servepack"], then
#   bash tools/gpu/serve_session.sh
# Everything is logged to $OUT/all.log; summaries, the eager capture (when small) and server log tails come back.
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
W=/tmp/serve; mkdir -p $W
step glibc 5 ldd --version
step models 60 bash -c "python3 tools/models/make_gpt_oss.py $W/gpt-oss-2l --layers 2 && python3 tools/models/make_gpt_oss.py $W/gpt-oss-bad --layers 2 --poison 0:5"
step eager 170 python3 tools/gpu/serve_gpu.py --model $W/gpt-oss-2l --mode eager --out $W/eager --env MOEREPLAY_PER_SHAPE=2
F=$(ls -S $W/eager/captures/*.zst 2>/dev/null | head -1)
step info 30 python3 -m moereplay info "$F"
step ls 30 bash -c "python3 -m moereplay ls '$F' | head -40"
step replay 90 python3 -m moereplay run "$F" --op matmul_ogs --backend pack:$MOEREPLAY_PACK --json-out $W/run.json
fidelity $W/run.json "matmul_ogs calls"
step graph_flight 150 python3 tools/gpu/serve_gpu.py --model $W/gpt-oss-bad --mode graph --capture flight --out $W/graph --prompt "the zebra runs" --requests 8
for d in eager graph; do cp $W/$d/summary.json "$OUT/$d-summary.json" 2>/dev/null; tail -c 200000 $W/$d/server.log > "$OUT/$d-server.log" 2>/dev/null; done
[ -n "$F" ] && [ $(stat -c %s "$F") -lt 16000000 ] && cp "$F" "$OUT/eager-capture.zst"
G=$(ls -S $W/graph/captures/*.zst 2>/dev/null | head -1); [ -n "$G" ] && python3 -m moereplay ls "$G" 2>&1 | head -30 >> "$OUT/all.log"
tail -c 12000 "$OUT/all.log" | grep -E "^=== |fidelity|serve_gpu|layers:|counters|plugin:|log:" | tail -60
