#!/usr/bin/env bash
# `tandem mkmodel` as a user runs it: bad flags exit 2 with a message naming the
# problem, and a valid run writes a model and prints a one-line summary.
# Needs TD_BIN (the tandem binary); ctest sets it, TD_SHARED_DIR as well.
set -euo pipefail
: "${TD_BIN:?set TD_BIN to the tandem binary}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

# expect_usage_error "substring of stderr" args...
expect_usage_error() {
    local want=$1
    shift
    local rc=0
    "$TD_BIN" mkmodel "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] || fail "mkmodel $* exited $rc, expected 2"
    grep -qF -- "$want" "$tmp/err" || fail "mkmodel $*: stderr lacks '$want': $(cat "$tmp/err")"
}

expect_usage_error "unknown option '--bogus'" --out "$tmp/x.gguf" --bogus 1
expect_usage_error "--out PATH is required" --preset tiny
expect_usage_error "unknown preset 'huge'" --out "$tmp/x.gguf" --preset huge
expect_usage_error "--heads 3 does not divide --dim 128" --out "$tmp/x.gguf" --heads 3
expect_usage_error "--kv-heads 3 does not divide --heads 4" --out "$tmp/x.gguf" --kv-heads 3
expect_usage_error "--dim 0 is out of range" --out "$tmp/x.gguf" --dim 0
expect_usage_error "unknown --type 'q5_k'" --out "$tmp/x.gguf" --type q5_k
expect_usage_error "unknown --arch 'gpt2'" --out "$tmp/x.gguf" --arch gpt2
expect_usage_error "invalid value 'abc' for option '--layers'" --out "$tmp/x.gguf" --layers abc
expect_usage_error "multiple of 32" --out "$tmp/x.gguf" --type q4_0 --ffn 100
[ ! -e "$tmp/x.gguf" ] || fail "a failed run left a file behind"

"$TD_BIN" mkmodel --help | grep -q -- "--vocab-from" || fail "--help does not list --vocab-from"

# A valid run, then the same shape with a copied vocabulary.
"$TD_BIN" mkmodel --out "$tmp/tiny.gguf" --preset tiny --type q8_0 --seed 5 >"$tmp/out"
grep -q "wrote $tmp/tiny.gguf: llama 0.919M params, vocab 512, q8_0" "$tmp/out" ||
    fail "unexpected summary: $(cat "$tmp/out")"
[ -s "$tmp/tiny.gguf" ] || fail "no file written"
if [ -n "${TD_SHARED_DIR:-}" ] && [ -f "$TD_SHARED_DIR/tokenizer/ggml-vocab-llama-spm.gguf" ]; then
    "$TD_BIN" mkmodel --out "$tmp/spm.gguf" --arch qwen2 --layers 2 \
        --vocab-from "$TD_SHARED_DIR/tokenizer/ggml-vocab-llama-spm.gguf" >"$tmp/out"
    grep -q "qwen2 .* vocab 32000, f16" "$tmp/out" || fail "unexpected summary: $(cat "$tmp/out")"
fi
echo "ok"
