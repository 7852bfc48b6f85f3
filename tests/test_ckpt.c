/* test_ckpt.c - the LR schedule, training checkpoints (round trip, newest
 * wins, crashes at every stage of a save, corruption, pruning, locking) and
 * the serving export (names, shapes, BF16 RNE values, config.json keys). */
#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ckpt.h"
#include "dtype.h"
#include "fsutil.h"
#include "knobs.h"
#include "params.h"
#include "safetensors.h"
#include "schedule.h"
#include "test.h"

#define CLOSE(a, b) (fabs((a) - (b)) <= 1e-12 + 1e-9 * fabs(b))

/* ---- schedule ---- */
static void test_schedule(void)
{
    df_err e;
    df_lr_schedule s;
    CHECK_OK(df_lr_schedule_init(&s, 6e-4, 0.0, 1000, 0.04, &e), &e);
    CHECK_EQ(s.warmup_steps, 40);
    CHECK(df_lr_at(&s, -1) == 0.0);
    CHECK(CLOSE(df_lr_at(&s, 0), 6e-4 / 40));
    CHECK(CLOSE(df_lr_at(&s, 19), 6e-4 * 20 / 40));
    CHECK(CLOSE(df_lr_at(&s, 39), 6e-4));
    CHECK(CLOSE(df_lr_at(&s, 40), 6e-4));
    CHECK(CLOSE(df_lr_at(&s, 40 + 480), 3e-4)); /* half way through the cosine */
    CHECK(CLOSE(df_lr_at(&s, 40 + 240), 6e-4 * 0.5 * (1 + cos(M_PI / 4))));
    double last = df_lr_at(&s, 999);
    CHECK(last > 0 && last < 1e-8);
    CHECK(df_lr_at(&s, 1000) == 0.0);
    CHECK(df_lr_at(&s, 5000) == 0.0);
    for (int64_t t = 1; t < 1000; t++) {
        if (t < 40)
            CHECK(df_lr_at(&s, t) > df_lr_at(&s, t - 1));
        else
            CHECK(df_lr_at(&s, t) <= df_lr_at(&s, t - 1));
    }
    /* a floor */
    CHECK_OK(df_lr_schedule_init(&s, 1e-3, 1e-4, 200, 0.1, &e), &e);
    CHECK_EQ(s.warmup_steps, 20);
    CHECK(CLOSE(df_lr_at(&s, 110), 1e-4 + 0.5 * 9e-4));
    CHECK(df_lr_at(&s, 200) == 1e-4);
    CHECK(df_lr_at(&s, 199) > 1e-4);
    /* no warmup */
    CHECK_OK(df_lr_schedule_init(&s, 2e-4, 0, 10, 0, &e), &e);
    CHECK_EQ(s.warmup_steps, 0);
    CHECK(CLOSE(df_lr_at(&s, 0), 2e-4));
    /* warmup rounding: ceil, robust to 0.07*100 = 7.000000000000001 */
    CHECK_EQ(df_lr_warmup_steps(100, 0.07), 7);
    CHECK_EQ(df_lr_warmup_steps(101, 0.04), 5);
    CHECK_EQ(df_lr_warmup_steps(10, 1.0), 10);
    CHECK_OK(df_lr_schedule_init(&s, 1e-3, 0, 3, 1.0, &e), &e);
    CHECK(CLOSE(df_lr_at(&s, 2), 1e-3));
    CHECK(df_lr_at(&s, 3) == 0.0);
    /* invalid */
    CHECK_ERR(df_lr_schedule_init(&s, 0, 0, 10, 0.04, &e), -EINVAL, &e, "peak");
    CHECK_ERR(df_lr_schedule_init(&s, 1e-3, 2e-3, 10, 0.04, &e), -EINVAL, &e, "min lr");
    CHECK_ERR(df_lr_schedule_init(&s, 1e-3, 0, 0, 0.04, &e), -EINVAL, &e, "total");
    CHECK_ERR(df_lr_schedule_init(&s, 1e-3, 0, 10, 1.5, &e), -EINVAL, &e, "warmup");
    CHECK_ERR(df_lr_schedule_init(&s, NAN, 0, 10, 0.1, &e), -EINVAL, &e, "peak");
}

