#!/usr/bin/env bash
# One GPU session's phases, run on the GPU machine from the repository root, one `device run` call each:
#
#   bash bench/gpu_session.sh install1            (carry .gpu1)   } MLX's CUDA build in three parts
#   bash bench/gpu_session.sh install2            (carry .gpu2)   } (shared/gpu/README.md, prepare.sh)
#   bash bench/gpu_session.sh install3 q9 PHASE.. (carry .gpu3 [.gpu5]) }
#   bash bench/gpu_session.sh grpc PHASE...       (carry .gpu4: grpcio, for exo serve)
#   bash bench/gpu_session.sh PHASE...            (later calls while the machine stays warm)
#   (prefill9, prefill35, agent9, phases9, identity49: issue 49's prefill and prefix-cache figures, and greedy
#   plain decoding against stock mlx-lm on the demos with the chunked prefill; EXO_GDN_PREFILL=loop: without;
#   cached9: a cached agent turn's parts against the cold cost of its new tokens, turn 1 on vs off)
#   (gdnstep: a decode step and verify calls with exo's GatedDeltaNet step kernel against the row graph; roundsk /
#   stockk: round_phases at acceptance 0.8 and plain vs stock with the kernel forced on (EXO_GDN_KERNEL=force);
#   attnstep / roundsa / stocka: exo's decode-attention kernel (EXO_ATTN_KERNEL=1, on by default since 2026-11-29) against MLX's
#   attention in a step and verify calls, in rounds at acceptance 0.8, and plain vs stock;
#   ptxsave: MLX's compiled kernels into $OUT/mlx-ptx.tar.gz, exo's into $OUT/exo-kernels.tar.gz: keep them in .gpu5/ and
#   carry .gpu5 with .gpu3)
#   (q27 tensor9 tensor27 tensor35: issue 53's tensor groups, one member per GPU over NCCL, against one GPU:
#   needs the two-GPU machine, nvidia-h200-x2; q9 q35 q27 first; TENSOR_ARGS="--backend ring --repeats 1": more)
#   (serving9p: serving9 with the device threads under cProfile, each row's top functions; roundsahead1: issue 50's
#   K = 1, 2 rounds with the next round built ahead on / off, acceptance 0.8)
#   (qmmrows: MLX's own product at 1-16 rows, and whether rows padded to 8 keep their bits whatever their
#   companions: a decode step, a verify call and a batch step padded alike would agree by construction;
#   moeexperts: one 35B-A3B MoE layer's experts by method; batch9: the engine's batched steps at 1, 8, 32 on the
#   9B shape, what a batch-8 step costs beyond a one-row step without the server; batchstep: the model's own
#   forward at 1-32 rows, by part and by linear shape: which op makes a batch step cost more than one row's)
#
# A call carries the tree (~28 MiB: the bundled demo models) plus what it names, at most 64 MiB: prepare.sh's
# second part with grpcio beside it is over, so grpcio travels alone (`mkdir -p .gpu4 && mv .gpu2/grpcio-*.whl
# .gpu4/`, .gpu4 ignored like the others).
#
# Each phase writes its output to $OUT/<phase>.log (what comes back), unbuffered, as it goes: a call that hits
# its time limit still returns what it printed. Try a phase on the CPU first: EXO_GPU_SESSION_CPU=1 runs the
# same commands on small shapes here.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT"
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$PWD/src; else export PYTHONPATH=$PWD/src; fi
PY=${PY:-python3}
CPU=${EXO_GPU_SESSION_CPU:-0}
# Real sizes on the GPU; the same layouts shrunk on the CPU.
if [ "$CPU" = 1 ]; then
    SHRINK9="--layers 4 --set hidden_size=256 --set intermediate_size=512 --set vocab_size=4096"
    SHRINK27="--layers 4 --set hidden_size=256 --set intermediate_size=512 --set vocab_size=4096"
    SHRINK35="--layers 4 --set num_experts=16 --set vocab_size=4096"
    TENSOR="--modes plain,k2 --max-tokens 8 --prompts 1 --repeats 1 --collective-reps 20"
    PIPE="--max-tokens 8"; CLIENTS="--clients 1,4 --seconds 4 --max-tokens 8"
    SERVING="--clients 1 4 --seconds 4 --max-tokens 8 --engine-vs-client 2"
else
    SHRINK9=""; SHRINK27=""; SHRINK35=""
    TENSOR="--gpu-per-node --modes plain,k2 --max-tokens 64 --prompts 3 --repeats 2"
    PIPE="--max-tokens 64"; CLIENTS="--clients 1,8,32 --seconds 15 --max-tokens 64"
    SERVING="--clients 1 8 32 --seconds 15 --max-tokens 64 --engine-vs-client 4"
fi
# Prefill (issue 49): prompt lengths and the layer phase's shape, real on the GPU, small on the CPU.
if [ "$CPU" = 1 ]; then
    PREFILL9="--tokens 256 --prefill-chunk 128 --layer-tokens 256 8 --layer-shape 4,8,64 --profile-tokens 256 --repeats 1"
    PREFILL35="--tokens 128 --prefill-chunk 128 --profile-tokens 128 --repeats 1"
    AGENT9="--turns 2 --system-tokens 600 --max-tokens 8"
    CACHED9="--turns 2 --system-tokens 600 --max-tokens 8 --warm-tokens 200 --turn1-repeats 1"
    CONTEXT19=300; PROFILE19="64 128"
else
    PREFILL9="--tokens 4096 32768 --prefill-chunk 2048 4096 --gdn-chunk 32 64 128 --layer-tokens 4096 64 8 --repeats 2"
    PREFILL35="--tokens 4096 --prefill-chunk 2048 --profile-tokens 4096 --repeats 2"
    AGENT9="--turns 10 --system-tokens 15000 --max-tokens 16"
    CACHED9="--turns 10 --system-tokens 15000 --max-tokens 16 --turn1-repeats 3"
    CONTEXT19=18697; PROFILE19="554 2048"
