/* Unit tests for util/td.c: error records, number parsing, hashing and the PRNG. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_err_set),
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_hash_and_rng),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