/* ---- fixtures ---- */
static df_drafter_config tiny_config(void)
{
    df_drafter_config c;
    memset(&c, 0, sizeof c);
    c.block_size = 4;
    c.mask_token_id = 96;
    c.num_target_features = 2;
    c.num_target_layers = 8;
    CHECK_EQ(df_default_target_layers(8, 2, c.target_layer_ids), 0);
    c.num_hidden_layers = 2;
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 1e7;
    c.max_position_embeddings = 4096;
    c.layer_types[0] = DF_LAYER_SLIDING;
    c.layer_types[1] = DF_LAYER_FULL;
    c.sliding_window = 16;
    c.use_sliding_window = true;
    c.vocab_size = 97;
    df_err e;
    CHECK_OK(df_drafter_config_validate(&c, "tiny", &e), &e);
    return c;
}

typedef struct fixture {
    df_ckpt_state st;
    df_params ps;
    unsigned char rng[40], pos[24];
    char hp[128];
} fixture;

/* A state whose every array and blob is random (never zeros); seed varies it. */
static void fixture_make(fixture *f, int64_t step, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    df_err e;
    f->st.config = tiny_config();
    CHECK_OK(df_params_build(&f->st.config, &f->ps, &e), &e);
    int64_t n = f->ps.total;
    f->st.n_floats = n;
    f->st.step = step;
    f->st.master = malloc((size_t)n * 4);
    f->st.adam_m = malloc((size_t)n * 4);
    f->st.adam_v = malloc((size_t)n * 4);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) {
        f->st.master[i] = test_randn(&s) * 0.02f;
        f->st.adam_m[i] = test_randn(&s) * 1e-3f;
        f->st.adam_v[i] = fabsf(test_randn(&s)) * 1e-6f + 1e-12f;
    }
    for (size_t i = 0; i < sizeof f->rng; i++)
        f->rng[i] = (unsigned char)(test_rand(&s) | 1);
    for (size_t i = 0; i < sizeof f->pos; i++)
        f->pos[i] = (unsigned char)(test_rand(&s) | 2);
    f->st.rng_state = f->rng;
    f->st.rng_len = sizeof f->rng;
    f->st.data_position = f->pos;
    f->st.data_position_len = sizeof f->pos;
    snprintf(f->hp, sizeof f->hp, "{\"lr\": 0.0006, \"epochs\": 6, \"seed\": %llu}\n",
             (unsigned long long)(seed & 0xffff));
    f->st.hparams_json = f->hp;
}

static void fixture_free(fixture *f)
{
    free(f->st.master);
    free(f->st.adam_m);
    free(f->st.adam_v);
    df_params_free(&f->ps);
}

/* The loaded state equals what was saved, bit for bit. */
static void check_same(const df_ckpt_state *got, const fixture *f)
{
    df_err e;
    CHECK_EQ(got->step, f->st.step);
    CHECK_EQ(got->n_floats, f->ps.total);
    size_t nb = (size_t)f->ps.total * 4;
    CHECK(got->master && !memcmp(got->master, f->st.master, nb));
    CHECK(got->adam_m && !memcmp(got->adam_m, f->st.adam_m, nb));
    CHECK(got->adam_v && !memcmp(got->adam_v, f->st.adam_v, nb));
    CHECK_EQ(got->rng_len, sizeof f->rng);
    CHECK(got->rng_state && !memcmp(got->rng_state, f->rng, sizeof f->rng));
    CHECK_EQ(got->data_position_len, sizeof f->pos);
    CHECK(got->data_position && !memcmp(got->data_position, f->pos, sizeof f->pos));
    CHECK(got->hparams_json && !strcmp(got->hparams_json, f->hp));
    char *a = df_drafter_config_to_json(&got->config, &e), *b = df_drafter_config_to_json(&f->st.config, &e);
    CHECK(a && b && !strcmp(a, b));
    free(a);
    free(b);
}

