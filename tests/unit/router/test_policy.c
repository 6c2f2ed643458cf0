/* Unit tests for router/policy.c: names, option checks, and the behaviour of each of the
 * five policies (coverage, cycling, load comparison, prefix affinity, eviction, consistent
 * hashing). The .c is included to check the radix trees' size and LRU invariants. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/policy.c"

static rt_policy *make(rt_policy_kind kind, uint64_t seed)
{
    rt_policy_opts o;
    rt_policy_opts_default(&o, kind);
    o.seed = seed;
    rt_policy *p = NULL;
    assert_int_equal(rt_policy_create(&p, &o), 0);
    assert_non_null(p);
    return p;
}

static const char *const URLS[] = {"http://127.0.0.1:8010", "http://127.0.0.1:8011",
                                   "http://127.0.0.1:8012", "http://127.0.0.1:8013",
                                   "http://127.0.0.1:8014", "http://127.0.0.1:8015"};

/* n idle candidates with ids 100, 101, ... */
static void idle(rt_candidate *c, int n)
{
    for (int i = 0; i < n; i++)
        c[i] = (rt_candidate){
            .worker_id = 100 + (uint64_t)i, .url = URLS[i], .in_flight = 0, .reported_load = -1};
}

static void random_text(td_rng *rng, char *buf, size_t len)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = (char)('a' + td_rng_next(rng) % 26);
}

/* Walk every tree: the per-tree and total character counts agree with the nodes, every
 * node sits on the LRU list after all of its descendants, and the total is in budget. */
static size_t check_subtree(const ca_node *x, const ca_tree *t, int *order_of_parent_ok)
{
    size_t chars = x->edge_len;
    for (int i = 0; i < x->n_children; i++) {
        const ca_node *c = x->children[i];
        assert_ptr_equal(c->parent, x);
        assert_ptr_equal(c->tree, t);
        assert_true(c->edge_len > 0);
        /* x (if not the root) must come later on the LRU list than its child c. */
        if (x->parent) {
            const ca_node *y = c;
            while (y && y != x)
                y = y->lru_next;
            if (!y) *order_of_parent_ok = 0;
        }
        chars += check_subtree(c, t, order_of_parent_ok);
    }
    return chars;
}

static void check_trees(const rt_policy *p)
{
    size_t total = 0;
    for (int i = 0; i < p->n_trees; i++) {
        const ca_tree *t = p->trees[i];
        if (i > 0) assert_true(p->trees[i - 1]->worker_id < t->worker_id);
        int ok = 1;
        size_t chars = check_subtree(t->root, t, &ok);
        assert_true(ok);
        assert_int_equal(chars, t->chars);
        total += chars;
    }
    assert_int_equal(total, p->total_chars);
    assert_true(p->total_chars <= p->o.max_tree_chars);
    /* The list holds exactly the non-root nodes, and its head is a leaf. */
    size_t on_list = 0;
    for (const ca_node *x = p->lru_head; x; x = x->lru_next) {
        on_list += x->edge_len;
        if (!x->lru_next) assert_ptr_equal(x, p->lru_tail);
    }
    assert_int_equal(on_list, total);
    if (p->lru_head) assert_int_equal(p->lru_head->n_children, 0);
}

static void test_names(void **state)
{
    (void)state;
    const char *names[] = {"random", "round_robin", "power_of_two", "cache_aware", "prefix_hash"};
    rt_policy_kind kinds[] = {RT_POLICY_RANDOM, RT_POLICY_ROUND_ROBIN, RT_POLICY_POWER_OF_TWO,
                              RT_POLICY_CACHE_AWARE, RT_POLICY_PREFIX_HASH};
    for (size_t i = 0; i < TD_ARRAY_LEN(names); i++) {
        rt_policy_kind k = (rt_policy_kind)99;
        assert_int_equal(rt_policy_parse(names[i], &k), 0);
        assert_int_equal(k, kinds[i]);
        assert_string_equal(rt_policy_name(kinds[i]), names[i]);
    }
    const char *bad[] = {"", "Random", "roundrobin", "cache-aware", "prefix_hash ", "lru"};
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++) {
        rt_policy_kind k = RT_POLICY_CACHE_AWARE;
        assert_int_equal(rt_policy_parse(bad[i], &k), -1);
        assert_int_equal(k, RT_POLICY_CACHE_AWARE); /* untouched on failure */
    }
    assert_int_equal(rt_policy_parse(NULL, NULL), -1);
    assert_non_null(rt_policy_name((rt_policy_kind)42));
}

