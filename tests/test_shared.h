/*
 * tests/test_shared.h - locating ../shared from the cmocka tests (include after
 * <cmocka.h>).
 *
 * Tests read models, golden outputs and tokenizer vectors from the shared data
 * folder: $TD_SHARED_DIR (ctest sets it to the CMake TD_SHARED_DIR option, which
 * defaults to ../shared next to the checkout). When the folder or a file is missing
 * the test fails with a message that says which path was tried and how to point the
 * tests elsewhere.
 */
#ifndef TD_TEST_SHARED_H
#define TD_TEST_SHARED_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static inline const char *td_test_shared_dir(void)
{
    const char *d = getenv("TD_SHARED_DIR");
    struct stat st;
    if (!d || stat(d, &st) != 0 || !S_ISDIR(st.st_mode))
        fail_msg("the shared data folder is missing: TD_SHARED_DIR='%s'. Run the tests through "
                 "ctest, or export TD_SHARED_DIR=/path/to/shared (it holds models/, golden/ "
                 "and tokenizer/)",
                 d ? d : "(unset)");
    return d;
}

/** Path of a file in the shared folder (a rotating static buffer); fails if it is missing. */
static inline const char *td_test_shared_path(const char *rel)
{
    static char buf[8][1024];
    static int slot;
    char *out = buf[slot++ % 8];
    snprintf(out, sizeof(buf[0]), "%s/%s", td_test_shared_dir(), rel);
    struct stat st;
    if (stat(out, &st) != 0)
        fail_msg("shared test data missing: '%s' does not exist (set TD_SHARED_DIR)", out);
    return out;
}

#endif
