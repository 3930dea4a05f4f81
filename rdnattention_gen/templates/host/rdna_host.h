// CPU emulation of a GPU workgroup: one fiber per thread, switched at every sync point.
// Workgroups run one at a time per OS thread; several OS threads take workgroups in turn.
// Everything a worker needs (fiber stacks, LDS) is allocated before its first workgroup runs, so
// running out of memory fails the launch with an error instead of inside a kernel; the only
// thread-local is one pointer in static TLS, which a new thread never has to allocate.
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
// The running workgroup's LDS: RDNA_LDS_BYTES bytes, 64-byte aligned, owned by the worker thread.
unsigned char* shared_memory();
void block_sync();
float shfl_xor(float v, int mask);

}  // namespace rdna_host

extern "C" {
// The version of this C interface; a runtime refuses a library of another version.
#define RDNA_HOST_ABI_VERSION 2
int rdna_host_abi_version(void);
// Runs kernel `name` over grid[0..2] workgroups of `threads` threads. shuffle_seed != 0
// shuffles the order fibers run in after every sync point, so a missing barrier shows up
// as a changed result. A nonzero *cancel (set by another thread; may be null) stops the
// launch at the next sync point of every workgroup in flight. Returns 0; 1 when cancelled;
// -1 on failure. Unless 0, the reason is written to error[0..error_size) (NUL-terminated,
// truncated to fit; error may be null).
int rdna_host_launch(const char* name, const unsigned grid[3], int threads, const void* args,
                     std::size_t args_size, unsigned long long shuffle_seed, const int* cancel, char* error,
                     std::size_t error_size);
int rdna_host_kernel_count(void);
const char* rdna_host_kernel_name(int index);
}