static int exists(const char *dir, const char *name)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat sb;
    return stat(p, &sb) == 0;
}

static char *slurp(const char *dir, const char *name, size_t *len)
{
    char p[4096], *buf = NULL;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    df_err e;
    *len = 0;
    CHECK_OK(df_file_read_all(p, 1u << 30, &buf, len, &e), &e);
    return buf;
}

static void spit(const char *dir, const char *name, const void *data, size_t len)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *fp = fopen(p, "wb");
    CHECK(fp != NULL);
    if (!fp)
        return;
    CHECK_EQ(fwrite(data, 1, len, fp), len);
    fclose(fp);
}

/* ---- round trip, newest wins, EEXIST, pruning, validation of inputs ---- */
static void test_round_trip(void)
{
    const char *run = test_tmpdir("ckpt_rt");
    df_err e;
    df_ckpt_state got;
    CHECK_ERR(df_ckpt_load_latest(run, &got, &e), -ENOENT, &e, "no checkpoint");
    char nope[4096];
    snprintf(nope, sizeof nope, "%s/nope", run);
    CHECK_ERR(df_ckpt_load_latest(nope, &got, &e), -ENOENT, &e, "nope");

    fixture a, b;
    fixture_make(&a, 100, 1);
    fixture_make(&b, 200, 2);
    CHECK_OK(df_ckpt_save(run, &a.st, 0, &e), &e);
    CHECK_OK(df_ckpt_load_latest(run, &got, &e), &e);
    check_same(&got, &a);
    CHECK(strstr(got.loaded_from, "ckpt-0000000100") != NULL);
    df_ckpt_state_free(&got);
    size_t n;
    char *latest = slurp(run, "latest", &n);
    CHECK(latest && !strcmp(latest, "ckpt-0000000100\n"));
    free(latest);
    char d[4096];
    snprintf(d, sizeof d, "%s/ckpt-0000000100", run);
    static const char *const files[] = {"config.json", "hparams.json", "state.safetensors",
                                        "manifest.json", "COMPLETE"};
    for (int i = 0; i < 5; i++)
        CHECK(exists(d, files[i]));
    /* state.safetensors is a plain safetensors file with per-parameter names */
    char sp[4096];
    snprintf(sp, sizeof sp, "%s/state.safetensors", d);
    df_st *st;
    CHECK_OK(df_st_open(sp, &st, &e), &e);
    if (st) {
        const df_st_tensor *t;
        int64_t sh[2] = {32, 64};
        CHECK_OK(df_st_expect(st, "adam_v.fc.weight", DF_DTYPE_F32, 2, sh, &t, &e), &e);
        CHECK(!memcmp(t->data, a.st.adam_v, (size_t)t->nbytes));
        CHECK_EQ(df_st_count(st), 3 * a.ps.n + 2);
        df_st_close(st);
    }

    /* the newest wins */
    CHECK_OK(df_ckpt_save(run, &b.st, 0, &e), &e);
    CHECK_OK(df_ckpt_load_latest(run, &got, &e), &e);
    check_same(&got, &b);
    df_ckpt_state_free(&got);
    /* an older one explicitly */
    CHECK_OK(df_ckpt_load(d, &got, &e), &e);
    check_same(&got, &a);
    df_ckpt_state_free(&got);
    /* the same step twice is refused, the existing one untouched */
    CHECK_ERR(df_ckpt_save(run, &a.st, 0, &e), -EEXIST, &e, "ckpt-0000000100");
    df_ckpt_info *v;
    int cnt;
    CHECK_OK(df_ckpt_list(run, &v, &cnt, &e), &e);
    CHECK_EQ(cnt, 2);
    if (cnt == 2) {
        CHECK_EQ(v[0].step, 100);
        CHECK_EQ(v[1].step, 200);
        CHECK(v[0].complete && v[1].complete);
        CHECK(!strcmp(v[1].name, "ckpt-0000000200"));
    }
    free(v);

    /* keep the last 2 */
    fixture c;
    fixture_make(&c, 300, 3);
    CHECK_OK(df_ckpt_save(run, &c.st, 2, &e), &e);
    CHECK_OK(df_ckpt_list(run, &v, &cnt, &e), &e);
    CHECK_EQ(cnt, 2);
    if (cnt == 2)
        CHECK(v[0].step == 200 && v[1].step == 300);
    free(v);
    CHECK(!exists(run, "ckpt-0000000100"));
    CHECK(!exists(run, "ckpt-0000000100.deleting"));
    c.st.step = 400;
    CHECK_OK(df_ckpt_save(run, &c.st, 1, &e), &e);
    CHECK_OK(df_ckpt_list(run, &v, &cnt, &e), &e);
    CHECK(cnt == 1 && v[0].step == 400);
    free(v);
    CHECK_OK(df_ckpt_load_latest(run, &got, &e), &e);
    check_same(&got, &c);
    df_ckpt_state_free(&got);

    /* empty blobs and no hyperparameters also round-trip */
    fixture z;
    fixture_make(&z, 0, 9);
    z.st.rng_len = 0;
    z.st.rng_state = NULL;
    z.st.hparams_json = NULL;
    const char *run2 = test_tmpdir("ckpt_rt_empty");
    CHECK_OK(df_ckpt_save(run2, &z.st, 0, &e), &e);
    CHECK_OK(df_ckpt_load_latest(run2, &got, &e), &e);
    CHECK_EQ(got.step, 0);
    CHECK_EQ(got.rng_len, 0);
    CHECK(got.hparams_json == NULL);
    CHECK(got.master && !memcmp(got.master, z.st.master, (size_t)z.ps.total * 4));
    df_ckpt_state_free(&got);

    /* bad inputs to save */
    const char *run3 = test_tmpdir("ckpt_bad_in");
    z.st.step = 5;
    z.st.n_floats--;
    CHECK_ERR(df_ckpt_save(run3, &z.st, 0, &e), -DF_EMISMATCH, &e, "floats");
    z.st.n_floats++;
    z.st.hparams_json = "{not json";
    CHECK_ERR(df_ckpt_save(run3, &z.st, 0, &e), -EINVAL, &e, "not JSON");
    z.st.hparams_json = NULL;
    z.st.data_position_len = DF_CKPT_MAX_BLOB + 1;
    CHECK_ERR(df_ckpt_save(run3, &z.st, 0, &e), -EINVAL, &e, "larger");
    z.st.data_position_len = sizeof z.pos;
    z.st.step = -1;
    CHECK_ERR(df_ckpt_save(run3, &z.st, 0, &e), -EINVAL, &e, "negative");
    z.st.step = 5;
    z.st.config.num_key_value_heads = 3; /* does not divide 4 */
    CHECK(df_ckpt_save(run3, &z.st, 0, &e) < 0);
    z.st.config = tiny_config();
    CHECK_ERR(df_ckpt_load_latest(run3, &got, &e), -ENOENT, &e, "no checkpoint");

    /* a second writer is refused while the lock is held */
    char lp[4096];
    snprintf(lp, sizeof lp, "%s/.ckpt.lock", run3);
    int fd = open(lp, O_RDWR | O_CREAT, 0644);
    CHECK(fd >= 0 && flock(fd, LOCK_EX) == 0);
    CHECK_ERR(df_ckpt_save(run3, &z.st, 0, &e), -EBUSY, &e, "another process");
    close(fd);
    CHECK_OK(df_ckpt_save(run3, &z.st, 0, &e), &e);

    fixture_free(&a);
    fixture_free(&b);
    fixture_free(&c);
    fixture_free(&z);
}