fi
# One MLX CUDA kernel cache for every phase and every server a phase starts (a runner keeps its own under EXO_HOME
# otherwise: a fresh home compiled the 9B's kernels again, ~3 minutes before the server answered). `ptxsave` packs it
# into $OUT; carried back as .gpu5/mlx-ptx.tar.gz, `install3` unpacks it: a session skips the first compile.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}
# exo's own compiled kernels (engine/kernels/cuda_build.py) likewise, one folder for every phase; `ptxsave` packs them too
export EXO_KERNEL_DIR=${EXO_KERNEL_DIR:-/tmp/exo-kernels}
Q9=${Q9:-/tmp/q9}
Q35=${Q35:-/tmp/q35}
Q9S=${Q9S:-/tmp/q9s}  # the 9B's 32 layers at tiny widths: a step's host work without the device's
Q27=${Q27:-/tmp/q27}

phase() {  # phase NAME COMMAND...: run, tee to $OUT/NAME.log, report the time
    local name=$1; shift
    local start=$SECONDS
    echo "== $name: $*" | tee -a "$OUT/$name.log"
    # a phase ends by PHASE_TIMEOUT (SIGTERM: the benches stop what they started), inside the call's 10 minutes,
    # so the phases after it in the same call still run and the call returns what they printed
    timeout "${PHASE_TIMEOUT:-540}" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
}

