/*
 * engine/sched.c - continuous batching: admission, chunked prefill, preemption,
 * the step, sampling, stop conditions and outputs.
 *
 * A step takes at most max_num_batched_tokens tokens:
 *   1. running requests, oldest first: one token each when decoding, or the next
 *      chunk of their prompt; when the pool runs dry the newest running request is
 *      preempted (its blocks freed, back to the front of the waiting queue, to be
 *      recomputed later);
 *   2. then, if nothing was preempted, waiting requests in order, each starting
 *      after the longest prefix the cache already holds.
 * The whole batch runs through one forward pass.
 */
#include "engine/engine_internal.h"
#ifdef TD_HAVE_CUDA
#include "backend/cuda/cuda_fwd.h"
#endif

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TD_HAVE_CUDA
/* TD_CUDA_SAMPLE=0: rows that sample (temperature, top-k, top-p) bring their logits to the
 * host and sample there, as before the device sampler (for A/B runs). */
static bool device_sampling(void)
{
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("TD_CUDA_SAMPLE");
        on = !(v && !strcmp(v, "0"));
    }
    return on;
}
#endif

/* ---- outputs ---------------------------------------------------------------- */

static int arena_put(td_engine *e, const char *s, size_t n, size_t *off)
{
    if (e->arena_len + n + 1 > e->arena_cap) {
        size_t cap = TD_MAX(e->arena_cap * 2, e->arena_len + n + 1024);
        char *a = realloc(e->arena, cap);
        if (!a) return TD_ENOMEM;
        e->arena = a;
        e->arena_cap = cap;
    }
    *off = e->arena_len;
    if (n) memcpy(e->arena + e->arena_len, s, n);
    e->arena[e->arena_len + n] = '\0';
    e->arena_len += n + 1;
    return 0;
}

static void out_push(td_engine *e, req *r, int32_t token, const char *text, size_t len,
                     td_finish finish, const char *error)
{
    if (e->n_outs == e->cap_outs) {
        int cap = e->cap_outs ? e->cap_outs * 2 : 64;
        out_rec *o = realloc(e->outs, (size_t)cap * sizeof(out_rec));
        TD_ASSERT(o); /* a few bytes per live request; failing here is not recoverable */
        e->outs = o;
        e->cap_outs = cap;
    }
    out_rec *o = &e->outs[e->n_outs++];
    memset(o, 0, sizeof(*o));
    if (arena_put(e, text, len, &o->text_off) != 0) {
        len = 0;
        TD_ASSERT(arena_put(e, "", 0, &o->text_off) == 0);
    }
    o->out.id = r->id;
    o->out.token = token;
    o->out.text_len = (int)len;
    o->out.finish = finish;
    o->out.num_prompt_tokens = r->n_prompt;
    o->out.num_cached_tokens = r->n_cached_prompt;
    o->out.num_generated = r->n_generated;
    o->out.num_preemptions = r->n_preemptions;
    o->out.t_arrival = r->t_arrival;
    o->out.t_first_scheduled = r->t_first_scheduled;
    o->out.t_first_token = r->t_first_token;
    o->out.t_kv_loaded = r->t_kv_loaded;
    if (error) snprintf(o->error, sizeof(o->error), "%s", error);
}

/* ---- blocks ----------------------------------------------------------------- */

void sched__release_blocks(td_engine *e, req *r)
{
    /* Release in reverse so that a request's tail blocks are evicted before its head,
     * which other requests are more likely to share. */
    for (int i = r->n_blocks - 1; i >= 0; i--) kv_release(&e->kv, r->blocks[i]);
    r->n_blocks = 0;
    r->n_hashed = 0;
    r->n_computed = 0;
}

void sched__finish(td_engine *e, req *r, td_finish why, const char *error)
{
    sched__release_blocks(e, r);
    out_push(e, r, -1, "", 0, why, error);
    req__free(r);
}

/* Make sure r has blocks for its first n_tokens tokens. On failure nothing is kept. */
static bool ensure_blocks(td_engine *e, req *r, int n_tokens)
{
    int need = (n_tokens + e->kv.block_size - 1) / e->kv.block_size;
    if (need <= r->n_blocks) return true;
    if (need - r->n_blocks > e->kv.n_free) return false;
    while (r->n_blocks < need) r->blocks[r->n_blocks++] = kv_alloc(&e->kv);
    return true;
}

