#include "cmds.h"
int cmd_corpus(int argc, char **argv) { return 2; }
