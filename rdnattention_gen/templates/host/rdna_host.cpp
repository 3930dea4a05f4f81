#include "rdna_host.h"

#include <pthread.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#ifndef RDNA_WAVE_SIZE
#error "compile with -DRDNA_WAVE_SIZE=<wave size of the host target>"
#endif
#ifndef RDNA_LDS_BYTES
#error "compile with -DRDNA_LDS_BYTES=<LDS budget of the host target>"
#endif

namespace rdna_host {
namespace {

struct Kernel {
  int threads;
  std::size_t args_size;
  KernelEntry entry;
};

std::map<std::string, Kernel>& registry() {
  static std::map<std::string, Kernel> table;
  return table;
}

enum class State { Ready, AtBarrier, AtWaveSync, Done };

// A fiber's stack. The kernels use under 3 KiB at -O2 (measured over every shipped kernel); 64 KiB
// leaves room for unoptimised builds, and a guard page below each stack turns an overflow into a
// fault instead of a silent overwrite of the next one.
constexpr std::size_t kStackBytes = 64 * 1024;

// The stacks of one worker's fibers: a single mapping, a guard page below each stack. Mappings are
// kept in a pool across launches, so a launch maps nothing once the pool holds enough.
class Stacks {
 public:
  explicit Stacks(int count) : count_(count), guard_((std::size_t)sysconf(_SC_PAGESIZE)) {
    bytes_ = (std::size_t)count * (guard_ + kStackBytes);
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<char*>(p);
    for (int i = 0; i < count; ++i) {
      if (mprotect(base_ + (std::size_t)i * (guard_ + kStackBytes), guard_, PROT_NONE) != 0) {
        munmap(base_, bytes_);
        throw std::bad_alloc();
      }
    }
  }
  ~Stacks() { munmap(base_, bytes_); }
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;
  int count() const { return count_; }
  char* stack(int i) const { return base_ + (std::size_t)i * (guard_ + kStackBytes) + guard_; }

 private:
  int count_;
  std::size_t guard_, bytes_ = 0;
  char* base_ = nullptr;
};

std::mutex stack_pool_lock;
std::vector<std::unique_ptr<Stacks>> stack_pool;

// Stacks for `count` fibers: from the pool when it holds a large enough set, else newly mapped.
std::unique_ptr<Stacks> take_stacks(int count) {
  {
    std::lock_guard<std::mutex> hold(stack_pool_lock);
    for (auto it = stack_pool.begin(); it != stack_pool.end(); ++it) {
      if ((*it)->count() >= count) {
        std::unique_ptr<Stacks> s = std::move(*it);
        stack_pool.erase(it);
        return s;
      }
    }
  }
  return std::make_unique<Stacks>(count);
}

void give_back(std::unique_ptr<Stacks> s) {
  std::lock_guard<std::mutex> hold(stack_pool_lock);
  stack_pool.push_back(std::move(s));
}

// Switching fibers. glibc's swapcontext saves and restores the signal mask with a system call and
// the whole x87 environment at every switch: it was three quarters of the emulator's time, since
// every barrier and every cross-lane exchange switches each thread's fiber twice. On x86-64 a
// switch is a hand-written one instead: the callee-saved registers and the two floating-point
// control words (what the SysV ABI asks a call to preserve) pushed on the old stack, the stack
// pointer swapped, the same popped from the new one. Fibers never change their signal mask, so
// there is nothing more to save. Other architectures keep ucontext.
#if defined(__x86_64__) && !defined(RDNA_HOST_UCONTEXT)
#define RDNA_HOST_FAST_SWITCH 1
}  // namespace
}  // namespace rdna_host

// rdna_host_switch(from, to): saves the running fiber's registers on its stack and its stack pointer
// in *from, then resumes the fiber whose stack pointer is `to`. rdna_host_fiber_start is where a new
// fiber's first switch returns to: it calls r13 (fiber_main), which never returns.
extern "C" void rdna_host_switch(void** from, void* to);
extern "C" void rdna_host_fiber_start();
asm(R"(
  .text
  .p2align 4
  .hidden rdna_host_switch
  .globl rdna_host_switch
  .type rdna_host_switch, @function
rdna_host_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size rdna_host_switch, .-rdna_host_switch

  .p2align 4
  .hidden rdna_host_fiber_start
  .globl rdna_host_fiber_start
  .type rdna_host_fiber_start, @function
rdna_host_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  callq *%r13
  ud2
  .cfi_endproc
  .size rdna_host_fiber_start, .-rdna_host_fiber_start
)");