/* Hash (and index) every block that is full and computed. */
static void register_full_blocks(td_engine *e, req *r)
{
    int bs = e->kv.block_size;
    while (r->n_hashed < r->n_blocks && (r->n_hashed + 1) * bs <= r->n_computed) {
        int i = r->n_hashed;
        uint64_t parent = i ? r->block_hash[i - 1] : e->root_hash;
        r->block_hash[i] = kv_block_hash(parent, r->tokens + (size_t)i * bs, bs);
        if (e->cfg.enable_prefix_caching) kv_register(&e->kv, r->blocks[i], r->block_hash[i]);
        r->n_hashed++;
    }
}

/* Start r from the longest cached prefix (at most n_tokens - 1 tokens, because the last
 * token must be computed to produce logits). */
static void lookup_prefix(td_engine *e, req *r)
{
    if (!e->cfg.enable_prefix_caching || r->n_blocks) return;
    int bs = e->kv.block_size;
    int max_blocks = (r->n_tokens - 1) / bs;
    uint64_t parent = e->root_hash;
    for (int i = 0; i < max_blocks; i++) {
        uint64_t h = kv_block_hash(parent, r->tokens + (size_t)i * bs, bs);
        int b = kv_lookup(&e->kv, h);
        if (b < 0) break;
        r->blocks[r->n_blocks] = b;
        r->block_hash[r->n_blocks] = h;
        r->n_blocks++;
        parent = h;
    }
    r->n_hashed = r->n_blocks;
    r->n_computed = r->n_blocks * bs;
}

/* A request admitted for the first time counts in the prefix cache's statistics once:
 * not the lookups of a request that waits for blocks (one a step), nor a preempted one
 * finding its own blocks again. */
static void count_prefix(td_engine *e, const req *r)
{
    if (!e->cfg.enable_prefix_caching || r->admitted_once) return;
    e->stats.prefix_queries_tokens += (uint64_t)r->n_tokens;
    e->stats.prefix_hits_tokens += (uint64_t)r->n_computed;
}

/* The newest running request that may be preempted (a LOADING one may not: its blocks
 * are being written by the transfer engine). Removed from the running list. */
static req *pop_victim(td_engine *e)
{
    for (int i = e->n_running - 1; i >= 0; i--) {
        req *v = e->running[i];
        if (v->state == REQ_LOADING) continue;
        memmove(&e->running[i], &e->running[i + 1], (size_t)(e->n_running - i - 1) * sizeof(req *));
        e->n_running--;
        return v;
    }
    return NULL;
}

static void preempt(td_engine *e, req *r)
{
    if (r->stream_layers && e->layer_fn) {
        td_layer_progress p = {.id = r->id, .n_done = 0, .n_prompt = r->n_prompt};
        e->layer_fn(e->layer_user, -1, &p, 1);
    }
    sched__release_blocks(e, r);
    r->state = REQ_WAITING;
    r->n_preemptions++;
    e->stats.num_preemptions++;
    TD_ASSERT(e->n_waiting < e->cap_waiting); /* reserved by td_engine_add_request */
    memmove(&e->waiting[1], &e->waiting[0], (size_t)e->n_waiting * sizeof(req *));
    e->waiting[0] = r;
    e->n_waiting++;
}

/* ---- log-probabilities ------------------------------------------------------ */

/* log p(tok) under softmax(logits) and the n most likely tokens, best first (ties: lower id).
 * Fills the newest output record. */
static void fill_logprobs(td_engine *e, const float *logits, int32_t tok, int n)
{
    const int n_vocab = e->model->shape.n_vocab;
    float maxl = logits[0];
    for (int i = 1; i < n_vocab; i++) maxl = fmaxf(maxl, logits[i]);
    double sum = 0;
    for (int i = 0; i < n_vocab; i++) sum += exp((double)(logits[i] - maxl));
    float lse = maxl + (float)log(sum);
    out_rec *o = &e->outs[e->n_outs - 1];
    o->out.logprob = logits[tok] - lse;
    /* Insertion into a sorted array of n: O(vocab) for the common case of small n. */
    int k = 0;
    for (int i = 0; i < n_vocab; i++) {
        float v = logits[i];
        if (k == n && v <= logits[o->top_ids[n - 1]]) continue;
        int j = k < n ? k++ : n - 1;
        while (j > 0 && logits[o->top_ids[j - 1]] < v) {
            o->top_ids[j] = o->top_ids[j - 1];
            j--;
        }
        o->top_ids[j] = i;
    }
    for (int j = 0; j < k; j++) o->top_logprobs[j] = logits[o->top_ids[j]] - lse;
    o->out.n_top = k;
}

