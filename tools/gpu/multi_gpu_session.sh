# Device calls for the multi-GPU issue on nvidia-h200-x2 (or larger): carry [".kernelpack", ".servepack"], then
#   PARTS="tp ep" bash tools/gpu/multi_gpu_session.sh   # default "tp ep graph": more than one call's 600 s
# tp: -tp 2 eager; ep: -tp 2 --enable-expert-parallel eager; graph: -tp 2 in vLLM's default CUDA-graph mode.
# The 2-layer Qwen3-MoE GPTQ int4 checkpoint (fused_marlin_moe → moe_wna16_marlin_gemm on every rank), full capture
# with two calls per shape. Per run: the server's summary (one file per rank, ranks and parallel sizes in context),
# `moereplay ranks ls` / `ranks check` on the two workers' files (each layer call recombined across ranks against
# the single-GPU reference) and the replay fidelity of rank 1's kernel calls on one GPU. Logged to $OUT/all.log.
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
W=/tmp/multi; mkdir -p $W
ranks() {  # $1: run directory name
    local d=$W/$1 files
    files=$(ls -S $d/captures/rank*.zst 2>/dev/null | head -2 | sort)
    [ -z "$files" ] && return
    step ${1}_info 40 bash -c "for f in $(echo $files); do python3 -m moereplay info \$f | head -30; done"
    step ${1}_ranks_ls 40 bash -c "python3 -m moereplay ranks ls $(echo $files) | head -30"
    step ${1}_ranks_check 240 python3 -m moereplay ranks check $(echo $files)
    local last=$(echo $files | tr ' ' '\n' | tail -1)
    [ -n "$SKIP_REPLAY" ] || step ${1}_replay 150 python3 -m moereplay run "$last" --op moe_wna16_marlin_gemm --backend pack:$MOEREPLAY_PACK \
        --json-out $W/run-$1.json
    [ -n "$SKIP_REPLAY" ] || fidelity $W/run-$1.json "calls of one rank replayed on one GPU,"
    if [ ! -f $W/served.zst ]; then  # a few served kernel calls of one rank, for tools/gpu/ray_session.sh
        local keep=$(python3 -c "
import sys
from moereplay.format import CaptureReader
with CaptureReader(sys.argv[1]) as r:
    calls = [c.index for c in r.calls() if c.op == 'moe_wna16_marlin_gemm' and c.status == 'completed'
             and (c.context or {}).get('step', 0) > 0]
print(','.join(str(i) for i in calls[:8]))" "$last")
        [ -n "$keep" ] && step ${1}_trim 60 python3 -m moereplay trim "$last" --calls "$keep" -o $W/served.zst
        [ -f $W/served.zst ] && cp $W/served.zst "$OUT/$1-served-trimmed.zst"
    fi
    for f in $files; do [ $(stat -c %s "$f") -lt ${COPY_MAX:-12000000} ] && cp "$f" "$OUT/$1-$(basename $f)"; done
    cp $d/summary.json "$OUT/$1-summary.json" 2>/dev/null; tail -c 60000 $d/server.log > "$OUT/$1-server.log"
}
step gpus 10 nvidia-smi --query-gpu=index,name,memory.used --format=csv
# SMALL=1: a small Qwen3-MoE GPTQ (hidden 512, intermediate 256, 8 experts, top-2) whose rank files come back whole
if [ -n "$SMALL" ]; then MODEL=$W/qwen-gptq-small; MODEL_ARGS="--hidden 512 --intermediate 256 --experts 8 --top-k 2 --heads 8 --kv-heads 2 --head-dim 64"
    EXTRA="--env MOEREPLAY_STEPS=1-"; : ${COPY_MAX:=60000000}  # no warm-up (dummy) calls of 8,192 tokens
else MODEL=$W/qwen-gptq; MODEL_ARGS=""; EXTRA=""; fi
[ -d $MODEL ] || step model 90 python3 tools/models/make_moe_gptq.py $MODEL --layers 2 $MODEL_ARGS
rm -f $W/served.zst  # the trimmed capture is this call's
for part in ${PARTS:-tp ep graph}; do
    rm -rf $W/$part  # serve_gpu.py does not clear its --out: an earlier run's files would mix in
    case $part in
        tp) step tp 260 python3 tools/gpu/serve_gpu.py --model $MODEL --mode eager --out $W/tp \
                --env MOEREPLAY_PER_SHAPE=2 $EXTRA --serve-arg=--tensor-parallel-size=2 ;;
        ep) step ep 260 python3 tools/gpu/serve_gpu.py --model $MODEL --mode eager --out $W/ep \
                --env MOEREPLAY_PER_SHAPE=2 $EXTRA --serve-arg=--tensor-parallel-size=2 --serve-arg=--enable-expert-parallel ;;
        graph) step graph 260 python3 tools/gpu/serve_gpu.py --model $MODEL --mode graph --out $W/graph \
                --env MOEREPLAY_PER_SHAPE=2 $EXTRA --serve-arg=--tensor-parallel-size=2 ;;
    esac
    ranks $part
done
grep -E "^=== |fidelity|one-GPU|serve_gpu|layers:|ranks|parallel|tp_size|ep_size|verdict|MoE|Marlin" "$OUT/all.log" \
    | cut -c1-300 | tail -70
