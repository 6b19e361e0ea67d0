// Times llm.c's CPU GPT-2 training step at a given batch and sequence length: the step
// train_gpt2.c's main loop runs (next batch, gpt2_forward, gpt2_zero_grad, gpt2_backward,
// gpt2_update with its AdamW settings), without its validation and sampling passes, and prints
// one JSON line with the fields of `mt bench train` (medians after two warm-up steps). It
// compiles against an llm.c checkout the way llm.c's own test_gpt2.c does (TESTING leaves out
// train_gpt2.c's main); bench/gpt2_vs_llmc.sh builds it:
//   cc -Ofast -march=native -fopenmp -DOMP -I<llm.c> llmc_driver.c -lm -lgomp
// Usage: llmc_driver <gpt2_124M.bin> <train.bin> <B> <T> <steps>
#define TESTING
#include "train_gpt2.c"

static int compare_doubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s <gpt2_124M.bin> <train.bin> <B> <T> <steps>\n", argv[0]);
    return 2;
  }
  const int B = atoi(argv[3]), T = atoi(argv[4]), steps = atoi(argv[5]);
  if (B <= 0 || T <= 0 || steps <= 2) {
    fprintf(stderr, "B and T must be positive and steps > 2\n");
    return 2;
  }
  GPT2 model;
  gpt2_build_from_checkpoint(&model, argv[1]);
  DataLoader loader;
  dataloader_init(&loader, argv[2], B, T, 0, 1, 1);
  double* times = (double*)mallocCheck(sizeof(double) * (size_t)steps);
  struct timespec start, end;
  for (int step = 0; step < steps; step++) {
    clock_gettime(CLOCK_MONOTONIC, &start);
    dataloader_next_batch(&loader);
    gpt2_forward(&model, loader.inputs, loader.targets, B, T);
    gpt2_zero_grad(&model);
    gpt2_backward(&model);
    gpt2_update(&model, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, step + 1);
    clock_gettime(CLOCK_MONOTONIC, &end);
    times[step] = (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) / 1e9;
    fprintf(stderr, "llm.c step %d: loss %f, %.1f ms\n", step, model.mean_loss, times[step] * 1e3);
  }
  qsort(times + 2, (size_t)(steps - 2), sizeof(double), compare_doubles);
  const int n = steps - 2;
  const double median = n % 2 ? times[2 + n / 2] : 0.5 * (times[2 + n / 2 - 1] + times[2 + n / 2]);
  int threads = 1;
#ifdef OMP
  threads = omp_get_max_threads();
#endif
  printf(
      "{\"bench\": \"train\", \"peer\": \"llm.c\", \"num_threads\": %d, \"batch\": %d, \"seq\": "
      "%d, "
      "\"steps\": %d, \"tokens_per_sec\": %.2f, \"step_time_ms\": %.1f, \"final_loss\": %.4f}\n",
      threads, B, T, steps, B * T / median, median * 1e3, model.mean_loss);
  dataloader_free(&loader);
  gpt2_free(&model);
  free(times);
  return 0;
}