/* ---- stop conditions -------------------------------------------------------- */

static bool is_stop_token(const td_engine *e, const req *r, int32_t tok)
{
    if (!r->ignore_eos && tok_is_eog(e->tok, tok)) return true;
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == tok) return true;
    return false;
}

static int text_append(req *r, const char *s, size_t n)
{
    if (r->text_len + n + 1 > r->text_cap) {
        size_t cap = TD_MAX(r->text_cap * 2, r->text_len + n + 256);
        char *t = realloc(r->text, cap);
        if (!t) return TD_ENOMEM;
        r->text = t;
        r->text_cap = cap;
    }
    memcpy(r->text + r->text_len, s, n);
    r->text_len += n;
    r->text[r->text_len] = '\0';
    return 0;
}

/* Find the earliest stop string in text[from..). Returns its offset or -1; *len its length. */
static long find_stop(const req *r, size_t from, size_t *len)
{
    long best = -1;
    if (!r->text || from >= r->text_len) return -1; /* no text yet (memmem wants a buffer) */
    for (int i = 0; i < r->n_stop; i++) {
        const char *hit = memmem(r->text + from, r->text_len - from, r->stop[i], strlen(r->stop[i]));
        if (hit && (best < 0 || hit - r->text < best)) {
            best = hit - r->text;
            *len = strlen(r->stop[i]);
        }
    }
    return best;
}

/* Bytes at the end of the text that could still grow into a stop string: held back. */
static size_t held_back(const req *r)
{
    size_t hold = 0;
    for (int i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (size_t k = TD_MIN(sl - 1, r->text_len - r->emitted); k > hold; k--)
            if (!memcmp(r->text + r->text_len - k, r->stop[i], k)) {
                hold = k;
                break;
            }
    }
    return hold;
}

/* Keep a finished producer request's prompt blocks for its consumer; the newest output
 * (its final one) names them. Blocks past the prompt are released. */
static void hold_blocks(td_engine *e, req *r)
{
    int keep = TD_MIN(r->n_blocks, (r->n_prompt + e->kv.block_size - 1) / e->kv.block_size);
    int32_t *copy = keep > 0 ? malloc((size_t)keep * sizeof(int32_t)) : NULL;
    bool room = true;
    if (copy && e->n_holds == e->cap_holds) {
        int cap = e->cap_holds ? e->cap_holds * 2 : 16;
        kv_hold *g = realloc(e->holds, (size_t)cap * sizeof(*g));
        if (g) {
            e->holds = g;
            e->cap_holds = cap;
        } else {
            room = false;
        }
    }
    if (!copy || !room) { /* out of memory: nothing is held; the consumer recomputes */
        free(copy);
        sched__release_blocks(e, r);
        return;
    }
    memcpy(copy, r->blocks, (size_t)keep * sizeof(int32_t));
    for (int i = r->n_blocks - 1; i >= keep; i--) kv_release(&e->kv, r->blocks[i]);
    r->n_blocks = 0; /* the references now belong to the hold */
    r->n_hashed = 0;
    r->n_computed = 0;
    e->holds[e->n_holds++] = (kv_hold){r->id, copy, keep};
    e->stats.num_held = e->n_holds;
    e->stats.num_blocks_held += keep;
    out_rec *o = &e->outs[e->n_outs - 1];
    o->out.kv_blocks = copy;
    o->out.n_kv_blocks = keep;
}

/* A request that ends here releases (or holds) its blocks and is marked finished; the
 * step frees it. */
static void end_request(td_engine *e, req *r, td_finish why, const char *error)
{
    if (error) out_push(e, r, -1, "", 0, why, error);
    if (r->hold && !error && (why == TD_FINISH_STOP || why == TD_FINISH_LENGTH))
        hold_blocks(e, r);
    else
        sched__release_blocks(e, r);
    r->finished = true;
}

