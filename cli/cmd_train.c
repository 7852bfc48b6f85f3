/* cmd_train.c - `dflash train`: a DFlash drafter from a cache, on one or
 * more ranks. */
#include <errno.h>
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cache.h"
#include "cmds.h"
#include "drafter.h"
#include "hfconfig.h"
#include "knobs.h"
#include "opt.h"
#include "onestep.h"
#include "ranks.h"
#include "train.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: dflash train --cache CACHE --target DIR --out RUN --steps N --mask-token ID [options]\n"
            "Trains a DFlash drafter on the hidden states in CACHE (made by `dflash extract` from the\n"
            "target in DIR, whose frozen embedding and lm_head the drafter uses). RUN gets checkpoints,\n"
            "log.jsonl and, at the end, export/ (config.json + model.safetensors for SGLang/vLLM).\n"
            "Rerunning the same command resumes from the newest checkpoint, exactly.\n"
            "  --init-from DIR       start from the drafter export in DIR (config.json +\n"
            "                        model.safetensors: a `dflash export`, or a released DFlash\n"
            "                        drafter with the same tensor names, SpecForge / z-lab) to\n"
            "                        fine-tune it: its weights, a fresh optimizer (step 0, the\n"
            "                        warmup as set). The drafter options below and --mask-token\n"
            "                        default to DIR's config (--target-layers: its\n"
            "                        target_layer_ids); given, they must agree with it, as must\n"
            "                        the target (hidden size, vocabulary, layers). On a projected\n"
            "                        cache fc_r = fc P^T. With --eval-cache also evaluated at\n"
            "                        step 0; --steps 0: only that and the export. A rerun\n"
            "                        resumes only with the --init-from it started with\n"
            "drafter (defaults: --init-from's when given):\n"
            "  --layers N            drafter layers (default 1)\n"
            "  --layer-types T       full | sliding | a comma list per layer (default: sliding, last full)\n"
            "  --sliding-window W    window of sliding layers (default 2048)\n"
            "  --intermediate N --heads N --kv-heads N --head-dim N   (default: the target's)\n"
            "  --block-size N        block size (default 16)\n"
            "  --mask-token ID       the target's mask token id (required without --init-from)\n"
            "  --target-layers L,..  which of the cache's feature layers to use (default: all)\n"
            "data:\n"
            "  --max-tokens N        context tokens per packed row (default 4096)\n"
            "  --max-anchors N       blocks per row (default 512)\n"
            "  --rows-per-step N     rows per optimizer step (default 1)\n"
            "  --gamma G             loss weight decay over block positions (default 7)\n"
            "  --noise A             uniform feature noise +-A (default 0)\n"
            "  --no-recompute        keep every activation (default: norm, RoPE and SwiGLU\n"
            "                        outputs are recomputed in the backward: same results,\n"
            "                        ~2 GiB less at the 27B drafter shape, ~0.2%% slower)\n"
            "  --recompute-mlp       also the MLP's gate/up projections (two more GEMMs per\n"
            "                        layer; same results, ~0.5 GB less per layer at 8192 rows)\n"
            "  --grad-f32            GPU: gradients in F32 (default BF16, half the memory)\n"
            "  --adam-bf16           v in BF16 too (both moments stochastically rounded): 2\n"
            "                        bytes per parameter less than the default, of memory\n"
            "                        and of the optimizer's traffic; the drafter ~1%% worse\n"
            "                        in eval loss and tau_walk (docs/DESIGN.md)\n"
            "  --no-adam-m-bf16      AdamW's first moment in F32 (default: m in BF16,\n"
            "                        stochastically rounded, v F32: 2 bytes less per\n"
            "                        parameter, ~1%% faster at the 27B shape; eval loss,\n"
            "                        tau_walk and real tau within the seed spread under FP8:\n"
            "                        docs/DESIGN.md); --adam-m-bf16 asks for the default\n"
            "  --adam-v16            v in UF16 (a 16-bit float without sign: 11 significant\n"
            "                        bits against BF16's 8), stochastically rounded, m in\n"
            "                        BF16: 2 bytes per parameter less than the default;\n"
            "                        needs --clip <= 4; being judged by the quality gate\n"
            "  --bf16-logits         the training steps' LM-head logits rounded to BF16, as\n"
            "                        PyTorch's BF16 head leaves them (SpecForge): half their\n"
            "                        bytes on the GPU, ~1%% faster at the 27B shape; eval\n"
            "                        loss ~1%% worse on every seed (docs/DESIGN.md)\n"
            "  --f16-logits          the same in FP16: 11 significant bits against BF16's 8;\n"
            "                        FP16 bytes where the E4M3 tensor cores write the logits\n"
            "                        (with FP8); being judged by the quality gate\n"
            "  --fp8, --no-fp8       FP8 training on or off: the GEMMs' operands rounded to\n"
            "                        E4M3 with block scales (docs/FP8.md); evaluation and the\n"
            "                        export stay BF16. Default: on where FP8 tensor cores are\n"
            "                        verified (compute capability 9.0) and the drafter is wide\n"
            "                        enough for them to pay (hidden >= %d), else off; the\n"
            "                        choice is printed and recorded in the run's settings\n"
            "  --no-fp8-dy-blocks    with FP8, round the weight gradients' dy per 128 x 1 (as\n"
            "                        x) instead of the default 128 x 128 blocks, which take\n"
            "                        ~3.5%% off the step on Hopper with the drafter's quality\n"
            "                        within the seed-to-seed spread (docs/FP8.md);\n"
            "                        --fp8-dy-blocks: --fp8 with the default\n"
            "  --fp8-ce-onepass      --fp8 with the LM head's softmax gradient made in one read\n"
            "                        of the logits: rounded per block against the block's own\n"
            "                        max, the label's term exact (docs/FP8.md); being judged\n"
            "                        by the quality gate. --no-fp8-ce-onepass: the default\n"
            "  --no-grad-alias       keep activations out of the gradient array (default, with\n"
            "                        one row per step: layers' saved activations live in the\n"
            "                        gradients of the layer below until its backward; same\n"
            "                        results, ~2.6 GiB less at the 27B drafter shape)\n"
            "  --no-overlap-optimizer  run each step's AdamW after the backward (default: bucket\n"
            "                        by bucket on a side stream while the next forward starts;\n"
            "                        same results)\n"
            "  --buffered-io         read the cache through the page cache (default O_DIRECT):\n"
            "                        for a cache that fits in RAM and is read many epochs\n"
            "optimisation:\n"
            "  --steps N             optimizer steps (required)\n"
            "  --lr LR --min-lr LR   peak and final LR (default 6e-4, 0); warmup --warmup F (0.04)\n"
            "  --clip C              global gradient-norm clip (default 1.0)\n"
            "  --init-std S          linear init std (default 0.02)\n"
            "  --fc-init-random      fc drawn like the other weights (default: fc starts as the\n"
            "                        mean of the feature layers; random fc left some seeds on a\n"
            "                        plateau, docs/NOTES.md)\n"
            "  --seed S              all randomness (default 1)\n"
            "  --init-seed S         the initial weights' draw alone (default: --seed), to\n"
            "                        tell the init's effect from the data order's\n"
            "  --init-seed-for P=S[,P=S]  parameters named P... drawn with seed S instead\n"
            "bookkeeping:\n"
            "  --eval-cache CACHE    acc[k], tau_hat, tau_walk, loss on a held-out cache (same\n"
            "                        target), forward only, same rows each time: --eval-every N\n"
            "                        (default: at the end), --eval-rows R (default 64); logged as\n"
            "                        eval_* lines. tau_hat = 1 + mean accepted drafts per block;\n"
            "                        tau_walk = tokens per verification of greedy decoding on the\n"
            "                        eval text (README; ~candidates/max-anchors forward passes\n"
            "                        per row); --no-eval-walk skips it. RUN/best/ keeps the\n"
            "                        export of the step with the highest eval tau_walk (or\n"
            "                        tau_hat without the walk) + best.json (step, figures);\n"
            "                        `dflash export --run RUN --best` exports it; --no-best: not\n"
            "  --random-target CFG   benchmarks: a random frozen embedding/head of this config.json\n"
            "                        instead of --target (the cache's target is not checked)\n"
            "  --device cpu|cuda|auto  the backend (default cpu; cuda: one GPU, --gpu I)\n"
            "data parallel (ZeRO-1: gradients reduce-scattered, optimizer state sharded):\n"
            "  --gpus N|all          one process per local GPU, started here (NCCL); with\n"
            "                        NODE_RANK/NNODES (or Slurm's) one such launch per node and\n"
            "                        DFLASH_RUN_ID the same on every node\n"
            "  torchrun / srun       RANK, WORLD_SIZE, LOCAL_RANK (or SLURM_*) make this process\n"
            "                        one rank (CPU ranks of one machine too: shared memory)\n"
            "  --rank R --world-size W --run-id ID   the same by hand\n"
            "  --master-addr HOST --master-port P   GPU ranks meet over TCP at rank 0's HOST:P\n"
            "                        (rank 0 listens on P); default: MASTER_ADDR/MASTER_PORT\n"
            "                        under torchrun/Slurm and --gpus over several nodes (the\n"
            "                        port after MASTER_PORT when torchrun's own store holds it),\n"
            "                        else a file in RUN (one machine, or RUN on a shared disk).\n"
            "                        A resume needs RUN's checkpoints on every node\n"
            "  A run resumes with the number of ranks it was started with.\n"
            "  --log-every N --ckpt-every N --keep-last N --threads N --quiet\n"
            "  --no-ckpt             no checkpoint at all, not even the last (benchmarks)\n",
            DF_FP8_AUTO_MIN_HIDDEN);
}

