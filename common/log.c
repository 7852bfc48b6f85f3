#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int log_level(void)
{
    static int level = -1;
    if (level < 0) {
        const char *s = getenv("DFLASH_LOG");
        level = DF_LOG_INFO;
        if (s) {
            if (!strcmp(s, "error")) level = DF_LOG_ERROR;
            else if (!strcmp(s, "warn")) level = DF_LOG_WARN;
            else if (!strcmp(s, "debug")) level = DF_LOG_DEBUG;
        }
    }
    return level;
}

int df_log_enabled(int level)
{
    return level <= log_level();
}

void df_log(int level, const char *fmt, ...)
{
    if (!df_log_enabled(level))
        return;
    static const char *names[] = {"error", "warn", "info", "debug"};
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "dflash %s: %s\n", names[level], line);
}