/* Account for a sampled token: stop checks, text, output. logits may be NULL (a token
 * that came from a producer): then no log-probabilities. */
static void accept_token(td_engine *e, req *r, int32_t tok, const float *logits)
{
    if (!r->t_first_token) r->t_first_token = td_now_s();
    r->tokens[r->n_tokens++] = tok;
    r->n_generated++;
    td_finish fin = TD_FINISH_NONE;
    char piece[3 * (TOK_MAX_PIECE + 3) + 8]; /* every byte of a piece may become U+FFFD */
    size_t emit_from = r->emitted, emit_to, stream_to;
    if (is_stop_token(e, r, tok)) {
        fin = TD_FINISH_STOP;
    } else {
        /* An id past the tokenizer's vocabulary (models may pad their output rows) has no
         * text: it still counts as a generated token. */
        int n = tok_stream_push(&r->ts, tok, piece, sizeof(piece));
        if (n > 0 && text_append(r, piece, (size_t)n) != 0) {
            end_request(e, r, TD_FINISH_ERROR, "out of memory for the generated text");
            return;
        }
    }
    bool length = r->n_generated >= r->max_tokens || r->n_tokens >= e->max_model_len;
    if (fin == TD_FINISH_NONE && length) fin = TD_FINISH_LENGTH;
    /* What a stream that goes on would emit: all but a possible stop string's start. */
    stream_to = r->text_len - held_back(r);
    if (fin != TD_FINISH_NONE) {
        /* The sequence is over: bytes of an unfinished character come out as U+FFFD. */
        int n = tok_stream_flush(&r->ts, piece, sizeof(piece));
        if (n > 0) (void)text_append(r, piece, (size_t)n);
    }
    size_t stop_len = 0;
    /* A stop string cannot begin before emitted: held_back() made sure of that. */
    long at = r->n_stop ? find_stop(r, r->emitted, &stop_len) : -1;
    if (at >= 0) {
        fin = TD_FINISH_STOP;
        emit_to = (size_t)at + (r->include_stop_str ? stop_len : 0);
        stream_to = emit_to; /* final either way */
    } else if (fin != TD_FINISH_NONE) {
        emit_to = r->text_len;
    } else {
        emit_to = stream_to;
    }
    stream_to = TD_MAX(emit_from, TD_MIN(stream_to, emit_to));
    r->emitted = emit_to;
    out_push(e, r, tok, r->text + emit_from, emit_to - emit_from, fin, NULL);
    td_output *po = &e->outs[e->n_outs - 1].out;
    po->text_flush_len = TD_MIN(po->text_len, (int)(emit_to - stream_to));
    if (r->logprobs > 0 && logits) fill_logprobs(e, logits, tok, r->logprobs);
    if (fin != TD_FINISH_NONE) end_request(e, r, fin, NULL);
}

/* ---- the step --------------------------------------------------------------- */

static void drop_polled_outputs(td_engine *e)
{
    if (e->next_out >= e->n_outs) {
        e->n_outs = e->next_out = 0;
        e->arena_len = 0;
    }
}

static void step_kv_stored(void *user, int layer)
{
    td_engine *e = user;
    e->layer_fn(e->layer_user, layer, e->lp, e->n_lp);
}

/* The expert-parallel group broke during this step's forward pass: its n_sched requests
 * end with the group's reason (the others end when the loop stops), and the step fails. */
static int ep_failed(td_engine *e, int n_sched, td_err *err)
{
    char why[200];
    td_ep_broken(e->fwd.ep, why, sizeof(why));
    TD_ERROR("engine: %s", why);
    for (int s = 0; s < n_sched; s++) end_request(e, e->b_reqs[s], TD_FINISH_ERROR, why);
    int w = 0;
    for (int i = 0; i < e->n_running; i++) {
        if (e->running[i]->finished) req__free(e->running[i]);
        else e->running[w++] = e->running[i];
    }
    e->n_running = w;
    return td_err_set(err, TD_EIO, "%s", why);
}

/* The host's sampling of a step's rows, split over the pool: job row k is scheduled request
 * b_samp_s[k] with logits row b_tok[k] (replaced by its token). */
typedef struct samp_job {
    td_engine *e;
    int n, n_vocab;
} samp_job;