/* ---- kill -9 at every stage of a save ---- */
static void test_crash(void)
{
    static const struct {
        const char *stage;
        int new_visible; /* the interrupted save's checkpoint is the resumed one */
    } stages[] = {{"config", 0}, {"state", 0}, {"manifest", 0}, {"complete", 0},
                  {"rename", 1}, {"latest", 1}};
    df_err e;
    for (size_t k = 0; k < sizeof stages / sizeof stages[0]; k++) {
        const char *run = test_tmpdir("ckpt_crash");
        fixture a, b;
        fixture_make(&a, 10, 11);
        fixture_make(&b, 20, 22);
        CHECK_OK(df_ckpt_save(run, &a.st, 1, &e), &e);
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) {
            df_knob_set(DF_KNOB_CKPT_TEST_KILL_AT, stages[k].stage);
            df_err ce;
            df_ckpt_save(run, &b.st, 1, &ce);
            _exit(3); /* the hook did not fire */
        }
        int status = 0;
        CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
        df_ckpt_state got;
        CHECK_OK(df_ckpt_load_latest(run, &got, &e), &e);
        if (stages[k].new_visible)
            check_same(&got, &b);
        else
            check_same(&got, &a);
        df_ckpt_state_free(&got);
        /* the earlier checkpoint is intact whatever happened */
        char d[4096];
        snprintf(d, sizeof d, "%s/ckpt-0000000010", run);
        CHECK_OK(df_ckpt_load(d, &got, &e), &e);
        check_same(&got, &a);
        df_ckpt_state_free(&got);
        if (!stages[k].new_visible)
            CHECK(exists(run, "ckpt-0000000020.tmp")); /* left behind, never listed */
        df_ckpt_info *v;
        int n;
        CHECK_OK(df_ckpt_list(run, &v, &n, &e), &e);
        CHECK_EQ(n, stages[k].new_visible ? 2 : 1);
        free(v);
        /* the next save cleans up and works (re-saving step 20 when it was lost) */
        fixture c;
        fixture_make(&c, stages[k].new_visible ? 30 : 20, 33);
        CHECK_OK(df_ckpt_save(run, &c.st, 1, &e), &e);
        CHECK(!exists(run, "ckpt-0000000020.tmp"));
        CHECK_OK(df_ckpt_load_latest(run, &got, &e), &e);
        check_same(&got, &c);
        df_ckpt_state_free(&got);
        CHECK_OK(df_ckpt_list(run, &v, &n, &e), &e);
        CHECK_EQ(n, 1);
        free(v);
        fixture_free(&a);
        fixture_free(&b);
        fixture_free(&c);
    }
}