/* The largest value of --rows-per-step, --max-anchors, --eval-rows: far beyond any
 * real run, small enough that the row buffers' sizes cannot overflow. */
#define ROWS_MAX (1 << 16)

/* What every spawned rank is given: the launch's --run-id, and the
 * rendezvous address when it came from the environment. */
typedef struct spawn_extra {
    const char *run_id, *master_addr;
    char port[16];
} spawn_extra;

static int spawn_extra_fn(void *ctx, int i, uint32_t rank, char **av, int cap)
{
    const spawn_extra *x = ctx;
    int k = 0;
    if (cap >= 2) {
        av[k++] = "--run-id";
        av[k++] = (char *)x->run_id;
    }
    if (x->master_addr && cap >= 6) {
        av[k++] = "--master-addr";
        av[k++] = (char *)x->master_addr;
        av[k++] = "--master-port";
        av[k++] = (char *)x->port;
    }
    return k;
}

/* MASTER_ADDR/MASTER_PORT when no --master-addr was given: 0, or 2 (usage) after a message. */
static int master_from_env(df_train_opts *o)
{
    df_err pe = {0};
    if (o->master_addr || cli_master_from_env(&o->master_addr, &o->master_port, &pe) >= 0)
        return 0;
    fprintf(stderr, "dflash train: %s\n", pe.msg);
    return 2;
}