namespace rdna_host {
namespace {

// A new fiber's stack, laid out as rdna_host_switch leaves a suspended one: the control words, six
// registers (r13 = entry), then rdna_host_fiber_start as the return address, placed so that the
// stack is 16-byte aligned at its call, as the ABI wants.
void* new_fiber_stack(char* stack, std::size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + bytes) & ~std::uintptr_t(15);
  auto* slot = reinterpret_cast<std::uint64_t*>(top - 80);
  std::uint32_t mxcsr;
  std::uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  slot[0] = mxcsr | (std::uint64_t)fpucw << 32;  // read back as ldmxcsr (sp), fldcw 4(sp)
  slot[1] = 0;                                          // r15
  slot[2] = 0;                                          // r14
  slot[3] = reinterpret_cast<std::uint64_t>(entry);    // r13
  slot[4] = 0;                                          // r12
  slot[5] = 0;                                          // rbx
  slot[6] = 0;                                          // rbp
  slot[7] = reinterpret_cast<std::uint64_t>(&rdna_host_fiber_start);
  return slot;
}

struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t ctx;
};
#endif

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  int tid = 0;
  int exchanges = 0;  // shfl_xor calls made: their parity picks the exchange buffer
  State state = State::Ready;
};

// One worker's workgroup in flight. Everything in it is allocated by the launching thread before
// the worker starts, so a worker never allocates (glibc would give each worker thread its own
// malloc arena, 64 MiB of address space apiece).
struct Block {
  const Kernel* kernel = nullptr;
  const void* args = nullptr;
  int id[3] = {0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<int> order;       // this round's fibers, in the order they run; capacity: one per thread
  std::size_t next = 0;         // the index in `order` of the fiber to run after the current one
  std::vector<float> exchange;  // two buffers of one slot per thread, for cross-lane operations
  std::unique_ptr<unsigned char[]> lds_storage;
  unsigned char* lds = nullptr;  // RDNA_LDS_BYTES, 64-byte aligned, inside lds_storage
  std::unique_ptr<Stacks> stacks;
  Context scheduler;
  Fiber* current = nullptr;

  Block(const Kernel& k, const void* a) : kernel(&k), args(a) {
    fibers.resize(k.threads);
    order.reserve(k.threads);
    exchange.assign(2 * (std::size_t)k.threads, 0.f);
    lds_storage.reset(new unsigned char[RDNA_LDS_BYTES + 64]);
    lds = lds_storage.get() + (64 - reinterpret_cast<std::uintptr_t>(lds_storage.get()) % 64) % 64;
    stacks = take_stacks(k.threads);
    for (int t = 0; t < k.threads; ++t) fibers[t].stack = stacks->stack(t);
  }
  ~Block() {
    try {
      give_back(std::move(stacks));
    } catch (const std::exception&) {
      // The pool could not grow: the stacks are unmapped instead of kept.
    }
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
};

// Initial-exec: a slot in the static TLS reserved when the library is loaded. The default model
// would allocate the library's TLS lazily in each new thread, and glibc aborts the process when
// that allocation fails.
__attribute__((tls_model("initial-exec"))) thread_local Block* tls_block = nullptr;

// Resumes `to`, saving the running context in `from`.
inline void switch_to(Context& from, Context& to) {
#ifdef RDNA_HOST_FAST_SWITCH
  rdna_host_switch(&from.sp, to.sp);
#else
  swapcontext(&from.ctx, &to.ctx);
#endif
}

// Leaves the running fiber in state `why` and resumes the round's next fiber, or the scheduler after
// the round's last: one switch per fiber and sync point.
void yield(State why) {
  Block* blk = tls_block;
  Fiber* self = blk->current;
  self->state = why;
  Context* to = &blk->scheduler;
  if (blk->next < blk->order.size()) {
    blk->current = &blk->fibers[blk->order[blk->next++]];
    to = &blk->current->ctx;
  }
  switch_to(self->ctx, *to);
}

void fiber_main() {
  Block* blk = tls_block;
  blk->kernel->entry(blk->args);
  yield(State::Done);  // never resumed: a finished fiber is not scheduled
  __builtin_unreachable();
}

// Makes fiber `f` start fiber_main at its next switch.
void start_fiber(Block& blk, Fiber& f) {
#ifdef RDNA_HOST_FAST_SWITCH
  (void)blk;
  f.ctx.sp = new_fiber_stack(f.stack, kStackBytes, fiber_main);
#else
  getcontext(&f.ctx.ctx);
  f.ctx.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.ctx.uc_link = &blk.scheduler.ctx;
  makecontext(&f.ctx.ctx, fiber_main, 0);
#endif
}


void wave_sync() { yield(State::AtWaveSync); }

// Releases the fibers waiting at a sync point that everyone concerned has reached.
// Returns false, with a reason, when no fiber can ever continue (mismatched sync points).
bool release(Block& blk, std::string& why) {
  const int n = (int)blk.fibers.size();
  bool all_barrier = true;
  for (const Fiber& f : blk.fibers) all_barrier &= f.state == State::AtBarrier;
  if (all_barrier) {
    for (Fiber& f : blk.fibers) f.state = State::Ready;
    return true;
  }
  bool released = false;
  for (int w = 0; w < n; w += RDNA_WAVE_SIZE) {
    const int end = std::min(n, w + RDNA_WAVE_SIZE);
    bool all_wave = true;
    for (int t = w; t < end; ++t) all_wave &= blk.fibers[t].state == State::AtWaveSync;
    if (all_wave) {
      for (int t = w; t < end; ++t) blk.fibers[t].state = State::Ready;
      released = true;
    }
  }
  if (!released) {
    int at_barrier = 0, at_wave = 0, done = 0;
    for (const Fiber& f : blk.fibers) {
      at_barrier += f.state == State::AtBarrier;
      at_wave += f.state == State::AtWaveSync;
      done += f.state == State::Done;
    }
    why = "threads of workgroup (" + std::to_string(blk.id[0]) + "," + std::to_string(blk.id[1]) + "," +
          std::to_string(blk.id[2]) + ") wait at different sync points: " + std::to_string(at_barrier) +
          " at a barrier, " + std::to_string(at_wave) + " at a wave sync, " + std::to_string(done) + " finished";
  }
  return released;
}

bool cancelled(const int* cancel) { return cancel && __atomic_load_n(cancel, __ATOMIC_RELAXED) != 0; }

// Runs one workgroup to its end; false when it cannot finish (why says so) or is cancelled.
// A cancelled workgroup's fibers are abandoned between sync points: their stacks belong to blk.
bool run_block(Block& blk, std::mt19937_64* shuffle, const int* cancel, std::string& why) {
  const int n = blk.kernel->threads;
  for (int t = 0; t < n; ++t) {
    Fiber& f = blk.fibers[t];
    f.tid = t;
    f.exchanges = 0;
    f.state = State::Ready;
    start_fiber(blk, f);
  }
  std::vector<int>& order = blk.order;
  for (;;) {
    if (cancelled(cancel)) {
      why = "interrupted";
      return false;
    }
    order.clear();
    for (int t = 0; t < n; ++t)
      if (blk.fibers[t].state == State::Ready) order.push_back(t);
    if (order.empty()) {
      bool all_done = true;
      for (const Fiber& f : blk.fibers) all_done &= f.state == State::Done;
      if (all_done) return true;
      if (!release(blk, why)) return false;
      continue;
    }
    if (shuffle) std::shuffle(order.begin(), order.end(), *shuffle);
    blk.current = &blk.fibers[order[0]];
    blk.next = 1;
    switch_to(blk.scheduler, blk.current->ctx);  // back here once the round's last fiber yields
  }
}

}  // namespace

Registrar::Registrar(const char* name, int threads, std::size_t args_size, KernelEntry entry) {
  registry()[name] = Kernel{threads, args_size, entry};
}

int thread_id() { return tls_block->current->tid; }
int block_id(int axis) { return tls_block->id[axis]; }
unsigned char* shared_memory() { return tls_block->lds; }
void block_sync() { yield(State::AtBarrier); }

// One wave sync per exchange: consecutive exchanges use the two buffers in turn. A lane writes a
// buffer again two exchanges later, after the sync of the exchange between, which every lane of
// its wave reaches only once it has read this one.
float shfl_xor(float v, int mask) {
  Block* blk = tls_block;
  Fiber* self = blk->current;
  const int tid = self->tid;
  const int lane = tid % RDNA_WAVE_SIZE;
  float* const slots = blk->exchange.data() + (std::size_t)(self->exchanges++ & 1) * blk->fibers.size();
  slots[tid] = v;
  wave_sync();
  return slots[tid - lane + ((lane ^ mask) & (RDNA_WAVE_SIZE - 1))];
}

}  // namespace rdna_host