/* ---- damaged checkpoints: clear errors naming the file, never a crash ---- */
static void expect_load_fails(const char *run, const char *needle, int code, int line)
{
    df_err e;
    df_ckpt_state got;
    int rc = df_ckpt_load_latest(run, &got, &e);
    if (rc >= 0 || (code && rc != code) || (needle && !strstr(e.msg, needle))) {
        fprintf(stderr, "%s:%d: damaged checkpoint: rc %d, want %d, msg \"%s\", want \"%s\"\n",
                __FILE__, line, rc, code, rc < 0 ? e.msg : "", needle ? needle : "");
        df_test_failures++;
    }
    if (rc >= 0)
        df_ckpt_state_free(&got);
}
#define LOAD_FAILS(run, needle, code) expect_load_fails(run, needle, code, __LINE__)

static void flip_each(const char *run, const char *dir, const char *name, size_t stride)
{
    size_t len;
    char *orig = slurp(dir, name, &len);
    if (!orig)
        return;
    for (size_t i = 0; i < len; i += stride) {
        orig[i] ^= 0x5a;
        spit(dir, name, orig, len);
        LOAD_FAILS(run, name, 0);
        orig[i] ^= 0x5a;
    }
    /* truncations */
    size_t cuts[] = {0, 1, 7, 8, 9, len / 3, len / 2, len - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        if (cuts[i] >= len)
            continue;
        spit(dir, name, orig, cuts[i]);
        LOAD_FAILS(run, name, 0);
    }
    spit(dir, name, orig, len);
    free(orig);
}