int cmd_train(int argc, char **argv)
{
    /* a line as soon as it is written, into a pipe too (`| tee`): the start's lines (the
     * parameters, the persistent state) come before the first step, which can be a minute */
    setvbuf(stdout, NULL, _IOLBF, 0);
    df_train_opts o;
    df_train_opts_defaults(&o);
    int tl[DF_MAX_TARGET_FEATURES], ntl = 0, gpu_given = 0, rank_given = 0, steps_given = 0, draws = 0;
    /* flags of which a pair asks for opposite things (--no-ckpt over a --ckpt-every
     * is not one: it turns checkpoints off whatever their interval) */
    enum { SEEN_RECOMPUTE = 1, SEEN_NO_RECOMPUTE = 2, SEEN_RECOMPUTE_MLP = 4, SEEN_OVERLAP = 8,
           SEEN_NO_OVERLAP = 16, SEEN_FP8 = 32, SEEN_NO_FP8 = 64, SEEN_DY_BLOCKS = 128,
           SEEN_NO_DY_BLOCKS = 256, SEEN_M16 = 512, SEEN_NO_M16 = 1024, SEEN_ONEPASS = 2048,
           SEEN_NO_ONEPASS = 4096 };
    unsigned seen = 0;
    const char *gpus = NULL;
    char idbuf[128];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--quiet")) {
            o.quiet = 1;
            continue;
        }
        if (!strcmp(a, "--buffered-io")) {
            o.buffered_io = 1;
            continue;
        }
        if (!strcmp(a, "--recompute")) { /* the default; kept for scripts */
            seen |= SEEN_RECOMPUTE;
            o.recompute = o.recompute > 1 ? o.recompute : 1;
            continue;
        }
        if (!strcmp(a, "--no-recompute")) {
            seen |= SEEN_NO_RECOMPUTE;
            o.recompute = 0;
            continue;
        }
        if (!strcmp(a, "--recompute-mlp")) {
            seen |= SEEN_RECOMPUTE_MLP;
            o.recompute = 2;
            continue;
        }
        if (!strcmp(a, "--grad-f32")) {
            o.grad_f32 = 1;
            continue;
        }
        if (!strcmp(a, "--adam-bf16")) {
            o.adam_bf16 = 1;
            continue;
        }
        if (!strcmp(a, "--adam-v16")) {
            o.adam_v16 = 1;
            continue;
        }
        if (!strcmp(a, "--f16-logits")) {
            o.f16_logits = 1;
            continue;
        }
        if (!strcmp(a, "--bf16-logits")) {
            o.bf16_logits = 1;
            continue;
        }
        if (!strcmp(a, "--adam-m-bf16")) {
            seen |= SEEN_M16;
            o.adam_m_bf16 = 1;
            continue;
        }
        if (!strcmp(a, "--no-adam-m-bf16")) {
            seen |= SEEN_NO_M16;
            o.adam_m_bf16 = 0;
            continue;
        }
        if (!strcmp(a, "--fp8")) {
            seen |= SEEN_FP8;
            o.fp8 = 1;
            continue;
        }
        if (!strcmp(a, "--fp8-dy-blocks")) {
            seen |= SEEN_FP8 | SEEN_DY_BLOCKS;
            o.fp8 = 1;
            o.fp8_dy_blocks = 1;
            continue;
        }
        if (!strcmp(a, "--no-fp8-dy-blocks")) {
            seen |= SEEN_NO_DY_BLOCKS;
            o.fp8_dy_blocks = 0;
            continue;
        }
        if (!strcmp(a, "--fp8-ce-onepass")) {
            seen |= SEEN_FP8 | SEEN_ONEPASS;
            o.fp8 = 1;
            o.fp8_ce_onepass = 1;
            continue;
        }
        if (!strcmp(a, "--no-fp8-ce-onepass")) {
            seen |= SEEN_NO_ONEPASS;
            o.fp8_ce_onepass = 0;
            continue;
        }
        if (!strcmp(a, "--no-fp8")) {
            seen |= SEEN_NO_FP8;
            o.fp8 = 0;
            continue;
        }
        if (!strcmp(a, "--no-ckpt")) {
            o.no_ckpt = 1;
            continue;
        }
        if (!strcmp(a, "--overlap-optimizer")) { /* the default; an error where impossible */
            seen |= SEEN_OVERLAP;
            o.overlap_opt = 1;
            continue;
        }
        if (!strcmp(a, "--no-grad-alias")) {
            o.no_grad_alias = 1;
            continue;
        }
        if (!strcmp(a, "--no-overlap-optimizer")) {
            seen |= SEEN_NO_OVERLAP;
            o.overlap_opt = 0;
            continue;
        }
        if (!strcmp(a, "--fc-init-random")) {
            o.fc_init_random = 1;
            draws = 1;
            continue;
        }
        if (!strcmp(a, "--no-eval-walk")) {
            o.no_eval_walk = 1;
            continue;
        }
        if (!strcmp(a, "--no-best")) {
            o.no_best = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "dflash train: '%s' needs a value (or is unknown)\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--cache")) o.cache_dir = v;
        else if (!strcmp(a, "--target")) o.target_dir = v;
        else if (!strcmp(a, "--random-target")) o.random_target = v;
        else if (!strcmp(a, "--eval-cache")) o.eval_cache = v;
        else if (!strcmp(a, "--out")) o.run_dir = v;
        else if (!strcmp(a, "--layer-types")) o.layer_types = v;
        else if (!strcmp(a, "--init-seed-for")) { o.init_seed_for = v; draws = 1; }
        else if (!strcmp(a, "--init-from")) o.init_from = v;
        else if (!strcmp(a, "--gpus")) gpus = v;
        else if (!strcmp(a, "--run-id")) o.run_id = v;
        else if (!strcmp(a, "--master-addr")) o.master_addr = v;
        else if (!strcmp(a, "--device")) {
            if (strcmp(v, "cpu") && strcmp(v, "cuda") && strcmp(v, "auto")) {
                fprintf(stderr, "dflash train: --device '%s': want cpu, cuda or auto\n", v);
                return 2;
            }
            o.device = v;
        }
        else if (!strcmp(a, "--target-layers")) {
            /* ids of target layers, at most DF_MAX_TARGET_FEATURES of them (the drafter's
             * fc takes that many features): more is refused, not cut short */
            const char *p = v;
            ntl = 0;
            while (*p) {
                char *end;
                errno = 0;
                long id = strtol(p, &end, 10);
                if (end == p || errno || id < 0 || id >= DF_MAX_LAYERS ||
                    (*end && *end != ',') || (*end == ',' && !end[1])) {
                    fprintf(stderr, "dflash train: --target-layers '%s': want ids in 0..%d "
                                    "like 1,3\n", v, DF_MAX_LAYERS - 1);
                    return 2;
                }
                if (ntl == DF_MAX_TARGET_FEATURES) {
                    fprintf(stderr, "dflash train: --target-layers '%s': at most %d layers\n", v,
                            DF_MAX_TARGET_FEATURES);
                    return 2;
                }
                if (ntl > 0 && id <= tl[ntl - 1]) {
                    /* the cache's layers and the export's target_layer_ids are in layer order */
                    fprintf(stderr, "dflash train: --target-layers '%s': list each layer once, in "
                                    "increasing order\n", v);
                    return 2;
                }
                tl[ntl++] = (int)id;
                p = *end ? end + 1 : end;
            }
            o.target_layers = tl;
            o.n_target_layers = ntl;
        } else {
            /* every numeric option, with its range: a bad value is a usage error naming
             * the option, the value and the range (common/opt.h) */
            df_err pe = {0};
            int rc = 1; /* 1: not a numeric option */
            if (!strcmp(a, "--layers")) rc = df_opt_int(a, v, 1, DF_MAX_LAYERS, &o.layers, &pe);
            else if (!strcmp(a, "--sliding-window")) rc = df_opt_int(a, v, 1, 1 << 30, &o.sliding_window, &pe);
            else if (!strcmp(a, "--intermediate")) rc = df_opt_int(a, v, 1, 1 << 24, &o.intermediate, &pe);
            else if (!strcmp(a, "--heads")) rc = df_opt_int(a, v, 1, 4096, &o.heads, &pe);
            else if (!strcmp(a, "--kv-heads")) rc = df_opt_int(a, v, 1, 4096, &o.kv_heads, &pe);
            else if (!strcmp(a, "--head-dim")) rc = df_opt_int(a, v, 2, 4096, &o.head_dim, &pe);
            else if (!strcmp(a, "--block-size")) rc = df_opt_int(a, v, 2, DF_DRAFTER_MAX_BLOCK, &o.block_size, &pe);
            else if (!strcmp(a, "--mask-token")) rc = df_opt_i64(a, v, 0, INT32_MAX, &o.mask_token_id, &pe);
            else if (!strcmp(a, "--max-tokens")) rc = df_opt_int(a, v, 1, DF_CACHE_MAX_TOKENS, &o.max_tokens, &pe);
            else if (!strcmp(a, "--max-anchors")) rc = df_opt_int(a, v, 1, ROWS_MAX, &o.max_anchors, &pe);
            else if (!strcmp(a, "--rows-per-step")) rc = df_opt_int(a, v, 1, ROWS_MAX, &o.rows_per_step, &pe);
            else if (!strcmp(a, "--gamma")) rc = df_opt_double(a, v, 1e-3, 1e6, &o.gamma, &pe);
            else if (!strcmp(a, "--noise")) {
                double x = 0;
                if (!(rc = df_opt_double(a, v, 0, 1e6, &x, &pe)))
                    o.noise = (float)x;
            }
            /* 2^53: steps are counted in doubles by the schedule */
            else if (!strcmp(a, "--steps")) { rc = df_opt_i64(a, v, 0, (int64_t)1 << 53, &o.steps, &pe); steps_given = 1; }
            else if (!strcmp(a, "--lr")) rc = df_opt_double(a, v, DBL_MIN, 10, &o.lr, &pe); /* > 0 */
            else if (!strcmp(a, "--min-lr")) rc = df_opt_double(a, v, 0, 10, &o.min_lr, &pe);
            else if (!strcmp(a, "--warmup")) rc = df_opt_double(a, v, 0, 1, &o.warmup_frac, &pe);
            else if (!strcmp(a, "--clip")) rc = df_opt_double(a, v, 0, 1e30, &o.clip, &pe); /* 0: none */
            else if (!strcmp(a, "--init-std")) { rc = df_opt_double(a, v, 0, 10, &o.init_std, &pe); draws = 1; }
            else if (!strcmp(a, "--seed")) rc = df_opt_u64(a, v, 0, UINT64_MAX, &o.seed, &pe);
            /* 0 would mean "the --seed" (df_train_opts): not a value to give */
            else if (!strcmp(a, "--init-seed")) { rc = df_opt_u64(a, v, 1, UINT64_MAX, &o.init_seed, &pe); draws = 1; }
            else if (!strcmp(a, "--log-every")) rc = df_opt_int(a, v, 1, INT32_MAX, &o.log_every, &pe);
            else if (!strcmp(a, "--eval-every")) rc = df_opt_int(a, v, 0, INT32_MAX, &o.eval_every, &pe);
            else if (!strcmp(a, "--eval-rows")) rc = df_opt_int(a, v, 1, ROWS_MAX, &o.eval_rows, &pe);
            else if (!strcmp(a, "--ckpt-every")) rc = df_opt_int(a, v, 0, INT32_MAX, &o.ckpt_every, &pe);
            else if (!strcmp(a, "--keep-last")) rc = df_opt_int(a, v, 0, INT32_MAX, &o.keep_last, &pe);
            else if (!strcmp(a, "--threads")) rc = df_opt_int(a, v, 0, 4096, &o.threads, &pe);
            else if (!strcmp(a, "--gpu")) { rc = df_opt_int(a, v, 0, 1023, &o.gpu, &pe); gpu_given = 1; }
            else if (!strcmp(a, "--rank")) { rc = df_opt_int(a, v, 0, 1023, &o.rank, &pe); rank_given = 1; }
            else if (!strcmp(a, "--world-size")) rc = df_opt_int(a, v, 1, 1024, &o.world, &pe);
            else if (!strcmp(a, "--master-port")) rc = df_opt_int(a, v, 1, 65535, &o.master_port, &pe);
            else if (!strcmp(a, "--stop-after")) rc = df_opt_i64(a, v, 0, INT64_MAX, &o.stop_after, &pe);
            if (rc == 1) {
                fprintf(stderr, "dflash train: unknown option '%s'\n", a);
                usage(stderr);
                return 2;
            }
            if (rc) {
                fprintf(stderr, "dflash train: %s\n", pe.msg);
                return 2;
            }
        }
    }
    if (!o.cache_dir || (!o.target_dir && !o.random_target) || !o.run_dir || !steps_given ||
        o.steps < 0 || (o.steps == 0 && !o.init_from) || (o.mask_token_id < 0 && !o.init_from)) {
        fprintf(stderr, "dflash train: --cache, --target, --out, --steps (> 0; 0 only with "
                        "--init-from) and --mask-token (unless --init-from) are required\n");
        return 2;
    }
    if (o.init_from && draws) {
        fprintf(stderr, "dflash train: --init-from sets every weight: --fc-init-random, "
                        "--init-seed, --init-seed-for and --init-std have nothing to draw\n");
        return 2;
    }
    if (!o.master_addr != !o.master_port) {
        fprintf(stderr, "dflash train: --master-addr and --master-port go together\n");
        return 2;
    }
    /* flags that ask for opposite things: refused, not settled by their order */
    static const struct {
        unsigned a, b;
        const char *na, *nb;
    } clash[] = {{SEEN_RECOMPUTE, SEEN_NO_RECOMPUTE, "--recompute", "--no-recompute"},
                 {SEEN_RECOMPUTE_MLP, SEEN_NO_RECOMPUTE, "--recompute-mlp", "--no-recompute"},
                 {SEEN_OVERLAP, SEEN_NO_OVERLAP, "--overlap-optimizer", "--no-overlap-optimizer"},
                 {SEEN_FP8, SEEN_NO_FP8, "--fp8", "--no-fp8"},
                 {SEEN_DY_BLOCKS, SEEN_NO_DY_BLOCKS, "--fp8-dy-blocks", "--no-fp8-dy-blocks"},
                 {SEEN_ONEPASS, SEEN_NO_ONEPASS, "--fp8-ce-onepass", "--no-fp8-ce-onepass"},
                 {SEEN_M16, SEEN_NO_M16, "--adam-m-bf16", "--no-adam-m-bf16"}};
    for (size_t k = 0; k < sizeof clash / sizeof clash[0]; k++)
        if ((seen & clash[k].a) && (seen & clash[k].b)) {
            fprintf(stderr, "dflash train: %s and %s ask for opposite things: give one\n", clash[k].na,
                    clash[k].nb);
            return 2;
        }
    if (o.bf16_logits && o.f16_logits) {
        fprintf(stderr, "dflash train: --bf16-logits and --f16-logits: give one\n");
        return 2;
    }
    if (o.adam_v16 && (o.adam_bf16 || (seen & SEEN_NO_M16))) {
        fprintf(stderr, "dflash train: --adam-v16 keeps m in BF16 and v in UF16: not with %s\n",
                o.adam_bf16 ? "--adam-bf16" : "--no-adam-m-bf16");
        return 2;
    }
    if (o.adam_bf16 && (seen & SEEN_NO_M16)) {
        fprintf(stderr, "dflash train: --adam-bf16 keeps m in BF16 too: it and --no-adam-m-bf16 ask "
                        "for opposite things\n");
        return 2;
    }
    if (o.target_dir && o.random_target) {
        fprintf(stderr, "dflash train: --target and --random-target: give one\n");
        return 2;
    }
    if (gpus && gpu_given && !rank_given) { /* (the ranks --gpus starts get both, and --rank) */
        fprintf(stderr, "dflash train: --gpu and --gpus: give one\n");
        return 2;
    }
    if ((gpus || gpu_given) && o.device && !strcmp(o.device, "cpu")) {
        fprintf(stderr, "dflash train: --device cpu with %s: give one\n", gpus ? "--gpus" : "--gpu");
        return 2;
    }
    /* Ranks: a launcher's (torchrun / Slurm; CPU ranks too), or one process
     * per local GPU started here (--gpus), or one process. The ranks meet at
     * --master-addr/--master-port, else a launcher's MASTER_ADDR/MASTER_PORT
     * (torchrun, Slurm; --gpus over several nodes), else through a file in RUN. */
    int n_gpu = o.device && !strcmp(o.device, "cpu") ? 0 : df_backend_cuda_device_count();
    uint32_t lr_rank, lr_world, node, nodes;
    int lr_local;
    df_err le = {0};
    int launched = !rank_given ? cli_launcher_rank(&lr_rank, &lr_world, &lr_local, &le) : 0;
    if (launched < 0) {
        fprintf(stderr, "dflash train: %s\n", le.msg);
        return 2;
    }
    if (rank_given && o.rank >= o.world) {
        fprintf(stderr, "dflash train: --rank %d out of range for --world-size %d\n", o.rank, o.world);
        return 2;
    }
    if (launched) {
        o.rank = (int)lr_rank;
        o.world = (int)lr_world;
        if (master_from_env(&o))
            return 2;
        if (!gpu_given && n_gpu > 0)
            o.gpu = lr_local % n_gpu;
        if (!o.run_id && !(o.run_id = cli_run_id_from_env(idbuf, sizeof idbuf))) {
            fprintf(stderr, "dflash train: rank %u of %u: set DFLASH_RUN_ID (the same in every "
                            "rank, new for every launch) or pass --run-id\n", lr_rank, lr_world);
            return 2;
        }
    } else if (gpus && !rank_given) {
        if (n_gpu <= 0) {
            fprintf(stderr, "dflash train: --gpus: no CUDA device is visible%s\n",
                    n_gpu < 0 ? " (this build has no CUDA)" : "");
            return 2;
        }
        int n = n_gpu;
        if (strcmp(gpus, "all")) {
            char *end;
            long k = strtol(gpus, &end, 10);
            if (*end || k < 1 || k > n_gpu) {
                fprintf(stderr, "dflash train: --gpus '%s': want all or 1..%d\n", gpus, n_gpu);
                return 2;
            }
            n = (int)k;
        }
        cli_node_rank(&node, &nodes);
        if (n > 1 || nodes > 1) {
            if (!o.run_id && !(o.run_id = cli_run_id_from_env(idbuf, sizeof idbuf))) {
                if (nodes > 1) {
                    fprintf(stderr, "dflash train: several nodes: set DFLASH_RUN_ID (the same on "
                                    "every node, new for every launch)\n");
                    return 2;
                }
                snprintf(idbuf, sizeof idbuf, "p%ld-%ld", (long)getpid(), (long)time(NULL));
                o.run_id = idbuf;
            }
            /* one node: the file in RUN, unless --master-addr/--master-port (in argv) */
            spawn_extra x = {.run_id = o.run_id};
            if (nodes > 1 && !o.master_addr) {
                if (master_from_env(&o))
                    return 2;
                x.master_addr = o.master_addr;
                snprintf(x.port, sizeof x.port, "%d", o.master_port);
            }
            return cli_spawn_ranks("train", argc, argv, n, node, nodes, spawn_extra_fn, &x) ? 1
                                                                                         : 0;
        }
        o.gpu = 0;
    }
    /* testing: every rank trains on rank 0's rows (N ranks must then give one rank's result) */
    o.replicate_data = df_knob_int(DF_KNOB_TEST_REPLICATE_DATA);
    if (o.world > 1 && !o.device)
        o.device = n_gpu > 0 ? "cuda" : "cpu";
    df_err e = {0};
    int rc = df_train_run(&o, &e);
    if (rc) {
        fprintf(stderr, "dflash train: %s\n", e.msg);
        return 1;
    }
    return 0;
}