static void test_create_validation(void **state)
{
    (void)state;
    rt_policy_opts d;
    rt_policy_opts_default(&d, RT_POLICY_CACHE_AWARE);
    assert_int_equal(d.kind, RT_POLICY_CACHE_AWARE);
    assert_true(d.cache_threshold == 0.5);
    assert_int_equal(d.balance_abs_threshold, 32);
    assert_true(d.balance_rel_threshold == 1.1);
    assert_int_equal(d.max_tree_chars, (size_t)1 << 24);
    assert_int_equal(d.prefix_bytes, 256);
    assert_int_equal(d.virtual_nodes, 160);

    for (int k = RT_POLICY_RANDOM; k <= RT_POLICY_PREFIX_HASH; k++)
        rt_policy_free(make((rt_policy_kind)k, 0));

    rt_policy_opts bad[14];
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++)
        bad[i] = d;
    bad[0].cache_threshold = NAN;
    bad[1].cache_threshold = -0.1;
    bad[2].cache_threshold = INFINITY;
    bad[3].balance_rel_threshold = 0.99;
    bad[4].balance_rel_threshold = NAN;
    bad[5].balance_rel_threshold = INFINITY;
    bad[6].balance_abs_threshold = -1;
    bad[7].virtual_nodes = 0;
    bad[8].virtual_nodes = 4097;
    bad[9].prefix_bytes = 0;
    bad[10].max_tree_chars = 0;
    bad[11].kind = (rt_policy_kind)7;
    bad[12].virtual_nodes = -5;
    bad[13].cache_threshold = -INFINITY;
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++) {
        rt_policy *p = (rt_policy *)&d; /* must be reset to NULL */
        assert_int_equal(rt_policy_create(&p, &bad[i]), TD_EINVAL);
        assert_null(p);
    }

    /* The edges of the valid ranges. */
    rt_policy_opts edge = d;
    edge.cache_threshold = 0;
    edge.balance_abs_threshold = 0;
    edge.balance_rel_threshold = 1;
    edge.virtual_nodes = 4096;
    edge.prefix_bytes = 1;
    edge.max_tree_chars = 1;
    rt_policy *p = NULL;
    assert_int_equal(rt_policy_create(&p, &edge), 0);
    rt_policy_free(p);
    rt_policy_free(NULL);
}

static void test_random(void **state)
{
    (void)state;
    rt_candidate c[5];
    idle(c, 5);
    rt_policy *p = make(RT_POLICY_RANDOM, 42), *q = make(RT_POLICY_RANDOM, 42);
    int counts[5] = {0};
    for (int i = 0; i < 5000; i++) {
        int k = rt_policy_pick(p, c, 5, "hello", 5);
        assert_true(k >= 0 && k < 5);
        assert_int_equal(rt_policy_pick(q, c, 5, NULL, 0), k); /* same seed, same draws */
        counts[k]++;
    }
    for (int i = 0; i < 5; i++)
        assert_true(counts[i] > 800 && counts[i] < 1200);
    for (int i = 0; i < 100; i++)
        assert_int_equal(rt_policy_pick(p, c, 1, NULL, 0), 0);
    rt_policy_free(p);
    rt_policy_free(q);
}

static void test_round_robin(void **state)
{
    (void)state;
    rt_candidate c[3];
    idle(c, 3);
    rt_policy *p = make(RT_POLICY_ROUND_ROBIN, 0);
    for (int i = 0; i < 30; i++)
        assert_int_equal(rt_policy_pick(p, c, 3, "x", 1), i % 3);
    /* Loads do not matter to round robin. */
    c[1].in_flight = 1000;
    for (int i = 30; i < 60; i++)
        assert_int_equal(rt_policy_pick(p, c, 3, NULL, 0), i % 3);
    for (int i = 0; i < 10; i++)
        assert_int_equal(rt_policy_pick(p, c, 1, NULL, 0), 0);
    rt_policy_free(p);
}

