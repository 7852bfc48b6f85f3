#include "log.h"

#include <stdarg.h>
#include <stdio.h>

#include "knobs.h"

int df_log_enabled(int level)
{
    return level <= df_knob_int(DF_KNOB_LOG); /* its choices are the levels, in order */
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
