/* version.h - the version `dflash --version` prints and every run's log records. */
#ifndef DF_VERSION_H
#define DF_VERSION_H

#ifndef DFLASH_VERSION
#define DFLASH_VERSION "0.1.0"
#endif

#endif
