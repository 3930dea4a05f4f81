// CPU emulation of a GPU workgroup: one fiber per thread, switched at every sync point.
// Workgroups run one at a time per OS thread; several OS threads take workgroups in turn.
#pragma once
#include <cstddef>

namespace rdna_host {

using KernelEntry = void (*)(const void* args);

// Adds a kernel to the library's table at load time (see RDNA_REGISTER in the prelude).
struct Registrar {
  Registrar(const char* name, int threads, std::size_t args_size, KernelEntry entry);
};

int thread_id();
int block_id(int axis);
void block_sync();
float shfl_xor(float v, int mask);

}  // namespace rdna_host

extern "C" {
// Runs kernel `name` over grid[0..2] workgroups of `threads` threads. shuffle_seed != 0
// shuffles the order fibers run in after every sync point, so a missing barrier shows up
// as a changed result. Returns 0, or -1 with the reason in rdna_host_last_error().
int rdna_host_launch(const char* name, const unsigned grid[3], int threads, const void* args,
                     std::size_t args_size, unsigned long long shuffle_seed);
const char* rdna_host_last_error(void);
int rdna_host_kernel_count(void);
const char* rdna_host_kernel_name(int index);
}
