// Stands in for a hostile library in the directory mt is started from (runpath_test): if the
// dynamic loader ever picks it up, its constructor says so and ends the process before main.
#include <unistd.h>
#include <cstdio>

__attribute__((constructor)) static void intruder() {
  std::fputs("INTRUDER LIBRARY LOADED FROM THE CURRENT DIRECTORY\n", stderr);
  ::_exit(99);
}