static void test_power_of_two(void **state)
{
    (void)state;
    rt_candidate c[3];
    idle(c, 3);
    c[0].in_flight = 100; /* the most loaded */
    c[1].in_flight = 40;
    c[2].in_flight = 1;
    rt_policy *p = make(RT_POLICY_POWER_OF_TWO, 7);
    int counts[3] = {0};
    for (int i = 0; i < 3000; i++) {
        int k = rt_policy_pick(p, c, 3, NULL, 0);
        assert_true(k >= 0 && k < 3);
        counts[k]++;
    }
    assert_int_equal(counts[0], 0);
    /* The lightest wins whenever it is drawn: in 2 of the 3 possible pairs. */
    assert_true(counts[2] > 1800 && counts[2] < 2200);
    assert_true(counts[1] > 800 && counts[1] < 1200);

    /* The same with the load reported by the worker rather than counted by the router. */
    idle(c, 3);
    c[0].reported_load = 500;
    c[1].reported_load = 20;
    c[2].reported_load = 0;
    for (int i = 0; i < 1000; i++)
        assert_int_not_equal(rt_policy_pick(p, c, 3, NULL, 0), 0);

    /* Unknown reported load counts as 0; equal loads prefer fewer in flight. */
    rt_candidate two[2];
    idle(two, 2);
    two[0].in_flight = 3;
    two[0].reported_load = -1; /* load 3 */
    two[1].reported_load = 4;  /* load 4 */
    for (int i = 0; i < 100; i++)
        assert_int_equal(rt_policy_pick(p, two, 2, NULL, 0), 0);
    two[0].in_flight = 5;
    two[0].reported_load = 0; /* load 5, 5 in flight */
    two[1].in_flight = 0;
    two[1].reported_load = 5; /* load 5, 0 in flight */
    for (int i = 0; i < 100; i++)
        assert_int_equal(rt_policy_pick(p, two, 2, NULL, 0), 1);

    for (int i = 0; i < 100; i++)
        assert_int_equal(rt_policy_pick(p, c, 1, "abc", 3), 0);
    rt_policy_free(p);
}

static int index_of(const rt_candidate *c, int n, uint64_t id)
{
    for (int i = 0; i < n; i++)
        if (c[i].worker_id == id) return i;
    return -1;
}

static void test_cache_aware_affinity(void **state)
{
    (void)state;
    rt_candidate c[4];
    idle(c, 4);
    rt_policy *p = make(RT_POLICY_CACHE_AWARE, 1);
    const char *sys = "You are a helpful assistant. Answer concisely and cite your sources. "
                      "The user is asking about the history of the printing press in Europe.";
    size_t sys_len = strlen(sys);

    /* Empty trees: the smallest tree wins, ties to the first. */
    int k = rt_policy_pick(p, c, 4, sys, sys_len);
    assert_int_equal(k, 0);
    uint64_t owner = c[k].worker_id;
    /* Unrelated, shorter prompts spread over the other (smaller) trees. */
    assert_int_equal(c[rt_policy_pick(p, c, 4, "what is 2+2?", 12)].worker_id, 101);
    assert_int_equal(c[rt_policy_pick(p, c, 4, "translate: chat", 15)].worker_id, 102);
    assert_int_equal(c[rt_policy_pick(p, c, 4, "tell me a joke", 14)].worker_id, 103);

    /* The same prompt goes back, whatever the candidates' order. */
    for (int i = 0; i < 10; i++) {
        rt_candidate r[4] = {c[(i + 1) % 4], c[(i + 2) % 4], c[(i + 3) % 4], c[i % 4]};
        k = rt_policy_pick(p, r, 4, sys, sys_len);
        assert_int_equal(r[k].worker_id, owner);
    }
    /* A prompt sharing a long prefix follows it, though its tree is the biggest. */
    char follow[512];
    snprintf(follow, sizeof(follow), "%s Who was Gutenberg?", sys);
    k = rt_policy_pick(p, c, 4, follow, strlen(follow));
    assert_int_equal(c[k].worker_id, owner);
    /* ... and an unrelated one does not: it goes to the smallest tree (101's, 12 chars). */
    const char *other = "a completely unrelated question about rust lifetimes";
    k = rt_policy_pick(p, c, 4, other, strlen(other));
    assert_int_equal(c[k].worker_id, 101);
    /* A short shared prefix (under cache_threshold of the text) is no affinity. */
    char weak[512];
    snprintf(weak, sizeof(weak), "You are a helpful assistant. %0200d", 7);
    k = rt_policy_pick(p, c, 4, weak, strlen(weak));
    assert_int_not_equal(c[k].worker_id, owner);

    /* Empty text never crashes and picks a valid candidate. */
    k = rt_policy_pick(p, c, 4, NULL, 0);
    assert_true(k >= 0 && k < 4);
    k = rt_policy_pick(p, c, 4, "", 0);
    assert_true(k >= 0 && k < 4);
    assert_int_equal(rt_policy_pick(p, c, 1, sys, sys_len), 0);
    check_trees(p);
    rt_policy_free(p);
}

