/* crc32c.h - CRC-32C (Castagnoli), the checksum of every cache block.
 * Uses the SSE4.2 crc32 instruction when the CPU has it (checked once at
 * run time), else a slicing-by-8 table. Both give identical results. */
#ifndef DF_CRC32C_H
#define DF_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends crc (start with 0) over len bytes: crc32c(crc32c(0,a),b) == crc32c(0,a||b). */
uint32_t df_crc32c(uint32_t crc, const void *buf, size_t len);

/* The portable path, exposed so tests can check it against the fast one. */
uint32_t df_crc32c_sw(uint32_t crc, const void *buf, size_t len);

#endif