/* `dflash train-step --in FILE [--out FILE]`: one step's loss and gradients. */
int cmd_train_step(int argc, char **argv)
{
    const char *in = NULL, *out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: dflash train-step --in ROW.safetensors [--out GRADS.safetensors]\n"
                   "Loss, tau_hat, acc[k] and every parameter's gradient of one drafter row from\n"
                   "explicit inputs (features, anchors, block tokens, labels, weights, frozen\n"
                   "embedding/head, all weights): the format of scripts/dflash_reference.py,\n"
                   "documented in train/onestep.h. For checking us against another implementation.\n");
            return 0;
        }
        if (i + 1 < argc && !strcmp(argv[i], "--in"))
            in = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--out"))
            out = argv[++i];
        else {
            fprintf(stderr, "dflash train-step: bad argument '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!in) {
        fprintf(stderr, "dflash train-step: --in is required\n");
        return 2;
    }
    df_err e = {0};
    df_onestep_result r;
    if (df_train_onestep(in, out, &r, &e)) {
        fprintf(stderr, "dflash train-step: %s\n", e.msg);
        return 1;
    }
    printf("loss %.7f  tau_hat %.4f  (%d parameter tensors%s%s)\n", r.loss, r.tau_hat, r.n_params,
           out ? ", gradients in " : "", out ? out : "");
    return 0;
}
