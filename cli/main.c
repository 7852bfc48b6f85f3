/* dflash - one binary, one subcommand per stage of the pipeline. */
#include <stdio.h>
#include <string.h>

#include "cmds.h"
#include "mapguard.h"

#include "version.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} cmds[] = {
    {"corpus", cmd_corpus, "tokenized corpora: import JSONL into binary token shards, inspect them"},
    {"cache", cmd_cache, "size a cache before making it (plan); project it onto a basis (project);\n"
                         "              compare two (diff); synthesize one (synth); stream one and time it (read)"},
    {"dump", cmd_dump, "inspect a hidden-state cache: summary, samples, slices, --verify, --json"},
    {"extract", cmd_extract, "run the target over a corpus and write the hidden-state cache"},
    {"train", cmd_train, "train a DFlash drafter from a cache (CPU, one GPU or many)"},
    {"export", cmd_export, "the serving export (config.json + model.safetensors) of any checkpoint of a run"},
    {"eval", cmd_eval, "score an exported drafter on a held-out cache (loss, acc[k], tau_hat, tau_walk)"},
    {"train-step", cmd_train_step, "one step's loss + gradients from a safetensors file (for checking)"},
    {"env", cmd_env, "the DFLASH_* environment knobs: what each does, its default, the value in use"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: dflash <command> [options]   (dflash <command> --help for its options)\n\n");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        fprintf(f, "  %-11s %s\n", cmds[i].name, cmds[i].help);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("dflash %s\n", DFLASH_VERSION);
        return 0;
    }
    /* an input file truncated under a run: a message naming it, not "Bus error" */
    (void)df_mapguard_install();
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(argv[1], cmds[i].name))
            return cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "dflash: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
