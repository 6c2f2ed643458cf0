/*
 * tests/test_shared.h - locating ../shared from tests.
 *
 * Tests read models, golden outputs and tokenizer vectors from the shared data
 * folder: $TD_SHARED_DIR when set (ctest sets it to the CMake TD_SHARED_DIR
 * option, which defaults to ../shared next to the checkout). When the folder or a
 * file is missing the test fails with a message that says which path was tried
 * and how to point the tests elsewhere.
 */
#ifndef TD_TEST_SHARED_H
#define TD_TEST_SHARED_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static inline const char *td_test_shared_path(const char *rel)
{
    static char buf[8][1024];
    static int slot;
    const char *dir = getenv("TD_SHARED_DIR");
    if (!dir || !*dir) dir = "../shared";
    char *out = buf[slot++ % 8];
    snprintf(out, sizeof(buf[0]), "%s/%s", dir, rel);
    struct stat st;
    if (stat(out, &st) != 0) {
        fprintf(stderr,
                "\n*** shared test data missing: '%s' does not exist.\n"
                "*** Set TD_SHARED_DIR to the shared folder (models/, golden/, tokenizer/),\n"
                "*** or configure with cmake -DTD_SHARED_DIR=/path/to/shared.\n\n",
                out);
        fflush(stderr);
        abort();
    }
    return out;
}

#endif
