/* projected.h - a drafter trained on a projected cache (cache/cache.h).
 *
 * Such a cache stores z = P x per token; the drafter's fc_r (H x R) reads z.
 * Serving engines feed fc the raw features x, so the export writes
 * fc = fc_r P (H x K*H): on x that is exactly the map trained on z (up to
 * float rounding), and the export is an ordinary DFlash drafter.
 */
#ifndef DF_PROJECTED_H
#define DF_PROJECTED_H

#include "basis.h"
#include "cache.h"
#include "ckpt.h"
#include "err.h"
#include "hfconfig.h"
#include "params.h"

/* The export of a drafter whose config has feature_dim = b->R: every tensor
 * as df_export_drafter writes it, fc.weight replaced by fc_r P; config.json
 * that of the same drafter on raw features (feature_dim 0). */
int df_export_drafter_projected(const char *out_dir, const df_drafter_config *c,
                                const df_params *ps, const float *master, const df_basis *b,
                                df_err *e);
/* With one more file in the export (df_export_drafter_with). */
int df_export_drafter_projected_with(const char *out_dir, const df_drafter_config *c,
                                     const df_params *ps, const float *master,
                                     const df_basis *b, const df_export_extra *extra, df_err *e);

#endif