/*
 * A request's logit changes (td_sampling: logit_bias, then repetition, frequency and
 * presence penalties, vLLM's order) on a copy of its row in s->pen; the row itself stays
 * as the model gave it, for the log-probabilities. Each row on its own: the same tokens
 * whatever else is in the batch.
 */
/* A changed logit stays finite (a tiny repetition penalty divides a positive one towards
 * infinity): the sampler's arithmetic needs finite differences. */
static float clamp_logit(float v)
{
    return v > 1e30f ? 1e30f : v < -1e30f ? -1e30f : v == v ? v : -1e30f;
}

static const float *penalize(const req *r, const float *row, int n_vocab, sampler_scratch *s)
{
    float *p = s->pen;
    memcpy(p, row, (size_t)n_vocab * sizeof(float));
    for (int i = 0; i < r->n_bias; i++)
        p[r->bias_ids[i]] += r->bias[i];
    const int32_t *out = r->tokens + r->n_prompt;
    const int n_out = r->n_tokens - r->n_prompt;
    /* seen: bit 0, repetition applied (prompt and output); bit 1, presence (output) */
    if (r->repetition != 1.0f)
        for (int i = 0; i < r->n_tokens; i++) {
            int32_t t = r->tokens[i];
            if (t < 0 || t >= n_vocab || (s->seen[t] & 1)) continue;
            s->seen[t] |= 1;
            p[t] = p[t] > 0 ? p[t] / r->repetition : p[t] * r->repetition;
        }
    for (int i = 0; i < n_out; i++) {
        int32_t t = out[i];
        if (t < 0 || t >= n_vocab) continue;
        p[t] -= r->frequency;
        if (!(s->seen[t] & 2)) {
            s->seen[t] |= 2;
            p[t] -= r->presence;
        }
    }
    for (int i = 0; i < r->n_tokens; i++) { /* back to zero for the next row */
        int32_t t = r->tokens[i];
        if (t < 0 || t >= n_vocab) continue;
        s->seen[t] = 0;
        p[t] = clamp_logit(p[t]);
    }
    for (int i = 0; i < r->n_bias; i++)
        p[r->bias_ids[i]] = clamp_logit(p[r->bias_ids[i]]);
    return p;
}

static void samp_rows(void *ctx, int ith, int nth)
{
    samp_job *j = ctx;
    td_engine *e = j->e;
    int64_t b, end;
    td_split_range(j->n, ith, nth, &b, &end);
    for (int64_t k = b; k < end; k++) {
        req *r = e->b_reqs[e->b_samp_s[k]];
        const float *row = e->logits + (size_t)e->b_tok[k] * j->n_vocab;
        if (r->penalized) row = penalize(r, row, j->n_vocab, &e->samp[ith]);
        e->b_tok[k] = sampler_sample(&r->sp, row, j->n_vocab, &r->rng, &e->samp[ith]);
    }
}

const double td_step_seconds_bounds[TD_STEP_TIME_BUCKETS] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};

/* A step of T tokens (prefill: some were prompt tokens) that took ns. */
static void count_step(td_engine *e, int T, bool prefill, uint64_t ns)
{
    td_engine_stats *st = &e->stats;
    int b = 0;
    while (b < TD_STEP_TOKEN_BUCKETS && T > 1 << b)
        b++;
    st->step_tokens_hist[b]++;
    double s = (double)ns / 1e9;
    for (b = 0; b < TD_STEP_TIME_BUCKETS && s > td_step_seconds_bounds[b];)
        b++;
    st->step_time_hist[b]++;
    if (prefill) {
        st->steps_prefill++;
        st->step_ns_prefill += ns;
    } else {
        st->step_ns_decode += ns;
    }
}

