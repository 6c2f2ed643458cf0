#!/usr/bin/env bash
# `tandem generate` as a user runs it: the golden continuation through the CLI, text
# output, dummy weights at a preset shape, and clear errors (exit 2 for usage, 1 for a
# bad model file) for bad flags, bad ids, invalid UTF-8 and broken GGUF files.
set -euo pipefail
: "${TD_BIN:?set TD_BIN to the tandem binary}"
SHARED=${TD_SHARED_DIR:-../shared}
[ -d "$SHARED/models" ] || { echo "shared data missing at '$SHARED': set TD_SHARED_DIR" >&2; exit 1; }
M="$SHARED/models/stories260K.gguf"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# expect RC "substring of stderr" args...
expect() {
    local want_rc=$1 want=$2
    shift 2
    local rc=0
    "$TD_BIN" generate "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq "$want_rc" ] || fail "generate $* exited $rc, expected $want_rc: $(cat "$tmp/err")"
    grep -qF -- "$want" "$tmp/err" || fail "generate $*: stderr lacks '$want': $(cat "$tmp/err")"
}

# The first golden case, token for token.
line=$(head -n 1 "$SHARED/golden/stories260K-greedy.jsonl")
prompt=$(echo "$line" | sed -E 's/.*"prompt_ids": \[([^]]*)\].*/\1/' | tr -d ' ')
want=$(echo "$line" | sed -E 's/.*"output_ids": \[([^]]*)\].*/\1/' | tr -d ',')
got=$("$TD_BIN" generate --model "$M" --prompt-ids "$prompt" -n 24 --print-ids --threads 2 --log-level warn 2>/dev/null)
[ "$got" = "$want" ] || fail "golden mismatch: got '$got' want '$want'"

# The same on one CPU of its own and one borrowed through a CPU board (nobody owns it).
first=$(taskset -pc $$ | sed 's/.*: //; s/[-,].*//') # the first CPU this shell may use
if [ "$(nproc)" -ge 2 ]; then
    got=$("$TD_BIN" generate --model "$M" --prompt-ids "$prompt" -n 24 --print-ids --cpus "$first" \
        --cpu-board "$tmp/board" --log-level warn 2>/dev/null)
    [ "$got" = "$want" ] || fail "golden mismatch with a borrowed CPU: got '$got' want '$want'"
fi

# Text in, text out.
"$TD_BIN" generate --model "$M" --prompt "Once upon a time" -n 8 --log-level warn >"$tmp/out" 2>"$tmp/err"
grep -q "8 generated" "$tmp/err" || fail "text generation: $(cat "$tmp/err")"

# Random weights at a preset shape, no file.
"$TD_BIN" generate --load-format dummy --model tiny --dtype q8_0 --prompt "hello" -n 4 --log-level warn >"$tmp/out" 2>"$tmp/err" ||
    fail "dummy model: $(cat "$tmp/err")"

expect 2 "unknown option '--modle'" --modle "$M" --prompt hi
expect 2 "needs a value" --model "$M" --prompt
expect 2 "invalid value 'x' for option '-n'" --model "$M" --prompt hi -n x
expect 2 "give exactly one of --prompt and --prompt-ids" --model "$M"
expect 2 "--prompt-ids must be comma-separated token ids" --model "$M" --prompt-ids "1,,2"
expect 2 "outside the vocabulary" --model "$M" --prompt-ids 1,99999
expect 2 "--kv-cache-dtype" --model "$M" --prompt hi --kv-cache-dtype q3
expect 2 "dummy weight type 'q3'" --model "$M" --prompt hi --dtype q3
expect 2 "--top-k must be in [0, 1048576]" --model "$M" --prompt hi --top-k 4294967296
# A step workspace this machine cannot hold is refused before it is taken (about 40 GiB for
# 2^20 tokens a step of llama-134m; checked where that is over half the RAM).
ram_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
if [ "$ram_kb" -lt $((78 * 1024 * 1024)) ]; then
    expect 1 "activation workspace for --max-num-batched-tokens 1048576" --load-format dummy \
        --model llama-134m --dtype q4_0 --threads 1 --prompt-ids 1,2 -n 1 --max-num-batched-tokens 1048576
fi
# A negative --sampling-seed seeds the request as the API's seed does (it was ignored).
seeded() { "$TD_BIN" generate --model "$M" --prompt-ids 1,306 -n 12 --temperature 1 --sampling-seed "$1" --print-ids --log-level warn 2>/dev/null | tail -1; }
[ "$(seeded -5)" = "$(seeded -5)" ] || fail "--sampling-seed -5 does not reproduce"
[ "$(seeded -5)" != "$(seeded -6)" ] || fail "--sampling-seed -5 and -6 agree"
expect 2 "maximum context length is 128" --model "$M" --prompt-ids 1,2,3 -n 500
expect 2 "invalid UTF-8" --model "$M" --prompt "$(printf 'ab\xffcd')"
expect 1 "not found" --model "$tmp/nope.gguf" --prompt hi
expect 2 "--cpus: bad CPU list '0-x'" --model "$M" --prompt hi --cpus 0-x
expect 2 "disagree" --model "$M" --prompt hi --cpus "$first" --threads 3
expect 2 "--no-pin-threads" --model "$M" --prompt hi --cpus "$first" --no-pin-threads
echo garbage >"$tmp/notaboard"
expect 1 "not a tandem CPU board" --model "$M" --prompt hi --cpu-board "$tmp/notaboard"

# Broken model files: one clear line, exit 1, never a crash.
printf 'GGUX\003\000\000\000' >"$tmp/magic.gguf"
expect 1 "magic" --model "$tmp/magic.gguf" --prompt hi
head -c 3000 "$M" >"$tmp/trunc.gguf"
expect 1 "truncated" --model "$tmp/trunc.gguf" --prompt hi

# A model that claims a huge context: without --max-model-len and --kv-cache-memory it gets
# the context the default KV budget holds, and says so, instead of a pool sized for 2^24.
"$TD_BIN" mkmodel --out "$tmp/bigctx.gguf" --dim 64 --layers 2 --heads 4 --kv-heads 4 --ffn 128 \
    --vocab 300 --ctx 16777216 --type f32 >/dev/null 2>&1 || fail "mkmodel --ctx 16777216"
"$TD_BIN" generate --model "$tmp/bigctx.gguf" --prompt-ids 1,2,3 -n 2 --threads 1 \
    >"$tmp/big.out" 2>"$tmp/big.err" || fail "huge context: $(cat "$tmp/big.err")"
grep -q "more than the default budget" "$tmp/big.err" || fail "no warning for a huge context: $(cat "$tmp/big.err")"
echo "ok"
