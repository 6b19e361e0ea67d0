#include <cstdio>
int main() { std::puts("mt: CLI not written yet"); return 1; }