int sched__step(td_engine *e, td_err *err)
{
    (void)err;
    drop_polled_outputs(e);
    int budget = e->max_batched;
    int n_sched = 0;
    bool preempted = false;

    /* 1. Running requests, oldest first (those whose KV is being copied in wait). */
    for (int i = 0; i < e->n_running && budget > 0; i++) {
        req *r = e->running[i];
        if (r->state == REQ_LOADING) continue;
        int n = TD_MIN(r->n_tokens - r->n_computed, budget);
        TD_ASSERT(n > 0);
        bool self_preempted = false;
        while (!ensure_blocks(e, r, r->n_computed + n)) {
            req *victim = pop_victim(e); /* r itself at worst: never NULL */
            preempt(e, victim);
            preempted = true;
            if (victim == r) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break;
        e->b_reqs[n_sched] = r;
        e->b_n[n_sched] = n;
        n_sched++;
        budget -= n;
    }

    /* 2. Waiting requests, if the pool is not under pressure. */
    while (!preempted && budget > 0 && e->n_waiting > 0 && e->n_running < e->max_num_seqs) {
        req *r = e->waiting[0];
        if (!r->admitted_once) {
            lookup_prefix(e, r);
            r->n_cached_prompt = r->n_computed;
        } else {
            lookup_prefix(e, r); /* a preempted request may find its own blocks again */
        }
        if (r->remote) {
            /* Blocks for the whole prompt now; the caller copies its KV in (no compute). */
            if (!ensure_blocks(e, r, r->n_prompt)) {
                sched__release_blocks(e, r);
                break;
            }
            memmove(&e->waiting[0], &e->waiting[1], (size_t)(e->n_waiting - 1) * sizeof(req *));
            e->n_waiting--;
            TD_ASSERT(e->n_running < e->cap_running);
            e->running[e->n_running++] = r;
            r->state = REQ_LOADING;
            e->n_loading++;
            count_prefix(e, r);
            r->admitted_once = true;
            r->kv_skip = r->n_computed / e->kv.block_size;
            if (!r->t_first_scheduled) r->t_first_scheduled = td_now_s();
            out_push(e, r, -1, "", 0, TD_FINISH_NONE, NULL);
            out_rec *o = &e->outs[e->n_outs - 1];
            o->out.kv_load = true;
            o->out.kv_blocks = r->blocks;
            o->out.n_kv_blocks = r->n_blocks;
            o->out.kv_skip = r->kv_skip;
            if (e->load_fn) e->load_fn(e->load_user, r->id, r->blocks, r->n_blocks, r->kv_skip);
            continue;
        }
        int n = TD_MIN(r->n_tokens - r->n_computed, budget);
        if (!ensure_blocks(e, r, r->n_computed + n)) {
            sched__release_blocks(e, r); /* could fit later: keep waiting */
            break;
        }
        memmove(&e->waiting[0], &e->waiting[1], (size_t)(e->n_waiting - 1) * sizeof(req *));
        e->n_waiting--;
        TD_ASSERT(e->n_running < e->cap_running); /* reserved by td_engine_add_request */
        e->running[e->n_running++] = r;
        r->state = REQ_RUNNING;
        count_prefix(e, r);
        r->admitted_once = true;
        if (!r->t_first_scheduled) r->t_first_scheduled = td_now_s();
        e->b_reqs[n_sched] = r;
        e->b_n[n_sched] = n;
        n_sched++;
        budget -= n;
    }
    if (n_sched == 0) {
        /* Expert parallelism: every rank runs one forward pass per step, an empty one
         * included (it runs the experts this rank holds for the others). */
        if (e->fwd.ep) {
            fwd_batch none = {0};
            if (fwd_run(&e->fwd, &none)) return ep_failed(e, 0, err);
        }
        return 0;
    }

    /* Build the flat batch. */
    const uint64_t t_step = td_now_ns();
    int T = 0, n_logits = 0;
    for (int s = 0; s < n_sched; s++) {
        req *r = e->b_reqs[s];
        e->b_tables[s] = r->blocks;
        for (int j = 0; j < e->b_n[s]; j++) {
            e->b_tokens[T] = r->tokens[r->n_computed + j];
            e->b_pos[T] = r->n_computed + j;
            e->b_seq[T] = s;
            T++;
        }
        if (r->n_computed + e->b_n[s] == r->n_tokens) e->b_logit_rows[n_logits++] = T - 1;
    }
    fwd_batch b = {.n_tokens = T, .tokens = e->b_tokens, .pos = e->b_pos, .seq = e->b_seq,
                   .block_tables = e->b_tables, .n_logits = n_logits,
                   .logit_rows = e->b_logit_rows, .logits = e->logits};
    /* Streaming producers: report each layer's progress while the step runs. */
    e->n_lp = 0;
    for (int s = 0; e->layer_fn && s < n_sched; s++) {
        req *r = e->b_reqs[s];
        if (!r->stream_layers || r->n_computed >= r->n_prompt) continue;
        e->lp[e->n_lp++] = (td_layer_progress){.id = r->id,
                                               .n_done = TD_MIN(r->n_computed + e->b_n[s],
                                                                r->n_prompt),
                                               .n_prompt = r->n_prompt,
                                               .blocks = r->blocks};
    }
    if (e->n_lp) {
        b.kv_stored = step_kv_stored;
        b.kv_user = e;
    }
    /* On the GPU, rows without logprobs are sampled there (greedy, or as sampler_sample
     * with the request's next random draw); only the other rows' logits come to the host. */
    bool device_argmax = false;
#ifdef TD_HAVE_CUDA
    if (e->cuda) {
        device_argmax = true;
        for (int s = 0, li = 0; s < n_sched; s++) {
            req *r = e->b_reqs[s];
            if (r->n_computed + e->b_n[s] < r->n_tokens) continue;
            bool greedy = r->sp.temperature <= 0.0f || r->sp.top_k == 1;
            e->b_need[li] = r->logprobs > 0 || r->penalized || (!greedy && !device_sampling());
            /* the one draw sampler_sample would make, in the same place of the stream */
            float u = !greedy && !e->b_need[li] ? td_rng_float(&r->rng) : 0.0f;
            e->b_samp[li++] = (td_cuda_sample){.temperature = r->sp.temperature,
                                               .top_p = r->sp.top_p,
                                               .min_p = r->sp.min_p,
                                               .u = u,
                                               .top_k = r->sp.top_k};
        }
        td_err ce = {0};
        if (td_cuda_fwd_run(e->cuda, T, b.tokens, b.pos, b.seq, b.block_tables, n_sched,
                            n_logits, b.logit_rows, b.logits, e->b_need, e->b_samp, e->b_argmax,
                            &ce)) {
            /* A device failure ends the step's requests with the error (never a retry loop
             * that leaves them waiting), and they leave the running list. */
            TD_ERROR("engine: %s", ce.msg);
            char msg[300];
            snprintf(msg, sizeof(msg), "the GPU forward pass failed: %s", ce.msg);
            for (int s = 0; s < n_sched; s++) end_request(e, e->b_reqs[s], TD_FINISH_ERROR, msg);
            int w = 0;
            for (int i = 0; i < e->n_running; i++) {
                if (e->running[i]->finished) req__free(e->running[i]);
                else e->running[w++] = e->running[i];
            }
            e->n_running = w;
            return td_err_set(err, ce.code, "%s", ce.msg);
        }
    } else
#endif
        if (fwd_run(&e->fwd, &b))
            return ep_failed(e, n_sched, err);
    e->stats.steps++;

    /* Sample the rows the host samples, in parallel over the pool (each request has its
     * own RNG, each thread its own scratch); then emit in order, and drop finished
     * requests from the running list. */
    const int n_vocab = e->model->shape.n_vocab;
    samp_job job = {.e = e, .n = 0, .n_vocab = n_vocab};
    for (int s = 0, li = 0; s < n_sched; s++) {
        req *r = e->b_reqs[s];
        if (r->n_computed + e->b_n[s] < r->n_tokens) continue;
        if (!(device_argmax && !e->b_need[li])) {
            e->b_samp_s[job.n] = s;
            e->b_tok[job.n++] = li;
        }
        li++;
    }
    const uint64_t prefilled = e->stats.tokens_prefilled;
    /* (a GPU engine never runs its CPU pool: running it would pin this thread) */
    if (job.n > 1 && !device_argmax) td_pool_run(e->pool, samp_rows, &job);
    else if (job.n > 0) samp_rows(&job, 0, 1);
    int li = 0, k = 0;
    for (int s = 0; s < n_sched; s++) {
        req *r = e->b_reqs[s];
        bool decode = r->n_tokens - r->n_computed == 1 && r->n_generated > 0;
        if (decode) e->stats.tokens_decoded++;
        else e->stats.tokens_prefilled += (uint64_t)e->b_n[s];
        r->n_computed += e->b_n[s];
        register_full_blocks(e, r);
        if (r->n_computed < r->n_tokens) continue; /* mid-prompt chunk: nothing to sample */
        const float *row = e->logits + (size_t)li * n_vocab;
        int32_t tok;
        if (device_argmax && !e->b_need[li]) {
            tok = e->b_argmax[li];
            row = NULL;
        } else {
            TD_ASSERT(k < job.n && e->b_samp_s[k] == s);
            tok = e->b_tok[k++];
        }
        if (r->forced_token >= 0) { /* a remote request recomputed after a failed load */
            tok = r->forced_token;
            r->forced_token = -1;
        }
        li++;
        accept_token(e, r, tok, row);
    }
    /* Finished requests leave the running list here, and only here, so that the loop
     * above never sees a freed request. */
    int w = 0;
    for (int i = 0; i < e->n_running; i++) {
        if (e->running[i]->finished) req__free(e->running[i]);
        else e->running[w++] = e->running[i];
    }
    e->n_running = w;
    count_step(e, T, e->stats.tokens_prefilled != prefilled, td_now_ns() - t_step);
    return T;
}

/* ---- disaggregation ---------------------------------------------------------- */

static int find_running(const td_engine *e, uint64_t id)
{
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i]->id == id) return i;
    return -1;
}