static void test_corrupt(void)
{
    const char *run = test_tmpdir("ckpt_corrupt");
    df_err e;
    fixture a, b;
    fixture_make(&a, 1, 41);
    fixture_make(&b, 2, 42);
    CHECK_OK(df_ckpt_save(run, &a.st, 0, &e), &e);
    CHECK_OK(df_ckpt_save(run, &b.st, 0, &e), &e);
    char d[4096], old[4096];
    snprintf(d, sizeof d, "%s/ckpt-0000000002", run);
    snprintf(old, sizeof old, "%s/ckpt-0000000001", run);

    /* one flipped byte in the middle of the arrays: CRC */
    size_t len;
    char *sf = slurp(d, "state.safetensors", &len);
    if (sf) {
        sf[len / 2] ^= 1;
        spit(d, "state.safetensors", sf, len);
        LOAD_FAILS(run, "state.safetensors: adam_v: crc32c", -DF_ECORRUPT);
        LOAD_FAILS(run, "newest checkpoint ckpt-0000000002 unusable", -DF_ECORRUPT);
        /* the older one is still there, on request */
        df_ckpt_state got;
        CHECK_OK(df_ckpt_load(old, &got, &e), &e);
        check_same(&got, &a);
        df_ckpt_state_free(&got);
        sf[len / 2] ^= 1;
        spit(d, "state.safetensors", sf, len);
        /* the rng blob (the last bytes of the file) */
        sf[len - 1] ^= 0x80;
        spit(d, "state.safetensors", sf, len);
        LOAD_FAILS(run, "crc32c", -DF_ECORRUPT);
        sf[len - 1] ^= 0x80;
        spit(d, "state.safetensors", sf, len);
        free(sf);
    }
    /* every byte of the small files, a sample of the big one, truncations */
    flip_each(run, d, "COMPLETE", 1);
    flip_each(run, d, "manifest.json", 1);
    flip_each(run, d, "config.json", 1);
    flip_each(run, d, "hparams.json", 1);
    flip_each(run, d, "state.safetensors", 97);
    df_ckpt_state got;
    CHECK_OK(df_ckpt_load_latest(run, &got, &e), &e); /* all restored */
    check_same(&got, &b);
    df_ckpt_state_free(&got);

    /* missing files */
    static const char *const files[] = {"COMPLETE", "manifest.json", "config.json",
                                        "hparams.json", "state.safetensors"};
    for (int i = 0; i < 5; i++) {
        char *buf = slurp(d, files[i], &len);
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", d, files[i]);
        unlink(p);
        LOAD_FAILS(run, files[i], 0);
        spit(d, files[i], buf, len);
        free(buf);
    }
    /* a future format version */
    char *cm = slurp(d, "COMPLETE", &len);
    if (cm) {
        cm[12] = '2';
        spit(d, "COMPLETE", cm, len);
        LOAD_FAILS(run, "COMPLETE: checkpoint format version 2", -DF_EVERSION);
        cm[12] = '1';
        spit(d, "COMPLETE", cm, len);
        free(cm);
    }
    /* `latest` naming a checkpoint that is gone */
    spit(run, "latest", "ckpt-0000000009\n", 16);
    LOAD_FAILS(run, "latest: names ckpt-0000000009", -DF_ECORRUPT);
    spit(run, "latest", "garbage", 7);
    LOAD_FAILS(run, "latest: malformed", -DF_ECORRUPT);
    spit(run, "latest", "ckpt-0000000002\n", 16);
    /* a newest directory without its marker is an error, not a fall-back */
    char d3[4096];
    snprintf(d3, sizeof d3, "%s/ckpt-0000000003", run);
    CHECK(mkdir(d3, 0755) == 0);
    LOAD_FAILS(run, "ckpt-0000000003/COMPLETE: missing", -DF_ECORRUPT);
    rmdir(d3);
    CHECK_OK(df_ckpt_load_latest(run, &got, &e), &e);
    check_same(&got, &b);
    df_ckpt_state_free(&got);
    fixture_free(&a);
    fixture_free(&b);
}

