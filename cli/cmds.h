/* cmds.h - the subcommands of the dflash binary. Each takes argc/argv
 * starting at its own name and returns the process exit code:
 * 0 success, 1 failure of the work (corrupt data, I/O error), 2 bad usage. */
#ifndef DF_CMDS_H
#define DF_CMDS_H

int cmd_dump(int argc, char **argv);
int cmd_corpus(int argc, char **argv);
int cmd_cache(int argc, char **argv);
int cmd_cache_diff(int argc, char **argv); /* dflash cache diff */
int cmd_cache_project(int argc, char **argv); /* dflash cache project */
int cmd_cache_plan(int argc, char **argv); /* dflash cache plan */
int cmd_extract(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_export(int argc, char **argv); /* dflash export */
int cmd_eval(int argc, char **argv);   /* dflash eval */
int cmd_train_step(int argc, char **argv);
int cmd_env(int argc, char **argv); /* dflash env */

#endif
