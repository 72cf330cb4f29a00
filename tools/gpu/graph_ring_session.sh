# One device call for the graph ring as of 2026-12-05 (one node a gpt-oss layer call, whole words; first run 2026-12-05,
# tenth session: ring-18-oss 8.22 µs, decode b1 1.080×): carry [".kernelpack", ".servepack"], then
#   bash tools/gpu/graph_ring_session.sh            (env ROUNDS, default 3; LIMIT for the serve bench, default 300)
# 1. graph_ring_bench: µs a node costs a layer call; `ring-18-oss` is what a served gpt-oss decode call keeps (18
#    spans, routing sizes that break words) — the served cost was ≈ 15 µs a layer call before the change;
# 2. the graph GPU tests (real fused_marlin_moe and gpt-oss graph replays trigger, expand bit-exactly);
# 3. serve_bench in CUDA-graph mode, off vs flight (issue 14's target: decode b1 ≤ 1.05×; 1.080× on 2026-12-05
#    before lone entries were staged off the graph's path — `ring-18-staged` in the bench);
# 4. graph_ring_ablation: where a node's time goes (its parts switched off by runtime flags, node floors).
# Logs to $OUT/all.log as it goes (the bench's own prelude appends to it too).
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
step ring_bench 90 python3 tools/bench/graph_ring_bench.py --rounds 5 --replays 200
step flight_graph_tests 240 python3 -m pytest tests/gpu/test_flight_graph_gpu.py -q -rfE
ROUNDS=${ROUNDS:-3} SETTINGS=off,flight LIMIT=${LIMIT:-300} bash tools/gpu/bench_session.sh 24 graph > /dev/null
step ring_ablation 90 python3 tools/bench/graph_ring_ablation.py --rounds 5 --replays 200
grep -E "^=== |graph_ring_bench|graph_ring_ablation|^bare|^ring-|^[a-z-]+ +[0-9.]+ µs|passed|failed|^setting|^off |^flight|flight_graph" "$OUT/all.log" \
    | cut -c1-400 | tail -60
