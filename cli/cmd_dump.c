#include "cmds.h"
int cmd_dump(int argc, char **argv) { return 2; }
