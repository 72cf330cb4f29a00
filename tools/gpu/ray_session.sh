# The Ray half of the multi-GPU issue on nvidia-h200-x2 (or larger), build .raypack with tools/gpu/make_raypack.sh:
#   UNPACK_ONLY=1 bash tools/gpu/ray_session.sh     # carry [".raypack"]
#   bash tools/gpu/ray_session.sh                   # at once after it, on the warm machine: carry [".kernelpack"]
# Unpacks Ray (dependencies the interpreter already has are left out), runs tests/gpu/test_ray_gpu.py (a sweep on
# Ray gives the serial run's verdicts; units spread over the GPUs in reused workers; a genuine illegal memory
# access costs its variant only) and tools/bench/ray_sweep_bench.py (1,000 variants on 1 vs 2 GPUs) over a served
# capture when tools/gpu/multi_gpu_session.sh left one on this machine (/tmp/multi/served.zst), else a synthetic
# Marlin capture. Logged to $OUT/all.log.
R=/tmp/moereplay-ray
if [ ! -f $R/.complete ]; then  # unpacked whole (a call cut mid-way unpacks again)
    rm -rf $R $R.tmp && mkdir -p $R.tmp && tar xJf .raypack/site.tar.xz -C $R.tmp
    for entry in $R.tmp/*; do  # keep Ray, and only the dependencies this interpreter lacks
        name=$(basename "$entry"); module=${name%.py}
        case $name in ray|ray-*.dist-info|*.libs) continue ;; *.dist-info) rm -rf "$entry"; continue ;;
            google) module=google.protobuf ;; esac
        python3 -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$module') else 1)" \
            2>/dev/null && rm -rf "$entry"
    done
    mv $R.tmp $R && touch $R/.complete
fi
# UNPACK_ONLY=1 carry [".raypack"] only: the kernel pack, Ray and the working tree together pass a call's 64 MiB,
# so unpack Ray in one call and run the rest in the next on the warm machine (carry [".kernelpack"])
if [ -n "$UNPACK_ONLY" ]; then ls $R > "$OUT/ray-site.txt"; exit 0; fi
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
export PYTHONPATH="$PYTHONPATH:$R"
step ray_import 60 python3 -c "import ray, torch; print('ray', ray.__version__, 'gpus', torch.cuda.device_count())"
step ray_gpu 300 python3 -m pytest tests/gpu/test_ray_gpu.py -q -rA -s
step ranks_gpu 60 python3 -m pytest tests/gpu/test_ranks_gpu.py -q -rA
CAPTURE=(); [ -f /tmp/multi/served.zst ] && CAPTURE=(--capture /tmp/multi/served.zst)
step ray_bench ${BENCH_LIMIT:-200} python3 tools/bench/ray_sweep_bench.py "${CAPTURE[@]}" --backend pack:$MOEREPLAY_PACK \
    --workers ${WORKERS:-1,2} --variants ${VARIANTS:-1000}
grep -E "^=== |^(PASSED|FAILED|ERROR)|passed|failed|variants/s|efficiency|workers|^ *[0-9]+ " "$OUT/all.log" | cut -c1-250 | tail -40