static void test_cache_aware_balance(void **state)
{
    (void)state;
    rt_candidate c[3];
    idle(c, 3);
    rt_policy *p = make(RT_POLICY_CACHE_AWARE, 1);
    const char *prompt = "Summarise the following document in three bullet points: lorem ipsum "
                         "dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.";
    size_t len = strlen(prompt);
    /* Teach worker 100 the prompt, then fill the others so that 100 is not the smallest. */
    assert_int_equal(rt_policy_pick(p, c, 1, prompt, len), 0);
    assert_int_equal(rt_policy_pick(p, c + 1, 1, "x", 1), 0);
    assert_int_equal(rt_policy_pick(p, c + 2, 1, "y", 1), 0);

    /* Loads within the thresholds: the cache wins. Absolute gap too small: */
    c[0].in_flight = 40;
    c[1].in_flight = 10;
    c[2].in_flight = 20;
    assert_int_equal(rt_policy_pick(p, c, 3, prompt, len), 0);
    /* Relative gap too small (1000 <= 1.1 * 950), though the absolute one is 50: */
    c[0].in_flight = 600, c[0].reported_load = 400;
    c[1].in_flight = 950, c[1].reported_load = -1;
    c[2].in_flight = 0, c[2].reported_load = 980;
    assert_int_equal(rt_policy_pick(p, c, 3, prompt, len), 0);

    /* Imbalanced: the least loaded wins over the cache, counting reported load. */
    idle(c, 3);
    c[0].in_flight = 50;
    c[1].reported_load = 10;
    c[2].in_flight = 2;
    assert_int_equal(rt_policy_pick(p, c, 3, prompt, len), 2);
    /* The chosen worker learned the text: with the load even again it now matches on 102
     * as well as 100, and the first longest match wins. */
    idle(c, 3);
    rt_candidate r[3] = {c[2], c[0], c[1]};
    assert_int_equal(r[rt_policy_pick(p, r, 3, prompt, len)].worker_id, 102);
    assert_int_equal(c[rt_policy_pick(p, c, 3, prompt, len)].worker_id, 100);
    check_trees(p);
    rt_policy_free(p);
}