using namespace rdna_host;

// fp16 -> fp32 where x86-64 has no instruction for it (F16C is not in the baseline the host targets
// compile for): the compiler calls __extendhfsf2 for every conversion, and the runtime library's is
// generic soft-float, about half of the emulator's time after the fiber switch. This library's own,
// exact for every input (normal, subnormal, zero, infinity; NaN quieted, payload kept, as the
// library's and F16C's), binds the kernels' calls inside this library.
#if defined(__x86_64__) && !defined(__F16C__)
extern "C" __attribute__((visibility("hidden"))) float __extendhfsf2(_Float16 h) {
  std::uint16_t b;
  std::memcpy(&b, &h, sizeof b);
  const std::uint32_t sign = (std::uint32_t)(b & 0x8000u) << 16, em = b & 0x7fffu;
  std::uint32_t bits;
  if (em >= 0x7c00u) {  // infinity, NaN (quieted)
    bits = 0x7f800000u | (em & 0x3ffu) << 13 | ((em & 0x3ffu) ? 0x400000u : 0u);
  } else if (em >= 0x400u) {  // normal: the exponent rebiased
    bits = (em << 13) + ((127u - 15u) << 23);
  } else {  // subnormal or zero: em * 2^-24, exact in fp32
    const float f = (float)(int)em * 0x1p-24f;
    std::memcpy(&bits, &f, sizeof bits);
  }
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
#endif

namespace {

// One launch's shared state: workers take workgroup numbers from `next` until none is left.
struct Launch {
  const Kernel* kernel;
  const char* name;
  const unsigned* grid;
  long long total;
  unsigned long long shuffle_seed;
  const int* cancel;
  std::atomic<long long> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_lock;
  std::string error;

  Launch(const Kernel* k, const char* n, const unsigned* g, long long t, unsigned long long seed, const int* c)
      : kernel(k), name(n), grid(g), total(t), shuffle_seed(seed), cancel(c) {}

  void fail(const std::string& why) noexcept {
    failed = true;
    try {
      std::lock_guard<std::mutex> hold(error_lock);
      if (error.empty()) error = std::string(name) + ": " + why;
    } catch (const std::exception&) {
      // No memory for the message: the launch still fails, with the generic one below.
    }
  }

  // Runs workgroups on `blk` until none is left or the launch fails.
  void work(Block& blk) noexcept {
    tls_block = &blk;
    try {
      std::string why;
      for (long long g; !failed && (g = next++) < total;) {
        blk.id[0] = (int)(g % grid[0]);
        blk.id[1] = (int)(g / grid[0] % grid[1]);
        blk.id[2] = (int)(g / grid[0] / grid[1]);
        std::mt19937_64 rng(shuffle_seed ^ (0x9e3779b97f4a7c15ULL * (unsigned long long)(g + 1)));
        if (!run_block(blk, shuffle_seed ? &rng : nullptr, cancel, why)) fail(why);
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
    tls_block = nullptr;
  }
};

// Workers are POSIX threads with small stacks: their own frames are a few calls deep (kernels run on
// fiber stacks), and the default stack would reserve 8 MiB of address space each.
constexpr std::size_t kWorkerStackBytes = 256 * 1024;

struct Worker {
  Launch* run;
  Block* blk;
  pthread_t thread;
};

void* worker_main(void* p) {
  Worker* w = static_cast<Worker*>(p);
  w->run->work(*w->blk);
  return nullptr;
}

bool start_worker(Worker& w) {
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) != 0) return false;
  pthread_attr_setstacksize(&attr, kWorkerStackBytes);
  const bool ok = pthread_create(&w.thread, &attr, worker_main, &w) == 0;
  pthread_attr_destroy(&attr);
  return ok;
}

int launch(const char* name, const unsigned grid[3], int threads, const void* args, std::size_t args_size,
           unsigned long long shuffle_seed, const int* cancel, std::string& last_error) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    last_error = std::string("no kernel named ") + name + " in this library";
    return -1;
  }
  const Kernel& kernel = it->second;
  if (threads != kernel.threads || args_size != kernel.args_size) {
    last_error = std::string(name) + ": launched with " + std::to_string(threads) + " threads and " +
                 std::to_string(args_size) + " argument bytes, built for " + std::to_string(kernel.threads) +
                 " and " + std::to_string(kernel.args_size);
    return -1;
  }
  const long long total = (long long)grid[0] * grid[1] * grid[2];
  int workers = (int)std::thread::hardware_concurrency();
  if (const char* env = std::getenv("RDNATTENTION_HOST_THREADS")) workers = std::atoi(env);
  workers = (int)std::max(1LL, std::min<long long>(std::max(workers, 1), total));

  Launch run{&kernel, name, grid, total, shuffle_seed, cancel};
  // Every worker's memory first, on this thread: running out fails the launch here, cleanly.
  std::vector<std::unique_ptr<Block>> blocks;
  for (int w = 0; w < workers; ++w) blocks.push_back(std::make_unique<Block>(kernel, args));
  std::vector<Worker> pool(workers - 1);
  int started = 0;
  for (; started < workers - 1; ++started) {
    pool[started] = Worker{&run, blocks[started + 1].get(), {}};
    if (!start_worker(pool[started])) break;  // fewer OS threads: those started and this one share the grid
  }
  run.work(*blocks[0]);
  for (int w = 0; w < started; ++w) pthread_join(pool[w].thread, nullptr);
  if (cancelled(cancel)) {
    last_error = std::string(name) + ": interrupted";
    return 1;
  }
  if (run.failed) {
    last_error = run.error.empty() ? std::string(name) + ": failed (no memory for the reason)" : run.error;
    return -1;
  }
  return 0;
}

}  // namespace