/* ---- export ---- */
static uint16_t rne_ref(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t hi = u >> 16, lo = u & 0xffff;
    if (lo > 0x8000 || (lo == 0x8000 && (hi & 1)))
        hi++;
    return (uint16_t)hi;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void check_export(const char *out, const df_params *ps, const float *master)
{
    df_err e;
    df_st *st = NULL;
    CHECK_OK(df_st_open(out, &st, &e), &e);
    if (!st)
        return;
    CHECK_EQ(df_st_count(st), ps->n);
    CHECK(df_st_file_count(st) == 1);
    long bad = 0;
    for (int i = 0; i < ps->n; i++) {
        const df_param *q = &ps->p[i];
        const df_st_tensor *t;
        if (df_st_expect(st, q->name, DF_DTYPE_BF16, q->ndim, q->shape, &t, &e) < 0) {
            CHECK_OK(-1, &e);
            continue;
        }
        for (int64_t k = 0; k < q->numel; k++) {
            uint16_t h;
            memcpy(&h, (const char *)t->data + 2 * k, 2);
            bad += h != rne_ref(master[q->offset + k]);
        }
    }
    CHECK_EQ(bad, 0);
    df_st_close(st);
}

static void test_export(void)
{
    const char *base = test_tmpdir("ckpt_export");
    char out[4096];
    snprintf(out, sizeof out, "%s/drafter", base);
    df_err e;
    fixture f;
    fixture_make(&f, 7, 51);
    float *m = f.st.master;
    /* rounding cases at the start of fc.weight: ties to even, above/below a tie */
    m[0] = from_bits(0x3f808000); /* tie, even below: down */
    m[1] = from_bits(0x3f818000); /* tie, odd below: up */
    m[2] = from_bits(0x3f808001); /* just above a tie: up */
    m[3] = from_bits(0xbf807fff); /* just below a tie: down */
    m[4] = from_bits(0x7f7fffff); /* FLT_MAX rounds to inf (RNE) */
    m[5] = from_bits(0x00000001); /* denormal */
    CHECK_EQ(rne_ref(m[0]), 0x3f80);
    CHECK_EQ(rne_ref(m[1]), 0x3f82);
    CHECK_EQ(rne_ref(m[2]), 0x3f81);
    CHECK_EQ(rne_ref(m[3]), 0xbf80);
    CHECK_OK(df_export_drafter(out, &f.st.config, &f.ps, m, &e), &e);
    check_export(out, &f.ps, m);

    /* config.json: parses back, and has exactly the docs/DRAFTER.md keys */
    df_drafter_config back;
    CHECK_OK(df_drafter_config_load(out, &back, &e), &e);
    CHECK_EQ(back.hidden_size, 32);
    CHECK_EQ(back.num_target_features, 2);
    CHECK_EQ(back.layer_types[0], DF_LAYER_SLIDING);
    CHECK_EQ(back.layer_types[1], DF_LAYER_FULL);
    size_t len;
    char *txt = slurp(out, "config.json", &len);
    cJSON *j = txt ? cJSON_Parse(txt) : NULL;
    CHECK(cJSON_IsObject(j));
    if (j) {
        static const char *const keys[] = {
            "architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
            "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
            "max_position_embeddings", "layer_types", "sliding_window", "use_sliding_window",
            "vocab_size", "tie_word_embeddings", "hidden_act", "attention_bias", "torch_dtype",
            "dtype", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"};
        size_t nk = sizeof keys / sizeof keys[0];
        CHECK_EQ(cJSON_GetArraySize(j), (int)nk);
        for (size_t i = 0; i < nk; i++)
            if (!cJSON_HasObjectItem(j, keys[i])) {
                fprintf(stderr, "config.json lacks %s\n", keys[i]);
                df_test_failures++;
            }
        const cJSON *ar = cJSON_GetObjectItem(j, "architectures");
        CHECK(cJSON_GetArraySize(ar) == 1 &&
              !strcmp(cJSON_GetStringValue(cJSON_GetArrayItem(ar, 0)), "DFlashDraftModel"));
        CHECK(!strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(j, "model_type")), "qwen3"));
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "block_size")) == 4);
        const cJSON *dc = cJSON_GetObjectItem(j, "dflash_config");
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(dc, "block_size")) == 4);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(dc, "mask_token_id")) == 96);
        const cJSON *ids = cJSON_GetObjectItem(dc, "target_layer_ids");
        CHECK(cJSON_GetArraySize(ids) == 2 && cJSON_GetArrayItem(ids, 0)->valuedouble == 1 &&
              cJSON_GetArrayItem(ids, 1)->valuedouble == 5);
        const cJSON *lt = cJSON_GetObjectItem(j, "layer_types");
        CHECK(cJSON_GetArraySize(lt) == 2 &&
              !strcmp(cJSON_GetStringValue(cJSON_GetArrayItem(lt, 0)), "sliding_attention") &&
              !strcmp(cJSON_GetStringValue(cJSON_GetArrayItem(lt, 1)), "full_attention"));
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "sliding_window")) == 16);
        CHECK(cJSON_IsTrue(cJSON_GetObjectItem(j, "use_sliding_window")));
        CHECK(cJSON_IsFalse(cJSON_GetObjectItem(j, "tie_word_embeddings")));
        CHECK(cJSON_IsNull(cJSON_GetObjectItem(j, "rope_scaling")));
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "vocab_size")) == 97);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "num_target_layers")) == 8);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "head_dim")) == 8);
        CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "num_key_value_heads")) == 2);
    }
    cJSON_Delete(j);
    free(txt);

    /* re-export over a previous export: replaced as a whole, no leftovers */
    for (int64_t i = 0; i < f.ps.total; i++)
        m[i] = m[i] * 0.5f + 1e-3f;
    CHECK_OK(df_export_drafter(out, &f.st.config, &f.ps, m, &e), &e);
    check_export(out, &f.ps, m);
    CHECK(!exists(base, "drafter.dflash-export.tmp") && !exists(base, "drafter.dflash-export.old"));

    /* non-finite weights are refused; the export on disk is untouched */
    float keep = m[100];
    m[100] = NAN;
    CHECK_ERR(df_export_drafter(out, &f.st.config, &f.ps, m, &e), -EINVAL, &e, "fc.weight[100]");
    m[100] = keep;
    check_export(out, &f.ps, m);
    /* a directory holding other files is not replaced */
    spit(out, "README.md", "mine\n", 5);
    CHECK_ERR(df_export_drafter(out, &f.st.config, &f.ps, m, &e), -EEXIST, &e, "README.md");
    CHECK(exists(out, "README.md"));
    check_export(out, &f.ps, m);
    /* a table that does not belong to the config */
    df_drafter_config other = f.st.config;
    other.intermediate_size = 64;
    CHECK_ERR(df_export_drafter(out, &other, &f.ps, m, &e), -DF_EMISMATCH, &e, "parameter table");
    fixture_free(&f);
}

int main(void)
{
    test_schedule();
    test_round_trip();
    test_crash();
    test_corrupt();
    test_export();
    return test_main_end();
}
