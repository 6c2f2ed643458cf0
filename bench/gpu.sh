#!/usr/bin/env bash
# On the GPU machine, in one run: unpack the kit (scripts/gpu_kit.sh made it on the CPU
# machine), build with -DTANDEM_CUDA=ON, run the GPU tests, then the benchmarks whose
# figures BENCHMARKS.md records (each with the floor measured in the same run).
#   bench/gpu.sh [all | a comma list of test,bench,xfer,xfertcp,xferucx,pd,pdtcp,pducx,dec,sample,mega,tg,gpus,profile, or megaclock]   (default all; logs
#   also go to $OUT if set)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
want() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
kit=$PWD/.gpu-kit
[ -d "$kit/debs" ] || { echo "bench/gpu.sh: $kit is missing: run scripts/gpu_kit.sh on the CPU machine and carry .gpu-kit" >&2; exit 1; }
root=$kit/root lib=$kit/root/usr/lib/x86_64-linux-gnu
if [ ! -d "$root" ]; then
    mkdir -p "$root"
    for f in "$kit"/debs/*.deb; do dpkg -x "$f" "$root"; done
    # -dev packages link to sonames that the image may already have (libssl, libcurl)
    for l in "$lib"/*.so; do [ -e "$l" ] || ln -sf "/usr/lib/x86_64-linux-gnu/$(basename "$(readlink "$l")")" "$l"; done
    sed -i -e "s|^prefix *=.*|prefix=$root/usr|" -e "s|=/usr/|=$root/usr/|g" -e "s| -I/usr/| -I$root/usr/|g" \
        -e "s| -L/usr/| -L$root/usr/|g" "$lib"/pkgconfig/*.pc "$root"/usr/share/pkgconfig/*.pc 2>/dev/null || true
fi
export PKG_CONFIG_PATH=$lib/pkgconfig:$root/usr/share/pkgconfig LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TD_SHARED_DIR=$kit/shared PATH=$root/usr/bin:/usr/local/cuda/bin:$PATH
out=${OUT:-$PWD/build-gpu}
mkdir -p "$out"
log() { tee -a "$out/gpu.log"; }

echo "== build (CUDA)" | log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | log
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON -DPKG_CONFIG_EXECUTABLE="$root/usr/bin/pkgconf" \
    -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null
cmake --build build-gpu -j"$(nproc)" --target tandem test_engine_cuda test_kvx_cuda 2>&1 | grep -E "error|warning" | log || true
[ -x build-gpu/tandem ] || { echo "build failed" | log; exit 1; }

if want test; then
    echo "== GPU tests" | log
    (cd build-gpu && ctest -V -R cuda) 2>&1 | grep -v " info " | log || echo "GPU tests FAILED" | log
fi

b8=(build-gpu/tandem bench-engine --model llama3-8b --load-format dummy --dtype bf16 --device cuda
    --kv-cache-dtype bf16 --max-model-len 4096 --kv-cache-memory 40G --reps 2)
if want bench; then
    echo "== Llama-3-8B shape: pp2048, then decode at batch 1, 16 and 64 from 1024-token contexts" | log
    "${b8[@]}" --prompt-len 2048 --context 1024 --gen-len 32 --batch 1,16,64 --max-num-batched-tokens 2048 2>&1 | log
    echo "== the same decode with the split-K attention instead of the tensor-core one (TD_CUDA_DEC=0)" | log
    TD_CUDA_DEC=0 "${b8[@]}" --prompt-len 128 --context 1024 --gen-len 32 --batch 1,64 --max-num-batched-tokens 2048 \
        --no-floor 2>&1 | log
    echo "== llama-1b (TinyLlama shape)" | log
    build-gpu/tandem bench-engine --model llama-1b --load-format dummy --dtype bf16 --device cuda \
        --kv-cache-dtype bf16 --prompt-len 512 --context 512 --gen-len 32 --batch 1,32 --reps 2 \
        --max-model-len 2048 --no-floor 2>&1 | log
    echo "== fp8 KV (split-K attention only)" | log
    build-gpu/tandem bench-engine --model llama3-8b --load-format dummy --dtype bf16 --device cuda \
        --kv-cache-dtype fp8 --max-model-len 4096 --kv-cache-memory 40G --reps 1 --prompt-len 2048 \
        --context 1024 --gen-len 32 --batch 1,64 --max-num-batched-tokens 2048 --no-floor 2>&1 | log
fi
if want xfer; then
    echo "== cuda_ipc: 2048-token KV of the Llama-3-8B shape between two processes" | log
    build-gpu/tandem bench-xfer-cuda --tokens 2048 --concurrency 1,4,16 --reps 7 2>&1 | log
fi
if want xfertcp; then # the cross-host path on one host: tcp through pinned host staging
    for i in 1 2; do
        for ov in 0 1; do
            echo "== tcp with GPU memory, TD_KVX_STAGE_OVERLAP=$ov (run $i)" | log
            TD_KVX_STAGE_OVERLAP=$ov build-gpu/tandem bench-xfer-cuda --protocol tcp --tokens 2048 \
                --concurrency 1,4 --reps 5 2>&1 | log
        done
    done
fi
if want xferucx; then # the cross-host path by ucx: gets between registered pinned staging
    for tls in tcp sm; do
        echo "== ucx with GPU memory, UCX_TLS=$tls" | log
        UCX_TLS=$tls build-gpu/tandem bench-xfer-cuda --protocol ucx --tokens 2048 \
            --concurrency 1,4 --reps 5 2>&1 | log
    done
fi
# 1P1D on the one GPU through the router (each engine with its share of the memory),
# then the aggregated engine alone, the same tandem bench at concurrency 1, 4 and 16.
eng=(--model llama3-8b --load-format dummy --dtype bf16 --device cuda --kv-cache-dtype bf16
     --max-model-len 4096 --kv-cache-memory 30G --max-num-batched-tokens 2048 --log-level warn)
bench_at() { # URL LABEL
    for c in 1 4 16; do
        # a seed per level: no level's prompts are a prefix-cache hit on an earlier level's
        build-gpu/tandem bench --base-url "$1" --input-len 1024 --output-len 128 --ignore-eos --seed $c \
            --num-prompts $((c * 4)) --max-concurrency $c --label "$2 c=$c" \
            --save-result "$out/pd-$2-c$c.json" 2>&1 | grep -vE "^\s*$" | log
    done
}
wait_ok() { for _ in $(seq 240); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
run_1p1d() { # PROTOCOL PORT
    echo "== 1P1D (tandem up --protocol $1)" | log
    rm -rf "$out/pd-work"
    build-gpu/tandem up --model llama3-8b --protocol "$1" --port "$2" --workdir "$out/pd-work" --log-level info \
        -- "${eng[@]}" >"$out/pd-up.log" 2>&1 &
    local up_pid=$!
    if wait_ok "http://127.0.0.1:$2"; then
        bench_at "http://127.0.0.1:$2" "1p1d-$1"
    else
        echo "1P1D did not come up" | log; tail -30 "$out"/pd-work/*.log | log
    fi
    kill $up_pid; wait $up_pid || true
    grep -hE "cuda_ipc|ucx|error" "$out"/pd-work/*.log | head -10 | log || true
}
if want pd; then
    run_1p1d cuda_ipc 8300
    echo "== aggregated (one engine, all of it)" | log
    build-gpu/tandem serve "${eng[@]}" --server-port 8301 >"$out/agg.log" 2>&1 &
    agg_pid=$!
    if wait_ok http://127.0.0.1:8301; then bench_at http://127.0.0.1:8301 agg; else tail -20 "$out/agg.log" | log; fi
    kill $agg_pid; wait $agg_pid || true
    build-gpu/tandem bench --compare "$out"/pd-1p1d-cuda_ipc-c1.json "$out"/pd-agg-c1.json \
        "$out"/pd-1p1d-cuda_ipc-c4.json "$out"/pd-agg-c4.json "$out"/pd-1p1d-cuda_ipc-c16.json \
        "$out"/pd-agg-c16.json --plot "$out/pd.svg" 2>&1 | log || true
fi
if want pdtcp; then # the same 1P1D with tcp: GPU memory through pinned host staging
    run_1p1d tcp 8302
    build-gpu/tandem bench --compare "$out"/pd-1p1d-tcp-c1.json "$out"/pd-1p1d-tcp-c4.json \
        "$out"/pd-1p1d-tcp-c16.json 2>&1 | log || true
fi
if want pducx; then # the same 1P1D with ucx (over TCP): GPU memory through registered pinned staging
    (export UCX_TLS=tcp; run_1p1d ucx 8303)
    build-gpu/tandem bench --compare "$out"/pd-1p1d-ucx-c1.json "$out"/pd-1p1d-ucx-c4.json \
        "$out"/pd-1p1d-ucx-c16.json 2>&1 | log || true
fi
if want dec; then # small-batch decode alone (quick A/B of decode kernels)
    echo "== decode at batch 1, 2 and 8 from 1024-token contexts" | log
    "${b8[@]}" --prompt-len 128 --context 1024 --gen-len 64 --batch 1,2,8 --max-num-batched-tokens 2048 2>&1 | log
    echo "== whole steps on the GPU (TD_CUDA_PROFILE=2)" | log
    TD_CUDA_PROFILE=2 "${b8[@]}" --prompt-len 128 --gen-len 64 --batch 1 --context 1024 --reps 1 --no-floor 2>&1 | log
fi
if want sample; then # sampled decode: on the GPU, or the logits to the host (TD_CUDA_SAMPLE=0)
    for i in 1 2; do
        for v in TD_CUDA_SAMPLE=0 TD_CUDA_SAMPLE=1; do
            echo "== decode at batch 1 and 16, temperature 0.8, top-p 0.9, $v (run $i)" | log
            env $v "${b8[@]}" --prompt-len 128 --context 1024 --gen-len 32 --batch 1,16 --max-num-batched-tokens 2048 \
                --temperature 0.8 --top-p 0.9 --no-floor 2>&1 | grep -E "^(tg|decode samples)" | log
        done
    done
    echo "== the same with top-k 40, on the GPU" | log
    "${b8[@]}" --prompt-len 128 --context 1024 --gen-len 32 --batch 1,16 --max-num-batched-tokens 2048 \
        --temperature 0.8 --top-k 40 --no-floor 2>&1 | grep -E "^(tg|decode samples)" | log
fi
if want tg; then # batch-1 decode as llama.cpp's tg128 measures it (from an empty context, 128 tokens),
    # alternating with the 1024-token contexts of the other batch-1 figures; each run measures its floor
    for i in 1 2 3; do
        for c in 1 1024; do
            echo "== decode at batch 1, 128 tokens from a $c-token context (run $i)" | log
            "${b8[@]}" --prompt-len 16 --context $c --gen-len 128 --batch 1 --max-num-batched-tokens 2048 \
                2>&1 | grep -E "^(tg|floor|machine|  floor)" | log
        done
    done
fi
if want mega; then # batch-1 decode as one kernel per step (k_mega): this version against the first
    # (TD_CUDA_MEGA_PLAIN=1: no early K/V loads, k_argmax after it, five copies in), alternating
    for i in 1 2 3; do
        for v in TD_CUDA_MEGA_PLAIN=1 TD_CUDA_MEGA_PLAIN=0; do
            echo "== decode at batch 1 from 1024-token contexts, $v (run $i)" | log
            env $v "${b8[@]}" --prompt-len 128 --context 1024 --gen-len 64 --batch 1 --max-num-batched-tokens 2048 \
                2>&1 | grep -E "^(tg|floor|machine|  floor)" | log
        done
    done
    echo "== where the time goes (TD_CUDA_MEGA_TIMES=1): first version, then this" | log
    for v in TD_CUDA_MEGA_PLAIN=1 TD_CUDA_MEGA_PLAIN=0; do
        env $v TD_CUDA_MEGA_TIMES=1 "${b8[@]}" --prompt-len 128 --context 1024 --gen-len 64 --batch 1 \
            --max-num-batched-tokens 2048 --no-floor 2>&1 | grep -E "^tg|one-kernel" | log
    done
    echo "== separate kernels (TD_CUDA_MEGA=0)" | log
    TD_CUDA_MEGA=0 "${b8[@]}" --prompt-len 128 --context 1024 --gen-len 64 --batch 1 --max-num-batched-tokens 2048 \
        --no-floor 2>&1 | grep -E "^tg" | log
    echo "== from 3968-token contexts, first version then this" | log
    for v in TD_CUDA_MEGA_PLAIN=1 TD_CUDA_MEGA_PLAIN=0; do
        env $v "${b8[@]}" --prompt-len 128 --context 3968 --gen-len 64 --batch 1 --max-num-batched-tokens 2048 \
            --no-floor 2>&1 | grep -E "^tg" | log
    done
    echo "== llama-1b (TinyLlama shape), batch 1: separate kernels, first version, this" | log
    for v in TD_CUDA_MEGA=0 TD_CUDA_MEGA_PLAIN=1 TD_CUDA_MEGA_PLAIN=0; do
        env $v build-gpu/tandem bench-engine --model llama-1b --load-format dummy --dtype bf16 --device cuda \
            --kv-cache-dtype bf16 --prompt-len 512 --context 512 --gen-len 32 --batch 1 --reps 2 \
            --max-model-len 2048 2>&1 | grep -E "^(tg|floor|  floor)" | log
    done
fi
if [[ ",$what," == *",megaclock,"* ]]; then # (not in all) clocks inside k_mega's attention (bench/patches/mega-attn-clock.patch, a copy of the tree)
    echo "== k_mega's attention by per-block clocks (a diagnostic build; its own times run slower)" | log
    d=$(mktemp -d)
    tar --exclude=./build-gpu --exclude=./build --exclude='./build-*' -cf - . | tar -xf - -C "$d"
    (cd "$d" && { git apply bench/patches/mega-attn-clock.patch 2>/dev/null || patch -s -p1 < bench/patches/mega-attn-clock.patch; } &&
        cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON -DPKG_CONFIG_EXECUTABLE="$root/usr/bin/pkgconf" \
            -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null && cmake --build build-gpu -j"$(nproc)" --target tandem >/dev/null) ||
        echo "megaclock: the patch or its build failed" | log
    for c in 1024 3968; do
        echo "== $c-token contexts" | log
        TD_CUDA_MEGA_TIMES=1 "$d/${b8[0]}" "${b8[@]:1}" --prompt-len 128 --context $c --gen-len 64 --batch 1 \
            --max-num-batched-tokens 2048 --no-floor 2>&1 | grep -E "^tg|one-kernel|^diag" | log
    done
    rm -rf "$d"
fi
if want gpus; then # tandem up --gpus: each engine on the GPU it is given (--device cuda:N)
    echo "== tandem up --gpus $(nvidia-smi -L | awk -F: '{print substr($1, 5)}' | paste -sd,) --protocol cuda_ipc (llama-1b)" | log
    rm -rf "$out/gpus-work"
    gl=$(nvidia-smi -L | awk -F: '{print substr($1, 5)}' | paste -sd,)
    build-gpu/tandem up --model llama-1b --gpus "$gl" --protocol cuda_ipc --port 8310 --workdir "$out/gpus-work" \
        -- --load-format dummy --dtype bf16 --kv-cache-dtype bf16 --max-model-len 2048 --kv-cache-memory 8G \
        >"$out/gpus-up.log" 2>&1 &
    up_pid=$!
    if wait_ok http://127.0.0.1:8310; then
        grep -E "prefill|decode" "$out/gpus-up.log" | log
        for i in 1 2 3; do
            curl -s http://127.0.0.1:8310/v1/completions -H 'Content-Type: application/json' \
                -d '{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":8,"temperature":0,"ignore_eos":true}' |
                python3 -c 'import json,sys; d=json.load(sys.stdin); k=d.get("kv_transfer_params",{}); print(d["usage"]["completion_tokens"], k.get("kv_load"), k.get("kv_load_error",""))' | log
        done
    else
        echo "tandem up --gpus did not come up" | log; tail -20 "$out/gpus-up.log" | log; tail -20 "$out"/gpus-work/*.log | log
    fi
    kill $up_pid; wait $up_pid || true
fi
if want profile; then
    echo "== where a step's time goes (TD_CUDA_PROFILE=1: every launch timed, no graphs)" | log
    TD_CUDA_PROFILE=1 "${b8[@]}" --prompt-len 2048 --gen-len 16 --batch 1 --context 1024 --reps 1 --max-num-batched-tokens 2048 \
        --no-floor 2>&1 | log
    TD_CUDA_PROFILE=1 "${b8[@]}" --prompt-len 1024 --context 1024 --gen-len 16 --batch 64 --reps 1 --max-num-batched-tokens 2048 \
        --no-floor 2>&1 | log
    echo "== whole steps on the GPU, graphs on (TD_CUDA_PROFILE=2), against the wall clock above" | log
    TD_CUDA_PROFILE=2 "${b8[@]}" --prompt-len 2048 --gen-len 32 --batch 1 --context 1024 --reps 1 --max-num-batched-tokens 2048 \
        --no-floor 2>&1 | log
fi
