/* log.h - one-line diagnostics to stderr. Level from DFLASH_LOG
 * (error|warn|info|debug; default info; knobs.h). Thread-safe (one fprintf per line). */
#ifndef DF_LOG_H
#define DF_LOG_H

enum { DF_LOG_ERROR = 0, DF_LOG_WARN = 1, DF_LOG_INFO = 2, DF_LOG_DEBUG = 3 };

void df_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int df_log_enabled(int level);

#endif