static void test_cache_aware_eviction(void **state)
{
    (void)state;
    rt_policy_opts o;
    rt_policy_opts_default(&o, RT_POLICY_CACHE_AWARE);
    o.max_tree_chars = 4096;
    rt_policy *p = NULL;
    assert_int_equal(rt_policy_create(&p, &o), 0);
    rt_candidate c[4];
    idle(c, 4);
    td_rng rng;
    td_rng_seed(&rng, 99);
    char buf[6000];
    /* Many long distinct prompts, some sharing prefixes (so edges split), a few longer than
     * the whole budget. The trees stay within it and every pick stays valid. */
    for (int i = 0; i < 3000; i++) {
        size_t len = 1 + td_rng_next(&rng) % (i % 97 == 0 ? sizeof(buf) : 700);
        random_text(&rng, buf, len);
        if (i % 3 == 0) memcpy(buf, "shared system prompt: ", TD_MIN(len, 22));
        c[i % 4].in_flight = (int)(td_rng_next(&rng) % 60);
        int k = rt_policy_pick(p, c, 4, buf, len);
        assert_true(k >= 0 && k < 4);
        assert_true(p->total_chars <= o.max_tree_chars);
        if (i % 50 == 0) check_trees(p);
    }
    check_trees(p);
    rt_policy_free(p);

    /* Least recently used goes first: A learns a, B learns b, a is used again, then a
     * new text that overflows the budget must evict b, not a. */
    o.max_tree_chars = 300;
    assert_int_equal(rt_policy_create(&p, &o), 0);
    char a[100], b[100], n[100];
    memset(a, 'a', sizeof(a));
    memset(b, 'b', sizeof(b));
    memset(n, 'n', sizeof(n));
    assert_int_equal(rt_policy_pick(p, &c[0], 1, a, sizeof(a)), 0);
    assert_int_equal(rt_policy_pick(p, &c[1], 1, b, sizeof(b)), 0);
    assert_int_equal(rt_policy_pick(p, &c[0], 1, a, sizeof(a)), 0);
    assert_int_equal(rt_policy_pick(p, &c[2], 1, n, 50), 0);
    assert_int_equal(p->total_chars, 250);
    assert_int_equal(rt_policy_pick(p, &c[2], 1, n, sizeof(n)), 0); /* +50: 300 */
    assert_int_equal(p->total_chars, 300);
    assert_int_equal(rt_policy_pick(p, &c[3], 1, n, 1), 0); /* 301: evict one leaf */
    assert_int_equal(p->total_chars, 201);
    assert_null(tree_get(p, 101)); /* b's tree is gone entirely */
    assert_non_null(tree_get(p, 100));
    assert_int_equal(tree_match(tree_get(p, 100), a, sizeof(a)), sizeof(a));
    check_trees(p);
    rt_policy_free(p);
}

static void test_cache_aware_forget(void **state)
{
    (void)state;
    rt_candidate c[3];
    idle(c, 3);
    rt_policy *p = make(RT_POLICY_CACHE_AWARE, 3);
    const char *prompt = "Write a haiku about the sea, the moon and a lighthouse keeper.";
    size_t len = strlen(prompt);
    /* Worker 102 (last in the order) learns the prompt; 100 stays empty. */
    assert_int_equal(rt_policy_pick(p, &c[2], 1, prompt, len), 0);
    assert_int_equal(rt_policy_pick(p, &c[1], 1, "zz", 2), 0);
    for (int i = 0; i < 5; i++)
        assert_int_equal(rt_policy_pick(p, c, 3, prompt, len), 2);
    rt_policy_forget(p, 102);
    assert_null(tree_get(p, 102));
    check_trees(p);
    /* No affinity left: the smallest tree (100's, empty, first) gets it. */
    assert_int_equal(rt_policy_pick(p, c, 3, prompt, len), 0);
    /* Forgetting an unknown worker is harmless. */
    rt_policy_forget(p, 12345);
    assert_int_equal(rt_policy_pick(p, c, 3, prompt, len), 0);
    check_trees(p);
    rt_policy_free(p);
}

