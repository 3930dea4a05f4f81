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

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  int tid = 0;
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
  std::vector<int> order;       // fibers to run next; capacity: one per thread
  std::vector<float> exchange;  // one slot per thread, for cross-lane operations
  std::unique_ptr<unsigned char[]> lds_storage;
  unsigned char* lds = nullptr;  // RDNA_LDS_BYTES, 64-byte aligned, inside lds_storage
  std::unique_ptr<Stacks> stacks;
  ucontext_t scheduler;
  Fiber* current = nullptr;

  Block(const Kernel& k, const void* a) : kernel(&k), args(a) {
    fibers.resize(k.threads);
    order.reserve(k.threads);
    exchange.assign(k.threads, 0.f);
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

void fiber_main() {
  Block* blk = tls_block;
  blk->kernel->entry(blk->args);
  blk->current->state = State::Done;
  // Returning resumes uc_link, the scheduler.
}

void yield(State why) {
  Block* blk = tls_block;
  Fiber* self = blk->current;
  self->state = why;
  swapcontext(&self->ctx, &blk->scheduler);
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
    f.state = State::Ready;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &blk.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
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
    for (int t : order) {
      blk.current = &blk.fibers[t];
      swapcontext(&blk.scheduler, &blk.current->ctx);
    }
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

float shfl_xor(float v, int mask) {
  Block* blk = tls_block;
  const int tid = blk->current->tid;
  const int lane = tid % RDNA_WAVE_SIZE;
  blk->exchange[tid] = v;
  wave_sync();
  const float got = blk->exchange[tid - lane + ((lane ^ mask) & (RDNA_WAVE_SIZE - 1))];
  wave_sync();  // nobody overwrites a slot before every lane has read it
  return got;
}

}  // namespace rdna_host

using namespace rdna_host;

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
