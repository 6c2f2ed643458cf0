/* Unit tests for util/td.c: error records, number parsing, hashing, the PRNG and growable
 * strings. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "util/td.h"

static void test_err_set(void **state)
{
    (void)state;
    td_err err;
    td_err_clear(&err);
    assert_int_equal(td_err_set(&err, TD_EFORMAT, "bad %s at %d", "magic", 4), TD_EFORMAT);
    assert_int_equal(err.code, TD_EFORMAT);
    assert_string_equal(err.msg, "bad magic at 4");
    assert_string_equal(td_strerror(TD_EFORMAT), "malformed input");
}

static void test_parse(void **state)
{
    (void)state;
    int64_t i;
    double d;
    uint64_t sz;
    assert_int_equal(td_parse_i64("42", &i), 0);
    assert_int_equal(i, 42);
    assert_int_equal(td_parse_i64("42x", &i), TD_EINVAL);
    assert_int_equal(td_parse_i64("", &i), TD_EINVAL);
    assert_int_equal(td_parse_i64("99999999999999999999999", &i), TD_EINVAL);
    assert_int_equal(td_parse_f64("0.5", &d), 0);
    assert_true(d == 0.5);
    assert_int_equal(td_parse_f64("nan", &d), TD_EINVAL);
    assert_int_equal(td_parse_size("4G", &sz), 0);
    assert_true(sz == 4ull << 30);
    assert_int_equal(td_parse_size("512MiB", &sz), 0);
    assert_true(sz == 512ull << 20);
    assert_int_equal(td_parse_size("-1", &sz), TD_EINVAL);
    assert_int_equal(td_parse_size("3X", &sz), TD_EINVAL);
}

static void test_hash_and_rng(void **state)
{
    (void)state;
    assert_true(td_hash64("abc", 3, 0) == td_hash64("abc", 3, 0));
    assert_true(td_hash64("abc", 3, 0) != td_hash64("abc", 3, 1));
    assert_true(td_hash64("abc", 3, 0) != td_hash64("abd", 3, 0));
    td_rng a, b;
    td_rng_seed(&a, 7);
    td_rng_seed(&b, 7);
    for (int k = 0; k < 100; k++) {
        float f = td_rng_float(&a);
        assert_true(f >= 0.0f && f < 1.0f);
        assert_true(f == td_rng_float(&b));
    }
}

/* Appends and formats grow the string across its first capacity and keep it terminated. */
static void test_http_reason(void **state)
{
    (void)state;
    assert_string_equal(td_http_reason(200), "OK");
    assert_string_equal(td_http_reason(413), "Payload Too Large");
    assert_string_equal(td_http_reason(504), "Gateway Timeout");
    assert_string_equal(td_http_reason(599), "Error");
}

static void test_sbuf(void **state)
{
    (void)state;
    td_sbuf b = {0};
    assert_int_equal(td_sbuf_add(&b, "", 0), 0);
    assert_non_null(b.p);
    assert_string_equal(b.p, "");
    assert_int_equal(td_sbuf_add(&b, "abcdef", 3), 0); /* not NUL-terminated input */
    assert_int_equal(td_sbuf_printf(&b, "-%d-%s", 42, "x"), 0);
    assert_string_equal(b.p, "abc-42-x");
    assert_int_equal(b.len, 8);
    /* past the first capacity, by appends and by a long format */
    char big[1000];
    memset(big, 'y', sizeof(big));
    for (int i = 0; i < 5; i++)
        assert_int_equal(td_sbuf_add(&b, big, sizeof(big)), 0);
    assert_int_equal(td_sbuf_printf(&b, "%.*s|%d", 3000, "zzz", 7), 0);
    assert_int_equal(b.len, 8 + 5000 + 5);
    assert_int_equal(strlen(b.p), b.len);
    assert_true(b.cap > b.len);
    assert_string_equal(b.p + b.len - 5, "zzz|7");
    char *wide = malloc(5000);
    memset(wide, 'w', 4999);
    wide[4999] = '\0';
    assert_int_equal(td_sbuf_printf(&b, "%s", wide), 0);
    assert_int_equal(b.len, 8 + 5000 + 5 + 4999);
    assert_int_equal(strlen(b.p), b.len);
    free(wide);
    assert_false(b.oom);
    free(b.p);
    /* after a failure every append is a no-op and says so */
    td_sbuf f = {.oom = true};
    assert_int_equal(td_sbuf_add(&f, "a", 1), TD_ENOMEM);
    assert_int_equal(td_sbuf_printf(&f, "%d", 1), TD_ENOMEM);
    assert_null(f.p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_err_set),      cmocka_unit_test(test_parse),
        cmocka_unit_test(test_hash_and_rng), cmocka_unit_test(test_http_reason),
        cmocka_unit_test(test_sbuf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
