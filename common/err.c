#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int df_errf(df_err *e, int code, const char *fmt, ...)
{
    if (!e)
        return code;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return code;
}

int df_err_wrap(df_err *e, const char *fmt, ...)
{
    if (!e)
        return 0;
    char prefix[256], old[sizeof e->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, e->msg, sizeof old);
    snprintf(e->msg, sizeof e->msg, "%s: %s", prefix, old);
    return e->code;
}

const char *df_strerror(int code)
{
    int c = code < 0 ? -code : code;
    switch (c) {
    case DF_ECORRUPT: return "corrupt data";
    case DF_EVERSION: return "unsupported format version";
    case DF_EMISMATCH: return "mismatch";
    default: return strerror(c);
    }
}