static void drop_running(td_engine *e, int i)
{
    memmove(&e->running[i], &e->running[i + 1], (size_t)(e->n_running - i - 1) * sizeof(req *));
    e->n_running--;
}

int sched__kv_loaded(td_engine *e, uint64_t id, int status, bool recompute, const char *msg,
                     int32_t first_token)
{
    int i = find_running(e, id);
    if (i < 0 || e->running[i]->state != REQ_LOADING) return TD_ENOTFOUND;
    req *r = e->running[i];
    if (first_token >= e->model->shape.n_vocab) first_token = -1;
    if (first_token >= 0) r->first_token = first_token;
    if (status == 0 && r->first_token < 0) {
        status = TD_EPROTO;
        msg = "the KV arrived without the producer's first token";
    }
    e->n_loading--;
    r->remote = false;
    r->t_kv_loaded = td_now_s();
    if (r->abort_pending) {
        drop_running(e, i);
        sched__finish(e, r, TD_FINISH_ABORT, NULL);
        return 0;
    }
    int bs = e->kv.block_size;
    if (status == 0) {
        e->stats.kv_loads++;
        e->stats.kv_tokens_loaded += (uint64_t)(r->n_prompt - r->kv_skip * bs);
        e->stats.kv_tokens_skipped += (uint64_t)(r->kv_skip * bs);
        r->n_computed = r->n_prompt;
        register_full_blocks(e, r);
        r->state = REQ_RUNNING;
        /* The producer sampled the first token; keep the RNG where it would be had we
         * sampled it here, so seeded sampling continues exactly as in one engine. */
        if (r->sp.temperature > 0.0f && r->sp.top_k != 1) (void)td_rng_float(&r->rng);
        accept_token(e, r, r->first_token, NULL);
        if (r->finished) {
            drop_running(e, i);
            req__free(r);
        }
        return 0;
    }
    e->stats.kv_load_failures++;
    if (!recompute) {
        drop_running(e, i);
        sched__finish(e, r, TD_FINISH_ERROR, msg && msg[0] ? msg : "the KV transfer failed");
        return 0;
    }
    /* Recompute from the prefix-cache hits: the rest of the blocks may hold anything, and
     * the forward pass overwrites each position's K/V before attention reads it. */
    r->n_computed = r->kv_skip * bs;
    r->state = REQ_RUNNING;
    r->forced_token = r->first_token;
    return 0;
}

int sched__kv_release(td_engine *e, uint64_t id)
{
    for (int i = 0; i < e->n_holds; i++) {
        if (e->holds[i].id != id) continue;
        kv_hold h = e->holds[i];
        e->holds[i] = e->holds[--e->n_holds];
        for (int j = h.n_blocks - 1; j >= 0; j--) kv_release(&e->kv, h.blocks[j]);
        free(h.blocks);
        e->stats.num_held = e->n_holds;
        e->stats.num_blocks_held -= h.n_blocks;
        return 0;
    }
    return TD_ENOTFOUND;
}

int td_engine_step(td_engine *e, td_err *err)
{
    uint64_t steps = e->stats.steps;
    if (td_engine_has_work(e)) lend__begin(e);
    int rc = sched__step(e, err);
    /* Nothing left to compute (or nothing this step could): lend the CPUs out. */
    lend__end(e, !td_engine_has_work(e) || e->stats.steps == steps);
    return rc;
}