// No C++ exception leaves the library (std::bad_alloc under a memory limit, a failed thread
// start): each becomes an error code and a message.
extern "C" int rdna_host_abi_version(void) { return RDNA_HOST_ABI_VERSION; }

extern "C" int rdna_host_launch(const char* name, const unsigned grid[3], int threads, const void* args,
                                std::size_t args_size, unsigned long long shuffle_seed, const int* cancel, char* error,
                                std::size_t error_size) {
  int rc = -1;
  const char* why = nullptr;
  std::string message;
  try {
    rc = launch(name, grid, threads, args, args_size, shuffle_seed, cancel, message);
    why = message.c_str();
  } catch (const std::exception& e) {
    why = e.what();  // the message could not be built (out of memory): say what was thrown
  } catch (...) {
    why = "unknown C++ exception";
  }
  if (rc != 0 && error && error_size) {
    // Name first, then the reason, with no allocation: this path runs when memory has run out.
    const bool named = message.empty() && name;
    std::snprintf(error, error_size, "%s%s%s", named ? name : "", named ? ": " : "", why);
  }
  return rc;
}

extern "C" int rdna_host_kernel_count(void) { return (int)registry().size(); }

extern "C" const char* rdna_host_kernel_name(int index) {
  if (index < 0 || index >= (int)registry().size()) return nullptr;
  auto it = registry().begin();
  std::advance(it, index);
  return it->first.c_str();
}
