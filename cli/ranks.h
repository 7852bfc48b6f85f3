/* ranks.h - how a command learns its rank: a launcher's environment
 * (torchrun, Slurm), one process per local GPU started by the command itself
 * (--gpus), and the token that names one launch's rendezvous. */
#ifndef DF_CLI_RANKS_H
#define DF_CLI_RANKS_H

#include <stdint.h>

#include "err.h"

/* 1 with this process's rank/world/local rank from torchrun (RANK,
 * WORLD_SIZE, LOCAL_RANK) or Slurm (SLURM_PROCID, SLURM_NTASKS,
 * SLURM_LOCALID) when the world is > 1; 0 when neither launcher's variables
 * are set or the world is 1 (rank 0); -1 with a message in e when they are
 * set but do not make a rank (not a number, a rank outside the world, no
 * local rank): a process must not train alone what it was launched to share. */
int cli_launcher_rank(uint32_t *rank, uint32_t *world, int *local, df_err *e);

/* This node's index and the node count for one process per node
 * (NODE_RANK/NNODES, or SLURM_NODEID/SLURM_NNODES); 0 of 1 otherwise. */
void cli_node_rank(uint32_t *node, uint32_t *nodes);

/* A token naming this launch, the same in every rank of it: DFLASH_RUN_ID,
 * else TORCHELASTIC_RUN_ID, else SLURM_JOB_ID.SLURM_STEP_ID; NULL when none
 * is set. */
const char *cli_run_id_from_env(char *buf, int cap);

/* Rank 0's rendezvous address from torchrun's MASTER_ADDR and MASTER_PORT
 * (under Slurm the batch script exports them). 1 with *addr and *port set;
 * 0 when MASTER_ADDR is unset or empty; -1 with a message in e when
 * MASTER_PORT is missing or not in 1..65535. Under torchrun with
 * TORCHELASTIC_USE_AGENT_STORE true, torchrun's own store already listens on
 * MASTER_PORT on rank 0's node: the port after it (before it, at 65535) is
 * used instead. */
int cli_master_from_env(const char **addr, int *port, df_err *e);

/* Runs `dflash <argv...>` once per local GPU as fresh processes (exec, not
 * a bare fork: CUDA must not be initialised before a fork), appending
 * --gpu i --rank node*n+i --world-size nodes*n and the extra (option, value)
 * pairs returned by extra(i, rank, ...) (NULL: none), and waits for all.
 * Returns the number of ranks that failed (0: all exited 0). cmd names the
 * command in messages. */
typedef int (*cli_rank_extra_fn)(void *ctx, int i, uint32_t rank, char **av, int cap);
int cli_spawn_ranks(const char *cmd, int argc, char **argv, int n, uint32_t node, uint32_t nodes,
                    cli_rank_extra_fn extra, void *ctx);

#endif
