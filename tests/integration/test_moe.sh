#!/usr/bin/env bash
# Models with experts through the command line: `tandem mkmodel` writes the MoE presets
# (with --experts/--experts-used overrides, and clear usage errors), `tandem generate`
# runs them from the file and as dummy weights (the same greedy tokens both ways) and
# refuses them on --device cuda, `tandem serve` answers a completion on one, and
# `tandem bench-engine` prints the active-weight floor lines.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v curl >/dev/null || fail "curl is needed"
command -v jq >/dev/null || fail "jq is needed"

# expect_usage_error "substring of stderr" mkmodel-args...
expect_usage_error() {
    local want=$1
    shift
    local rc=0
    "$TD_BIN" mkmodel "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] || fail "mkmodel $* exited $rc, expected 2: $(cat "$tmp/err")"
    grep -qF -- "$want" "$tmp/err" || fail "mkmodel $*: stderr lacks '$want': $(cat "$tmp/err")"
}
expect_usage_error "--experts-used 9 must be at most --experts 8" --out "$tmp/x.gguf" --preset moe-tiny --experts-used 9
expect_usage_error "--experts 600 is out of range (0..512; 0 = dense)" --out "$tmp/x.gguf" --preset moe-tiny --experts 600
expect_usage_error "qwen2 has no experts (use --arch qwen2moe)" --out "$tmp/x.gguf" --preset moe-tiny --arch qwen2
expect_usage_error "--arch qwen2moe needs --experts N" --out "$tmp/x.gguf" --arch qwen2moe
expect_usage_error "--experts-used, --expert-ffn and --shared-ffn need --experts N" --out "$tmp/x.gguf" --experts-used 2
expect_usage_error "(--expert-ffn and --shared-ffn are for qwen2moe)" --out "$tmp/x.gguf" --preset moe-tiny --expert-ffn 64
expect_usage_error "experts' widths (n_ff_exp 100, n_ff_shexp 256) to be multiples of 32" --out "$tmp/x.gguf" --preset qwen2moe-tiny --expert-ffn 100 --type q8_0
[ ! -e "$tmp/x.gguf" ] || fail "a failed run left a file behind"

# The presets, and overrides of their experts.
"$TD_BIN" mkmodel --out "$tmp/moe.gguf" --preset moe-tiny --type q8_0 --seed 4 >"$tmp/out"
grep -q "llama 1.805M params (8 experts, top-2: 0.625M active), vocab 512, q8_0" "$tmp/out" ||
    fail "unexpected summary: $(cat "$tmp/out")"
"$TD_BIN" mkmodel --out "$tmp/q2.gguf" --preset qwen2moe-tiny --type f16 --seed 4 >"$tmp/out"
grep -q "qwen2moe .* (8 experts, top-4: .* active), vocab 512, f16" "$tmp/out" ||
    fail "unexpected summary: $(cat "$tmp/out")"
"$TD_BIN" mkmodel --out "$tmp/x.gguf" --preset moe-tiny --experts 4 --experts-used 1 >"$tmp/out"
grep -q "(4 experts, top-1:" "$tmp/out" || fail "--experts 4 --experts-used 1: $(cat "$tmp/out")"
"$TD_BIN" mkmodel --out "$tmp/x.gguf" --preset tiny --arch qwen2moe --experts 4 --expert-ffn 64 \
    --shared-ffn 128 --layers 1 >"$tmp/out"
grep -q "qwen2moe .* (4 experts, top-2:" "$tmp/out" || fail "dense preset made qwen2moe: $(cat "$tmp/out")"
"$TD_BIN" mkmodel --out "$tmp/x.gguf" --preset moe-tiny --experts 0 >"$tmp/out"
grep -q "wrote $tmp/x.gguf: llama [0-9.]*M params, vocab 512" "$tmp/out" || fail "--experts 0: $(cat "$tmp/out")"

