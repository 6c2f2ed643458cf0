/* cli/mkmodel.c - placeholder, replaced by the mkmodel implementation. */
#include <stdio.h>
#include "cli/cli.h"
int cli_mkmodel(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "mkmodel: pending\n");
    return 1;
}