for p in "$@"; do
    case $p in
    install1) mkdir -p /root/.gpu-wheel && cp .gpu1/part_* /root/.gpu-wheel/ ;;
    install2) cp .gpu2/part_* /root/.gpu-wheel/ ;;
    install3) bash .gpu3/device-install.sh && export PYTHONPATH=/tmp/site:$PWD/src
              for f in .gpu5/mlx-ptx.tar.gz .gpu5/mlx-ptx.tar.xz; do  # (xz: 1.8 MB where gzip was 4.5: the carry's 64 MiB)
                  if [ -f $f ]; then mkdir -p "$MLX_PTX_CACHE_DIR" && tar -xf $f -C "$MLX_PTX_CACHE_DIR" && echo "ptx cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) entries unpacked"; fi
              done
              if [ -f .gpu5/exo-kernels.tar.gz ]; then mkdir -p "$EXO_KERNEL_DIR" && tar -xzf .gpu5/exo-kernels.tar.gz -C "$EXO_KERNEL_DIR" && echo "exo kernels: $(ls "$EXO_KERNEL_DIR"/cuda 2>/dev/null | wc -l) unpacked"; fi ;;
    ptxsave) tar -cJf "$OUT/mlx-ptx.tar.xz" -C "$MLX_PTX_CACHE_DIR" . && ls -la "$OUT/mlx-ptx.tar.xz"
             if [ -d "$EXO_KERNEL_DIR/cuda" ]; then tar -czf "$OUT/exo-kernels.tar.gz" -C "$EXO_KERNEL_DIR" cuda && ls -la "$OUT/exo-kernels.tar.gz"; fi ;;
    grpc) $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu4/*.whl ;;
    q9) [ -d "$Q9" ] || phase q9 $PY bench/make_random_model.py --shape qwen3.5-9b --bits 4 --out "$Q9" $SHRINK9 ;;
    q9s) [ -d "$Q9S" ] || phase q9s $PY bench/make_random_model.py --shape qwen3.5-9b --bits 4 --out "$Q9S" --set hidden_size=256 --set intermediate_size=512 --set vocab_size=4096 ;;
    q35) [ -d "$Q35" ] || phase q35 $PY bench/make_random_model.py --shape qwen3.6-35b-a3b --bits 4 --out "$Q35" $SHRINK35 ;;
    q27) [ -d "$Q27" ] || phase q27 $PY bench/make_random_model.py --shape qwen3.5-27b --bits 4 --out "$Q27" $SHRINK27 ;;
    # issue 53: a 2-member tensor group vs one GPU (27B >= 1.4x, 9B never below 0.9x or not chosen by auto, 35B-A3B
    # measured); each prints the collectives alone, tok/s per mode, identity within the group, the estimate
    tensor9) phase tensor9 $PY bench/tensor.py "$Q9" $TENSOR ${TENSOR_ARGS:-} ;;
    tensor27) phase tensor27 $PY bench/tensor.py "$Q27" $TENSOR ${TENSOR_ARGS:-} ;;
    tensor35) phase tensor35 $PY bench/tensor.py "$Q35" $TENSOR ${TENSOR_ARGS:-} ;;
    smi) phase smi nvidia-smi ;;
    # exo's CUDA kernels compiled once per machine (EXO_CUDA_KERNEL_CACHE, default 1) against MLX compiling them in every
    # process: the same bits, a process's start (import, load, warm-up) and decode tok/s, cold and warm
    kcache) phase kcache $PY bench/kernel_cache.py "$Q9" --repeats ${KCACHE_REPEATS:-1} ;;
    # the tensor group and one GPU both without CUDA graphs (MLX_USE_CUDA_GRAPHS=0): the group 54.0 tok/s without them
    # against 13.0 with them (2026-11-29/30); a member now turns them off itself (sharding.member_process_settings)
    tensor9g) MLX_USE_CUDA_GRAPHS=0 phase tensor9g $PY bench/tensor.py "$Q9" $TENSOR ${TENSOR_ARGS:-} ;;
    # issue 51: a pipeline of 2 stages, stage i on GPU i, against one GPU (engine level, MTP off and K = 1, the
    # hops broken down); the clients axis through two exo serve daemons (needs grpc); one GPU's serve path against
    # the engine and its 8 / 32 clients (one GPU: serving9 takes GPU 0 unless CUDA_VISIBLE_DEVICES says otherwise)
    pipe9) phase pipe9 $PY bench/pipeline.py "$Q9" --stages 1,2 --modes plain,k1 --repeats 2 $PIPE --gpu-per-stage \
        --breakdown-modes plain --transports inline ;;
    # the same pipelines once per wire in each repeat (EXO_PIPELINE_WIRE): host (a stage reads its input, then builds
    # its step) against graph (the transfers are ops of each stage's step, built before its input arrives; opt-in)
    pipe9w) phase pipe9w $PY bench/pipeline.py "$Q9" --stages 1,2 --modes plain,k1 --repeats 2 $PIPE --gpu-per-stage \
        --no-breakdown --wires host,graph ;;
    # where the graph wire stops on a GPU (its first run on 2 x H200 did): two processes passing arrays as graph ops in
    # patterns ever closer to a pipeline's steps (both on GPU 0 here; GRAPHWIRE_ARGS=--gpu-per-rank on two), then
    # exo-demo and the 9B as 2-stage pipelines on the host and graph wires; every stuck process's stacks
    graphwire) phase graphwire $PY bench/graph_wire.py exo-demo $([ "$CPU" = 1 ] && echo --steps 8 --timeout 30 || echo --steps 64 --timeout 30) ${GRAPHWIRE_ARGS:-}
               [ "$CPU" = 1 ] || phase graphwire $PY bench/graph_wire.py "$Q9" --patterns both --steps 64 --timeout 40 ${GRAPHWIRE_ARGS:-} ;;
    pipeclients9) phase pipeclients9 $PY bench/pipeline.py "$Q9" --stages 1 --repeats 0 --no-breakdown --gpu-per-stage \
        $CLIENTS ;;
    # the same, 1 and 8 clients, the two placements alternating 3 times, each placed anew (new runner processes)
    pipeclients9r) phase pipeclients9r $PY bench/pipeline.py "$Q9" --stages 1 --repeats 0 --no-breakdown --gpu-per-stage \
        $([ "$CPU" = 1 ] && echo --clients 1,4 --seconds 3 --max-tokens 8 --clients-repeats 2 || echo --clients ${PIPE_CLIENTS:-1,8} --seconds 10 --max-tokens 64 --clients-repeats ${CLIENTS_REPEATS:-3}) ;;
    # issue 51: a runner killed mid-batch through exo serve, the seconds until the 9B serves again (target 15 s)
    restart9) phase restart9 $PY bench/runner_restart.py "$Q9" --kills 3 --members 4 ;;
    serving9p) EXO_NATIVE_MTP_ENABLED=0 phase serving9p $PY bench/serving.py "$Q9" --mtp off --no-one-at-a-time \
                   $([ "$CPU" = 1 ] && echo --clients 1 4 --seconds 4 --max-tokens 8 --engine-vs-client 2 || echo --clients 1 8 32 --seconds 10 --max-tokens 64 --engine-vs-client 8) --profile 30 ;;
    roundsahead1) phase roundsahead1 $PY bench/round_phases.py "$Q9" --replay 0.8 --depths 1 2 --repeats 3 --max-tokens 48 \
                      --no-adaptive --ahead on off ;;
    # issue 51: one client through exo serve against the engine alone, as is / the GIL handed off 10x less often / no
    # cyclic GC, in every process (bench/sitecustom): is the runner's 0.83-0.90x the interpreter's?
    servinggil) for v in base switch50ms gcoff; do
                    EXO_BENCH_SWITCH_INTERVAL=$([ $v = switch50ms ] && echo 0.05) EXO_BENCH_GC=$([ $v = gcoff ] && echo off) \
                    PYTHONPATH=$PWD/bench/sitecustom:$PYTHONPATH EXO_NATIVE_MTP_ENABLED=0 phase servinggil-$v $PY bench/serving.py "$Q9" \
                        --mtp off --no-one-at-a-time $([ "$CPU" = 1 ] && echo --clients 1 --seconds 2 --max-tokens 16 --engine-vs-client 3 || echo --clients 1 --seconds 4 --max-tokens 64 --engine-vs-client 8)
                done ;;
    # issue 51's one client with the server alone on GPU 1 (the x2 kind) and the bench's engine on GPU 0: whether two
    # processes sharing one GPU made the one-client row bimodal (0.706-1.04x on one H200)
    serving9x) EXO_NATIVE_MTP_ENABLED=0 phase serving9x $PY bench/serving.py "$Q9" --mtp off --no-one-at-a-time --server-gpu 1 \
                   $([ "$CPU" = 1 ] && echo --clients 1 --seconds 2 --max-tokens 16 --engine-vs-client 3 || echo --clients 1 8 --seconds 10 --max-tokens 64 --engine-vs-client 8) ;;
    # the same one client against the engine, each run a fresh server and a fresh engine process (SERVING_RUNS of them):
    # one process's speed against another's moved 0.87-1.08x between runs, so the ratio wants several processes
    serving9m) for r in $(seq ${SERVING_RUNS:-3}); do
                   EXO_NATIVE_MTP_ENABLED=0 phase serving9m $PY bench/serving.py "$Q9" --mtp off --no-one-at-a-time ${SERVER_GPU_ARG---server-gpu 1} \
                       $([ "$CPU" = 1 ] && echo --clients 1 --seconds 2 --max-tokens 16 --engine-vs-client 2 || echo --clients 1 --seconds 4 --max-tokens 64 --engine-vs-client 4)
               done ;;
    # issue 51: one client against the engine with a stream's tokens paced (EXO_STREAM_INTERVAL_S, runner/outbox.py) or
    # a message per token (0), alternating, each run a fresh server and engine process (one GPU: both on GPU 0, idle in
    # turn); then 1 / 8 / 32 clients with each setting
    servingstream) for r in $(seq ${SERVING_RUNS:-3}); do for v in ${STREAM_INTERVALS:-0 0.02}; do
                       EXO_STREAM_INTERVAL_S=$v EXO_NATIVE_MTP_ENABLED=0 phase servingstream $PY bench/serving.py "$Q9" --mtp off \
                           --no-one-at-a-time $([ "$CPU" = 1 ] && echo --clients 1 --seconds 2 --max-tokens 16 --engine-vs-client 2 \
                           || echo --clients 1 --seconds 4 --max-tokens 64 --engine-vs-client 4)
                   done; done ;;
    # the same question in ONE process (bench/serve_overhead.py: the engine alone against the runner's Generate over
    # gRPC, request by request, each stream interval a configuration): no process-to-process spread in the ratios
    serveoverhead) EXO_NATIVE_MTP_ENABLED=0 phase serveoverhead $PY bench/serve_overhead.py "$Q9" --intervals 0 0.02 0.05 \
                       $([ "$CPU" = 1 ] && echo --requests 2 --max-tokens 16 || echo --requests ${OVERHEAD_REQUESTS:-12} --max-tokens 64) ;;
    # a second engine readied as a runner readies its own (batches warmed to max_batch, state room, prefix cache)
    serverunner) EXO_NATIVE_MTP_ENABLED=0 phase serverunner $PY bench/serve_overhead.py "$Q9" --intervals 0.02 --runner-engine \
                       $([ "$CPU" = 1 ] && echo --requests 2 --max-tokens 16 || echo --requests ${OVERHEAD_REQUESTS:-12} --max-tokens 64) ;;
    # and with the node's prefix cache (RAM and disk tiers) on the engine alone and on the service, every prompt new
    serveprefix) EXO_NATIVE_MTP_ENABLED=0 phase serveprefix $PY bench/serve_overhead.py "$Q9" --intervals 0.02 --prefix-cache \
                       $([ "$CPU" = 1 ] && echo --requests 2 --max-tokens 16 || echo --requests ${OVERHEAD_REQUESTS:-12} --max-tokens 64) ;;
    servingstreamc) for v in ${STREAM_INTERVALS:-0 0.02}; do
                        EXO_STREAM_INTERVAL_S=$v EXO_NATIVE_MTP_ENABLED=0 phase servingstreamc $PY bench/serving.py "$Q9" --mtp off \
                            --no-one-at-a-time $([ "$CPU" = 1 ] && echo --clients 1 4 --seconds 3 --max-tokens 16 \
                            || echo --clients 1 8 32 --seconds 10 --max-tokens 64)
                    done ;;
    # issue 51's one stream over 2 stages on the collective wire against one GPU, every repeat fresh processes (5 of each)
    pipe9r) phase pipe9r $PY bench/pipeline.py "$Q9" --stages 1,2 --modes plain --repeats ${PIPE9R_REPEATS:-5} $PIPE \
        --gpu-per-stage --no-breakdown --wires collective ;;
    serving9) EXO_NATIVE_MTP_ENABLED=0 phase serving9 $PY bench/serving.py "$Q9" --mtp off --no-one-at-a-time $SERVING ;;
    # issue 50's checks (each well inside 10 minutes at 9B on an H200); qgemv and stock opt in to exo's quantized
    # kernel (off by default), so that stock compares exo on it with exo on MLX's products
    qgemv) EXO_QGEMV=1 phase qgemv $PY bench/qmv_check.py "$Q9" --rows 1 2 3 4 8 --repeats 5 ;;
    # issue 49: a prompt chunk's linears: MLX's quantized product vs dequantize + dense product (cuBLAS)
    linears9) phase linears9 $PY bench/prefill_linears.py "$Q9" $([ "$CPU" = 1 ] && echo --rows 64 --calls 2 --repeats 1 || echo --rows 128 256 512 2048 4096) ;;
    linears35) phase linears35 $PY bench/prefill_linears.py "$Q35" $([ "$CPU" = 1 ] && echo --rows 64 --calls 2 --repeats 1 || echo --rows 2048 4096) ;;
    qmmrows) phase qmmrows $PY bench/qmm_rows.py "$Q9" --rows 1 2 3 4 5 6 7 8 16 --pad 8 ;;
    # issue 50/51: the same with every quantized layer that passes padded_rows.check padded to 8 rows (MLX's tiled
    # product for decode steps, verify calls and small batches alike); compare with rounds / stock / batch9
    roundspad) EXO_PAD_ROWS=8 phase roundspad $PY bench/round_phases.py "$Q9" --replay 0.0,0.6,0.8,0.9 --repeats 1 --max-tokens 48 ;;
    stockpad) EXO_PAD_ROWS=8 phase stockpad $PY bench/engine.py "$Q9" --max-tokens 128 --repeats 3 ;;
    batchpad) EXO_PAD_ROWS=8 phase batchpad $PY bench/batch_identity.py "$Q9" --sizes 1,2,4,8,32 --max-tokens 64 ;;
    # issue 50: what a launch costs the host: MLX's ops vs mx.fast.cuda_kernel calls, and a decode step's graph
    # building vs its evaluation with exo's qgemv off and on (why the kernel's faster rows lost in a whole step)
    launch) phase launch $PY bench/launch_cost.py "$Q9" --chain 200 --repeats 5 --steps 16 --rows 1 2 4 ;;
    # the same step on the 9B's layers at tiny widths (q9s): its evaluation is the host's alone; and the steps' graphs
    # by primitive: is a decode step on MLX CUDA the device's work or the host's?
    opcount) phase opcount $PY bench/launch_cost.py "$Q9" --phases model --qgemv 0 --steps 8 --repeats 3 --rows 1 2 4
        phase opcount $PY bench/launch_cost.py "$Q9S" --phases model --qgemv 0 --steps 8 --repeats 3 --rows 1 2 4 ;;
    # a native-MTP round's verify calls (K + 1 = 2-4 rows, the engine's probed verify mode) the same way: what a
    # round's verify costs the host and the device (issue 50's round cost: <= 1.25x a plain step at K = 1)
    opverify) phase opverify $PY bench/launch_cost.py "$Q9" --phases model --qgemv 0 1 --verify --steps 8 --repeats 3 --rows 1 2 3 4
        phase opverify $PY bench/launch_cost.py "$Q9S" --phases model --qgemv 0 --verify --steps 8 --repeats 3 --rows 1 2 3 4 ;;
    # layers' input projections as one product (models.fused_inputs, on by default: GatedDeltaNet, q/k/v, gate/up) vs apart,
    # alternating in one process: a decode step and a round's verify calls, ms and primitives (issue 50)
    fused) phase fused $PY bench/launch_cost.py "$Q9" --phases model --qgemv 0 --fused 1 0 --steps 8 --repeats 3 --rows 1 2 4
        phase fused $PY bench/launch_cost.py "$Q9" --phases model --qgemv 0 --fused 1 0 --verify --steps 8 --repeats 3 --rows 2 3 4
        # the 35B-A3B too where its checkpoint is there (the q35 phase): its routers fuse with their shared gates
        if [ -d "$Q35" ]; then phase fused $PY bench/launch_cost.py "$Q35" --phases model --qgemv 0 --fused 1 0 --steps 8 --repeats 3 --rows 1 2 4; fi ;;
    attnstep) phase attnstep $PY bench/launch_cost.py "$Q9" --phases model --qgemv 1 --attn 0 1 --verify --steps 8 --repeats 3 --rows 1 2 4 ;;
    roundsa) EXO_ATTN_KERNEL=1 phase roundsa $PY bench/round_phases.py "$Q9" --replay 0.8 --depths 1 2 3 --repeats 1 --max-tokens 48 ;;
    stocka) EXO_ATTN_KERNEL=1 phase stocka $PY bench/engine.py "$Q9" --max-tokens 128 --repeats 2 ;;
    gdnstep) phase gdnstep $PY bench/launch_cost.py "$Q9" --phases model --qgemv 0 --gdn 1 force --verify --steps 8 --repeats 3 --rows 1 2 4 ;;
    roundsk) EXO_GDN_KERNEL=force phase roundsk $PY bench/round_phases.py "$Q9" --replay 0.8 --depths 1 2 3 --repeats 1 --max-tokens 48 ;;
    stockk) EXO_GDN_KERNEL=force phase stockk $PY bench/engine.py "$Q9" --max-tokens 128 --repeats 3 ;;
    gdn) phase gdn $PY bench/gdn_check.py "$Q9" --rows 1 2 3 4 8 --repeats 5 ;;
    layers) phase layers $PY bench/verify_layers.py "$Q9" --rows 2 3 4 --context 256 2048 ;;
    # a verify call evaluated every N layers as it is built (EXO_VERIFY_EVAL_EVERY; the GPU's default is 0, one
    # evaluation): does the host's 4.5 ms verify_build of a 12.4 ms K = 1 round hide behind the device's work?
    roundse) phase roundse $PY bench/round_phases.py "$Q9" --replay 0.8 --depths 1 2 3 --repeats 1 --max-tokens 48 \
        --no-adaptive --verify-eval-every 0 2 4 8 ;;
    # the next round built while a round computes (engine/ahead.py, EXO_NATIVE_MTP_ROUND_AHEAD, off by default) against
    # without, each fixed depth, in one process: the K = 1 round at 1.40 plain steps had 4-7 ms of host building
    # where the host's time goes building a step's and a verify call's graph (cProfile; the step is host-bound there)
    # issue 50: the primitives a plain step and a round at K = 1..3 evaluate, by the engine function that evaluated
    # them (a host-bound step's cost is its primitives): what a round adds beyond the step
    # issue 50's K = 1 target on a noisy host: K = 1 and 2 against plain at acceptance 0 and 0.8, 12 requests each
    roundsk1) phase roundsk1 $PY bench/round_phases.py "$Q9" --replay 0.0,0.8 --depths 1 2 --repeats 3 --max-tokens 48 --no-adaptive ;;
    census) phase census $PY bench/round_phases.py "$Q9" --census --depths 1 2 3 --max-tokens ${CENSUS_TOKENS:-32} --no-adaptive ;;
    # issue 50: a decode step with each GatedDeltaNet layer's step and each MLP one mx.compile'd call, then each
    # GatedDeltaNet decoder layer whole (and each attention layer's residuals + MLP), against op by op: the host's
    # build, the step built and evaluated, the same bits? (on this CPU's path no gain; along MLX CUDA's paths
    # emulated here, --emulate-cuda: build 0.67x and, the engine's compiled layers, 0.55x)
    compiledstep) phase compiledstep $PY bench/compiled_step.py "$Q9" --parts mlp gdn,mlp layer \
                      $([ "$CPU" = 1 ] && echo --repeats 5 --steps 2 || echo --repeats 50 --steps 16) ;;
    buildprof) phase buildprof $PY bench/build_profile.py "$Q9" --rows 1 2 4 --repeats 50 --top 30 ;;
    roundsahead) phase roundsahead $PY bench/round_phases.py "$Q9" --replay 0.6,0.8,0.9 --depths 1 2 3 --repeats 1 \
        --max-tokens 48 --ahead on off ;;
    rounds) phase rounds $PY bench/round_phases.py "$Q9" --replay 0.0,0.6,0.8,0.9 --repeats 1 --max-tokens 48 ;;
    # issue 50 with the defaults of 2026-11-30 (compiled layers on MLX CUDA): K = 1 / 2 rounds with the next round
    # built ahead on / off and adaptive depth, at acceptance 0 (adaptive >= 0.97x plain) and 0.8 (K = 1 <= 1.25)
    rounds50c) phase rounds50c $PY bench/round_phases.py "$Q9" --replay 0.0,0.8 --depths 1 2 --ahead on off \
                   $([ "$CPU" = 1 ] && echo --repeats 1 --max-tokens 12 || echo --repeats 2 --max-tokens 48) ;;
    # issue 50 after the head's layer went through compiled calls (3afbd98) and compiled_layers.call's one lookup
    # (d612378): K = 1 / 2 / 3 round costs and adaptive at acceptance 0 and 0.8 (K = 1 <= 1.25, K = 3 <= 1.5)
    rounds50d) phase rounds50d $PY bench/round_phases.py "$Q9" --replay 0.0,0.8 --depths 1 2 3 \
                   $([ "$CPU" = 1 ] && echo --repeats 1 --max-tokens 12 || echo --repeats 2 --max-tokens 48) ;;
    # issue 50: chained rounds (EXO_NATIVE_MTP_ROUND_AHEAD=chain: round n + 1 built on round n's verdict as the device
    # holds it and launched before the host reads it) against rounds as they are, in one process: round cost K = 1-3
    # at acceptance 0 and 0.8, speed-up, identical to plain
    roundschain) phase roundschain $PY bench/round_phases.py "$Q9" --replay 0.0,0.8 --depths 1 2 3 --ahead chain off \
                   --no-adaptive $([ "$CPU" = 1 ] && echo --repeats 1 --max-tokens 12 || echo --repeats 2 --max-tokens 48) ;;
    # MLX CUDA's graph size (MLX_MAX_OPS_PER_BUFFER, 100 on an H200): a K = 1 round and a plain step at 50 / 200 / 400
    opsbuf) for v in 50 200 400; do
                MLX_MAX_OPS_PER_BUFFER=$v phase opsbuf$v $PY bench/round_phases.py "$Q9" --replay 0.8 --depths 1 --no-adaptive \
                    $([ "$CPU" = 1 ] && echo --repeats 1 --max-tokens 8 || echo --repeats 1 --max-tokens 48)
            done ;;
    # the same sweep wider (OPS: the values): plain steps, K = 1 and K = 3 rounds at acceptance 0.8 per value
    opssweep) for v in ${OPS:-10 20 30 50 100}; do
                  MLX_MAX_OPS_PER_BUFFER=$v phase opssweep$v $PY bench/round_phases.py "$Q9" --replay 0.8 --depths 1 3 --no-adaptive \
                      $([ "$CPU" = 1 ] && echo --repeats 1 --max-tokens 8 || echo --repeats 1 --max-tokens 48)
              done ;;
    # issue 51's 8 clients over 2 stages (0.82x one GPU through exo serve): the engine alone, 8 plain requests decoded as
    # one batch, one GPU against 2 stages on the collective wire (is it the batch's step or the serving around it?)
    pipe9b) phase pipe9b $PY bench/pipeline.py "$Q9" --stages 1,2 --modes plain,batch8 --repeats ${PIPE9B_REPEATS:-2} $PIPE \
        --gpu-per-stage --no-breakdown --wires ${PIPE9B_WIRES:-collective} ;;
    # the same batch of 8 over 2 stages on the collective wire with each step timed (EXO_PIPELINE_PHASES=1): a stage's
    # wait for the header and its build-and-launch, the leader's period per step
    pipe9p) phase pipe9p $PY bench/pipeline.py "$Q9" --stages 1,2 --modes ${PIPE9P_MODES:-batch8} --repeats 1 $PIPE \
        --gpu-per-stage --no-breakdown --wires collective --phases ;;
    # issue 51's 2 stages on the collective wire (a group of two's all-sums over NCCL, device to device) against the
    # graph wire, and the collective wire with MLX's CUDA graphs off in the stages (NCCL captured in them or not)
    pipe9n) phase pipe9n $PY bench/pipeline.py "$Q9" --stages 1,2 --modes plain,k1 --repeats 2 $PIPE \
        --gpu-per-stage --no-breakdown --wires graph,collective,collective+nographs ;;
    # one GPU's plain decoding from process to process (128-216 tok/s on the same GPU, steady within a process), each
    # process pinned to 1 / 2 / 4 CPUs, 2 cores with their SMT siblings, or not pinned, settings interleaved
    spread9) phase spread9 $PY bench/decode_spread.py "$Q9" --settings ${SPREAD_SETTINGS:-all 1 2 4 2+sib} \
                 --processes ${SPREAD_PROCESSES:-2} $([ "$CPU" = 1 ] && echo --max-tokens 8 --requests 2 || echo --max-tokens 64 --requests 3) ;;
    # the same, processes not pinned with Python's hash seed random (all) or fixed (hash=0), each process's host
    # probed apart from the model (a pure-Python loop, MLX graph building, evaluating, a 256 MB copy)
    spreadhash) phase spreadhash $PY bench/decode_spread.py "$Q9" --settings all hash=0 \
                 --processes ${SPREAD_PROCESSES:-4} $([ "$CPU" = 1 ] && echo --max-tokens 8 --requests 2 || echo --max-tokens 64 --requests 3) ;;
    # the same, plain processes against processes set up as a runner (runner.main's settings, batches warmed, prefix
    # cache, the gRPC service idle): whether a runner's process draws slower (issue 51's 0.74-1.13x between processes)
    spreadrunner) EXO_NATIVE_MTP_ENABLED=0 phase spreadrunner $PY bench/decode_spread.py "$Q9" --settings ${SPREAD_SETTINGS:-all runner runner-full} \
                 --processes ${SPREAD_PROCESSES:-3} $([ "$CPU" = 1 ] && echo --max-tokens 8 --requests 2 || echo --max-tokens 64 --requests 3) ;;
    # one process set up as a runner step by step, its decoding after each step against a plain engine of the same
    # process (bench/decode_spread.py runner-staged): which step makes a runner draw slower (0.5-0.75x plain in
    # spreadrunner, 2026-11-30), free of the process-to-process spread
    spreadstaged) EXO_NATIVE_MTP_ENABLED=0 phase spreadstaged $PY bench/decode_spread.py "$Q9" --settings runner-staged \
                 --processes ${SPREAD_PROCESSES:-3} $([ "$CPU" = 1 ] && echo --max-tokens 8 --requests 2 || echo --max-tokens 64 --requests 3) ;;
    stock) EXO_QGEMV=1 phase stock $PY bench/engine.py "$Q9" --max-tokens 128 --repeats 3 ;;
    # issues 50 / 51: the engine's decoder layers as compiled calls (models.compiled_layers, EXO_COMPILED_LAYERS,
    # on MLX CUDA by default since 2026-11-30): plain decoding with and without in one process (the same tokens?), then a K = 1 / 2 round's
    # cost in plain steps with them (against roundsk1's), one client through exo serve with them, and 2 stages
    compiledlayers) phase compiled9 $PY bench/engine.py "$Q9" --compiled-layers $([ "$CPU" = 1 ] && echo --max-tokens 16 --repeats 1 || echo --max-tokens 128 --repeats 3)
        EXO_COMPILED_LAYERS=1 phase roundsk1c $PY bench/round_phases.py "$Q9" --replay 0.0,0.8 --depths 1 2 \
            $([ "$CPU" = 1 ] && echo --repeats 1 --max-tokens 12 || echo --repeats 3 --max-tokens 48) --no-adaptive
        EXO_COMPILED_LAYERS=1 EXO_NATIVE_MTP_ENABLED=0 phase serving9c $PY bench/serving.py "$Q9" --mtp off --no-one-at-a-time \
            $([ "$CPU" = 1 ] && echo --clients 1 --seconds 2 --max-tokens 16 --engine-vs-client 3 || echo --clients 1 8 --seconds 8 --max-tokens 64 --engine-vs-client 8) ;;
    pipe9c) EXO_COMPILED_LAYERS=1 phase pipe9c $PY bench/pipeline.py "$Q9" --stages 1,2 --modes plain,k1 --repeats 2 $PIPE \
        --gpu-per-stage --no-breakdown --wires host,graph ;;
    # the same without MLX's CUDA graphs (each evaluation's kernels launched one by one): a decode step is the host's
    # work, and building and launching a graph of ~700 kernels is part of it
    stockg) MLX_USE_CUDA_GRAPHS=0 phase stockg $PY bench/engine.py "$Q9" --max-tokens 128 --repeats 3 ;;
    moe) phase moe $PY -m exo.cli.main bench "$Q35" --baseline --check --max-tokens 64 --repeats 1 ;;
    # issue 49: prefill against stock (9B: 4k and 32k, the layer by method, the profile; 35B-A3B: 4k and its
    # profile), the prefix cache on an agent session (turn 1 on/off, later turns) and its phases in one process
    prefill9) phase prefill9 $PY bench/prefill.py "$Q9" $PREFILL9 ;;
    # issue 49: the prompt kernel (a chunk's GatedDeltaNet rows in one launch a layer, each its decode step's bits):
    # checked against the step kernel and timed against the chunked form on one 9B layer, then the whole 9B's prefill
    # (the prompt kernel, the default; the chunked form, the default before; stock) at 1k / 4k / 32k tokens
    gdnprompt) phase gdnprompt $PY bench/gdn_check.py "$Q9" $([ "$CPU" = 1 ] && echo --rows 1 --calls 2 --repeats 1 --prompt-rows 8 40 || echo --rows --prompt-rows 8 64 554 1024 2048 4096 16384) ;;
    # the same with the prompt kernel's second form (the next tile prepared while this one's rows step), then a cached
    # agent session's turns with it
    prefill9k2) EXO_GDN_PROMPT_VARIANT=2 phase prefill9k2 $PY bench/prefill.py "$Q9" --phases model $([ "$CPU" = 1 ] && echo --tokens 128 300 --prefill-chunk 128 --repeats 1 --loop-max 0 || echo --tokens 1024 4096 32768 --prefill-chunk 2048 --repeats 2 --loop-max 0 --stock-max 0) ;;
    cached9v2) EXO_GDN_PROMPT_VARIANT=2 EXO_NATIVE_MTP_ENABLED=0 phase cached9v2 $PY bench/cached_turn.py "$Q9" $CACHED9 ;;
    prefill9k) phase prefill9k $PY bench/prefill.py "$Q9" --phases model $([ "$CPU" = 1 ] && echo --tokens 128 300 --prefill-chunk 128 --repeats 1 --loop-max 0 || echo --tokens 1024 4096 32768 --prefill-chunk 2048 --repeats 2 --loop-max 0 --stock-max 4096) ;;
    # issue 51's clients: a batch step's products on dense weights held from load (EXO_BATCH_DENSE,
    # engine/models/prompt_dense.py) against exo's quantized kernel and against dequantizing per step, alternating in
    # one process, from 2 sequences (keep:2: where held weights start paying; auto holds them from 8), then through
    # exo serve (BATCH_DENSE_VALUES: the settings, one fresh server each)
    batchdense) EXO_BATCH_DENSE=${EXO_BATCH_DENSE:-keep:2} phase batchdense $PY bench/batch_step.py "$Q9" --phases step --dense-batch \
                   $([ "$CPU" = 1 ] && echo --sizes 1 4 --context 16 --steps 2 --repeats 1 || echo --sizes 1 2 4 6 8 12 16 24 32 --context 1024) ;;
    servingdense) for v in ${BATCH_DENSE_VALUES:-on off}; do
                      EXO_BATCH_DENSE=$v EXO_NATIVE_MTP_ENABLED=0 phase servingdense $PY bench/serving.py "$Q9" --mtp off \
                          --no-one-at-a-time $([ "$CPU" = 1 ] && echo --clients 1 4 --seconds 3 --max-tokens 8 --engine-vs-client 1 \
                          || echo --clients 1 8 32 --seconds 15 --max-tokens 64 --engine-vs-client 2)
                  done ;;
    batchstep) phase batchstep $PY bench/batch_step.py "$Q9" $([ "$CPU" = 1 ] && echo --sizes 1 4 8 --context 64 --steps 3 --repeats 1 || echo --sizes 1 2 4 8 16 32 --context 1024) ;;
    batch9) phase batch9 $PY bench/batch_identity.py "$Q9" --sizes 1,8,32 --max-tokens 64 ;;
    # with the batch-invariant mode beside it (EXO_BATCH_INVARIANT=1, opt-in; in one process): batched rows equal solo
    # ones (2026-11-29: 1/8 identical without it, out_proj / o_proj on MLX's product first to differ); its step's cost
    batch9inv) phase batch9inv $PY bench/batch_identity.py "$Q9" --sizes 1,8,32 --max-tokens 64 --invariant ;;
    moeexperts) phase moeexperts $PY bench/moe_experts.py --tokens 4096 512 --repeats 5 $([ "$CPU" = 1 ] && echo --experts 16 --hidden 256 --inter 128 --tokens 64) ;;
    prefill35) phase prefill35 $PY bench/prefill.py "$Q35" --phases model profile $PREFILL35 ;;
    agent9) EXO_NATIVE_MTP_ENABLED=0 phase agent9 $PY bench/agent_session.py "$Q9" $AGENT9 ;;
    identity49) for m in exo-demo exo-demo-moe; do
            phase identity49 $PY -m exo.cli.main bench $m --baseline --check --repeats 1 --pairs 0 --max-tokens 64
        done ;;
    # a cached turn part by part (render, tokenize, lookup, restore and again, prefill and again, first token,
    # store) against the cold cost of its new tokens (ratio target <= 1.2), turn 1 on vs off alone (<= 1.05)
    cached9) EXO_NATIVE_MTP_ENABLED=0 phase cached9 $PY bench/cached_turn.py "$Q9" $CACHED9 ;;
    # the same with each cold time the median of 3 runs (the marginal, a difference of two cold times of ~2 s, was off
    # by tens of ms run to run: single turns' ratios 0.72-3.05 around a median of 1.24), 6 turns, turn 1 once
    cached9r) EXO_NATIVE_MTP_ENABLED=0 phase cached9r $PY bench/cached_turn.py "$Q9" \
                  $([ "$CPU" = 1 ] && echo --turns 2 --system-tokens 600 --max-tokens 8 --warm-tokens 200 || echo --turns 6 --system-tokens 15000 --max-tokens 16) \
                  --turn1-repeats 1 --cold-repeats 3 ;;
    # issue 49: a cached turn's new tokens (554 after 18,697 in the caches, as cached9's turn 4) part by part,
    # and a whole 2,048-token chunk at the same context: what a short chunk pays beyond its share
    # issue 49: a prompt chunk's attention over a long context by method (a cached turn's new tokens over a 19k prefix,
    # a 32k prompt's last chunk): MLX's unfused fallback for head dim 256 against an online softmax over key blocks
    longattn) phase longattn $PY bench/long_attention.py $([ "$CPU" = 1 ] && echo --rows 16 --context 100 --heads 4 \
                  --kv-heads 2 --head-dim 64 --blocks 64 --repeats 1 || echo --rows 554 2048 --context 18697 30720 --blocks 2048 4096 8192) ;;
    # the whole 9B's prefill at 4k / 32k with and without a long context's chunks attending in key blocks
    # (EXO_LONG_ATTENTION, alternating in one process), then a cached agent session's turns with it on
    prefill9l) EXO_LONG_ATTENTION=${LONG_ATTENTION:-on} phase prefill9l $PY bench/prefill.py "$Q9" --phases model --long-attention \
                   $([ "$CPU" = 1 ] && echo --tokens 300 --prefill-chunk 128 --repeats 1 --loop-max 0 --stock-max 0 \
                   || echo --tokens 4096 32768 --prefill-chunk 2048 --repeats 2 --loop-max 0 --stock-max 0) ;;
    cached9rl) EXO_LONG_ATTENTION=${LONG_ATTENTION:-on} EXO_NATIVE_MTP_ENABLED=0 phase cached9rl $PY bench/cached_turn.py "$Q9" \
                  $([ "$CPU" = 1 ] && echo --turns 2 --system-tokens 600 --max-tokens 8 --warm-tokens 200 || echo --turns 6 --system-tokens 15000 --max-tokens 16) \
                  --turn1-repeats 1 --cold-repeats 3 ;;
    # issue 53: what MLX's CUDA graphs make of a step of 64 all-reduces over NCCL (one member per GPU; 2 x H200), apart
    # from any model: ms a step with graphs on / off, with and without the collectives, the graphs committed a step
    # and their node types (a node type MLX cannot update in place makes it instantiate the graph anew every step)
    collgraphs) phase collgraphs $PY bench/collective_graphs.py --dot $([ "$CPU" = 1 ] && echo --layers 4 --width 256 --steps 5 \
                    || echo --steps 40 --nccl-env NCCL_CGA_CLUSTER_SIZE=1 NCCL_PROTO=Simple) ;;
    profile19) for t in $PROFILE19; do
            phase profile19 $PY bench/prefill.py "$Q9" --phases profile --profile-context $CONTEXT19 --profile-tokens $t --repeats 3
        done ;;
    # the same 554-token chunk at shapes new to the process, part by part, then again: what a new shape costs
    cold19) phase cold19 $PY bench/prefill.py "$Q9" --phases profile --profile-context $CONTEXT19 --profile-tokens ${PROFILE19%% *} --profile-cold --repeats 1 ;;
    phases9) phase phases9 $PY bench/prefix_phases.py "$Q9" ${AGENT9/--turns 10/--turns 4} ;;
    *) echo "unknown phase $p" >&2; exit 2 ;;
    esac
done