static void test_prefix_hash_affinity(void **state)
{
    (void)state;
    rt_candidate c[4];
    idle(c, 4);
    rt_policy *p = make(RT_POLICY_PREFIX_HASH, 0);
    rt_policy *q = make(RT_POLICY_PREFIX_HASH, 12345); /* the PRNG seed plays no part */
    char text[400];
    memset(text, 'p', sizeof(text));
    int k = rt_policy_pick(p, c, 4, text, sizeof(text));
    assert_true(k >= 0 && k < 4);
    uint64_t owner = c[k].worker_id;
    for (int i = 0; i < 50; i++) {
        /* Anything after the first 256 bytes is ignored. */
        text[256 + i % 144] = (char)('a' + i % 26);
        rt_candidate r[4] = {c[(i + 1) % 4], c[(i + 3) % 4], c[(i + 2) % 4], c[i % 4]};
        assert_int_equal(r[rt_policy_pick(p, r, 4, text, sizeof(text))].worker_id, owner);
        assert_int_equal(r[rt_policy_pick(q, r, 4, text, sizeof(text))].worker_id, owner);
    }
    /* Loads play no part either. */
    c[index_of(c, 4, owner)].in_flight = 1000;
    assert_int_equal(c[rt_policy_pick(p, c, 4, text, sizeof(text))].worker_id, owner);
    /* Different prefixes do reach different workers. */
    td_rng rng;
    td_rng_seed(&rng, 5);
    bool seen[4] = {false};
    for (int i = 0; i < 200; i++) {
        char key[16];
        random_text(&rng, key, sizeof(key));
        seen[rt_policy_pick(p, c, 4, key, sizeof(key))] = true;
    }
    for (int i = 0; i < 4; i++)
        assert_true(seen[i]);
    k = rt_policy_pick(p, c, 4, NULL, 0);
    assert_true(k >= 0 && k < 4);
    assert_int_equal(rt_policy_pick(p, c, 1, text, sizeof(text)), 0);
    rt_policy_free(p);
    rt_policy_free(q);
}

enum { N_KEYS = 10000, KEY_LEN = 24 };

static void test_prefix_hash_distribution(void **state)
{
    (void)state;
    rt_candidate c[4];
    idle(c, 4);
    rt_policy *p = make(RT_POLICY_PREFIX_HASH, 0);
    static char keys[N_KEYS][KEY_LEN];
    static uint64_t before[N_KEYS];
    td_rng rng;
    td_rng_seed(&rng, 2024);
    int counts[4] = {0};
    for (int i = 0; i < N_KEYS; i++) {
        random_text(&rng, keys[i], KEY_LEN);
        int k = rt_policy_pick(p, c, 4, keys[i], KEY_LEN);
        before[i] = c[k].worker_id;
        counts[k]++;
    }
    for (int i = 0; i < 4; i++) {
        printf("prefix_hash: worker %d got %d of %d keys\n", i, counts[i], N_KEYS);
        assert_true(counts[i] >= N_KEYS / 4 * 85 / 100 && counts[i] <= N_KEYS / 4 * 115 / 100);
    }

    /* Worker 102 leaves: only its keys move. */
    rt_candidate three[3] = {c[0], c[1], c[3]};
    rt_policy_forget(p, 102);
    int stayed = 0, others = 0, moved_to_live = 0;
    for (int i = 0; i < N_KEYS; i++) {
        uint64_t now = three[rt_policy_pick(p, three, 3, keys[i], KEY_LEN)].worker_id;
        assert_int_not_equal(now, 102);
        if (before[i] != 102) {
            others++;
            stayed += now == before[i];
        } else {
            moved_to_live++;
        }
    }
    assert_true(moved_to_live > 0);
    assert_true((double)stayed >= 0.95 * others);
    assert_int_equal(stayed, others); /* exactly, for a consistent-hash ring */

    /* It comes back: every key returns to where it was. */
    for (int i = 0; i < N_KEYS; i++)
        assert_int_equal(c[rt_policy_pick(p, c, 4, keys[i], KEY_LEN)].worker_id, before[i]);
    rt_policy_free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_create_validation),
        cmocka_unit_test(test_random),
        cmocka_unit_test(test_round_robin),
        cmocka_unit_test(test_power_of_two),
        cmocka_unit_test(test_cache_aware_affinity),
        cmocka_unit_test(test_cache_aware_balance),
        cmocka_unit_test(test_cache_aware_eviction),
        cmocka_unit_test(test_cache_aware_forget),
        cmocka_unit_test(test_prefix_hash_affinity),
        cmocka_unit_test(test_prefix_hash_distribution),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