# generate: from the files, and the same shapes as dummy weights with the same seed
ids=1,306,463,278,101
for m in moe:moe-tiny:q8_0 q2:qwen2moe-tiny:f16; do
    IFS=: read -r file preset type <<<"$m"
    a=$("$TD_BIN" generate --model "$tmp/$file.gguf" --prompt-ids "$ids" -n 16 --ignore-eos --print-ids --threads 2 --log-level warn 2>"$tmp/gen.err")
    b=$("$TD_BIN" generate --load-format dummy --model "$preset" --dtype "$type" --seed 4 --prompt-ids "$ids" -n 16 --ignore-eos --print-ids --threads 1 --log-level warn 2>"$tmp/gen.err")
    [ "$(wc -w <<<"$a")" = 16 ] || fail "$preset: not 16 tokens: '$a'"
    [ "$a" = "$b" ] || fail "$preset: the file gives '$a', dummy weights '$b'"
done
"$TD_BIN" generate --model "$tmp/moe.gguf" --prompt "Once upon a time" -n 8 --log-level warn >"$tmp/out" 2>"$tmp/err" ||
    fail "text generation: $(cat "$tmp/err")"
grep -q "8 generated" "$tmp/err" || fail "text generation: $(cat "$tmp/err")"

# --device cuda refuses a model with experts at start-up, in a CUDA build, before it touches
# the GPU (a build without the backend says that instead, and checks nothing more here)
rc=0
"$TD_BIN" generate --load-format dummy --model moe-tiny --device cuda --prompt-ids "$ids" -n 2 \
    >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -ne 0 ] || fail "--device cuda ran a model with experts"
grep -qF "this build has no CUDA backend" "$tmp/err" ||
    grep -qF "error: --device cuda: the GPU backend does not run mixture-of-experts models yet (llama with 8 experts); use --device cpu" "$tmp/err" ||
    fail "--device cuda with experts: $(cat "$tmp/err")"

# serve: a greedy completion on the qwen2moe model, the same text as the CLI generates
MODEL="$tmp/q2.gguf"
start_server moe
"$TD_BIN" generate --model "$tmp/q2.gguf" --prompt-ids "$ids" -n 8 --ignore-eos --threads 2 \
    --log-level warn >"$tmp/gen.txt" 2>"$tmp/gen.err"
curl -sf "$moe_URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"prompt\": [$ids], \"max_tokens\": 8, \"temperature\": 0, \"ignore_eos\": true}" >"$tmp/resp" ||
    fail "completion failed"
[ "$(jq -r '.choices[0].finish_reason' "$tmp/resp")" = length ] || fail "bad response: $(cat "$tmp/resp")"
[ "$(jq '.usage.completion_tokens' "$tmp/resp")" = 8 ] || fail "bad usage: $(cat "$tmp/resp")"
{ jq -j '.choices[0].text' "$tmp/resp"; echo; } >"$tmp/srv.txt"
cmp -s "$tmp/gen.txt" "$tmp/srv.txt" || fail "serve's text differs from generate's: $(od -c "$tmp/srv.txt" | head -3)"
curl -sf "$moe_URL/v1/models" | grep -q "q2.gguf" || fail "/v1/models does not name the model"

# bench-engine: the floor counts the experts the steps ran
"$TD_BIN" bench-engine --load-format dummy --model moe-tiny --threads 2 --prompt-len 32 --gen-len 8 \
    --reps 1 --log-level warn >"$tmp/bench" 2>&1 || fail "bench-engine: $(cat "$tmp/bench")"
grep -q "^experts: 8 per layer, top-2; one expert is 0.39 MB per layer" "$tmp/bench" ||
    fail "bench-engine: no experts line: $(cat "$tmp/bench")"
grep -q "floor at b1, mean context [0-9]*, 2.00 of 8 experts per layer" "$tmp/bench" ||
    fail "bench-engine: batch 1 must run 2 experts a layer: $(cat "$tmp/bench")"
grep -q "floor at b32, mean context [0-9]*, [0-9.]* of 8 experts per layer" "$tmp/bench" ||
    fail "bench-engine: no batch-32 floor: $(cat "$tmp/bench")"
echo "ok"
