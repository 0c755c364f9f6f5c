// LD_PRELOAD shim (session 32): writes every CUDA graph a process instantiates through the driver API
// (XLA's command buffers: cuGraphInstantiateWithFlags / WithParams) as Graphviz DOT before
// instantiating it, so that XLA's graph of a jitted function can be set beside a raw one. XLA reaches
// the driver through dlopen("libcuda.so.1") + dlsym(handle, name), which LD_PRELOAD alone does not
// interpose: dlopen of libcuda returns this library instead, whose dependency libcuda answers the
// names it does not define. cuGetProcAddress is hooked too (the other way to the entry points).
//   gcc -O2 -shared -fPIC -I /usr/local/cuda/include graph_dump.c -o libgraph_dump.so -ldl -Wl,--no-as-needed \
//       -L <a folder with libcuda.so: the toolkit's stubs/, or any .so with soname libcuda.so.1> -lcuda
//   JOA_GRAPH_DUMP=/tmp/graphs LD_PRELOAD=$PWD/libgraph_dump.so python3 ...
// It also counts (and prints at exit, with JOA_GRAPH_COUNT=1) the driver calls that re-record or
// update a command buffer: stream captures (XLA traces a custom call by capturing it), exec-graph
// updates, child-graph node updates, graph launches.
// Env: JOA_GRAPH_DUMP (folder; without it nothing is dumped), JOA_GRAPH_DUMP_MAX (graphs, default 64),
// JOA_GRAPH_DUMP_VERBOSE=1 (kernel parameters and attributes in the DOT).
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int dumped = 0;

enum { kInstantiate, kBeginCapture, kExecUpdate, kChildSetParams, kKernelSetParams, kLaunch, kCounters };
static const char* const kCounterNames[kCounters] = {
    "cuGraphInstantiate", "cuStreamBeginCapture", "cuGraphExecUpdate", "cuGraphExecChildGraphNodeSetParams",
    "cuGraphExecKernelNodeSetParams", "cuGraphLaunch"};
static long counters[kCounters];
static void count(int which) { __atomic_add_fetch(&counters[which], 1, __ATOMIC_RELAXED); }

__attribute__((destructor)) static void report(void) {
  const char* on = getenv("JOA_GRAPH_COUNT");
  if (!on || on[0] != '1') return;
  for (int i = 0; i < kCounters; ++i) fprintf(stderr, "[graph_dump] %s: %ld\n", kCounterNames[i], counters[i]);
}

// A counted pass-through of a driver entry point (the real one found after this library).
#define JOA_COUNTED(counter, name, params, args)                      \
  CUresult name params {                                               \
    typedef CUresult(*fn_t) params;                                    \
    static fn_t real = NULL;                                           \
    if (!real) real = (fn_t)dlsym(RTLD_NEXT, #name);                   \
    count(counter);                                                    \
    return real args;                                                  \
  }
JOA_COUNTED(kBeginCapture, cuStreamBeginCapture_v2, (CUstream s, CUstreamCaptureMode m), (s, m))
JOA_COUNTED(kExecUpdate, cuGraphExecUpdate_v2, (CUgraphExec e, CUgraph g, CUgraphExecUpdateResultInfo* r), (e, g, r))
JOA_COUNTED(kChildSetParams, cuGraphExecChildGraphNodeSetParams, (CUgraphExec e, CUgraphNode n, CUgraph g), (e, n, g))
JOA_COUNTED(kKernelSetParams, cuGraphExecKernelNodeSetParams_v2,
            (CUgraphExec e, CUgraphNode n, const CUDA_KERNEL_NODE_PARAMS* p), (e, n, p))
JOA_COUNTED(kLaunch, cuGraphLaunch, (CUgraphExec e, CUstream s), (e, s))

static void dump(CUgraph g, const char* how) {
  count(kInstantiate);
  const char* dir = getenv("JOA_GRAPH_DUMP");
  const char* max = getenv("JOA_GRAPH_DUMP_MAX");
  if (!dir || dumped >= (max ? atoi(max) : 64)) return;
  typedef CUresult (*print_t)(CUgraph, const char*, unsigned int);
  typedef CUresult (*nodes_t)(CUgraph, CUgraphNode*, size_t*);
  print_t print = (print_t)dlsym(RTLD_NEXT, "cuGraphDebugDotPrint");
  nodes_t nodes = (nodes_t)dlsym(RTLD_NEXT, "cuGraphGetNodes");
  size_t n = 0;
  if (nodes) nodes(g, NULL, &n);
  char path[4096];
  snprintf(path, sizeof path, "%s/graph_%03d_%s_%zu_nodes.dot", dir, dumped++, how, n);
  const char* verbose = getenv("JOA_GRAPH_DUMP_VERBOSE");
  unsigned flags = verbose && verbose[0] == '1' ? CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE : 0;
  if (print) {
    CUresult r = print(g, path, flags);
    fprintf(stderr, "[graph_dump] %s: %zu nodes -> %s (%d)\n", how, n, path, (int)r);
  }
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph g, unsigned long long flags) {
  typedef CUresult (*fn_t)(CUgraphExec*, CUgraph, unsigned long long);
  static fn_t real = NULL;
  if (!real) real = (fn_t)dlsym(RTLD_NEXT, "cuGraphInstantiateWithFlags");
  dump(g, "flags");
  return real(exec, g, flags);
}

CUresult cuGraphInstantiateWithParams(CUgraphExec* exec, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  typedef CUresult (*fn_t)(CUgraphExec*, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS*);
  static fn_t real = NULL;
  if (!real) real = (fn_t)dlsym(RTLD_NEXT, "cuGraphInstantiateWithParams");
  dump(g, "params");
  return real(exec, g, params);
}

// dlopen("libcuda.so*") -> this library (its DT_NEEDED libcuda resolves every other name).
void* dlopen(const char* file, int mode) {
  typedef void* (*fn_t)(const char*, int);
  static fn_t real = NULL;
  if (!real) real = (fn_t)dlsym(RTLD_NEXT, "dlopen");
  if (file && strstr(file, "libcuda.so")) {
    Dl_info self;
    if (dladdr((void*)&dump, &self) && self.dli_fname) {
      static int said = 0;
      if (!said++) fprintf(stderr, "[graph_dump] dlopen(%s) -> %s\n", file, self.dli_fname);
      return real(self.dli_fname, mode);
    }
  }
  return real(file, mode);
}

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult* status) {
  typedef CUresult (*fn_t)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  static fn_t real = NULL;
  if (!real) real = (fn_t)dlsym(RTLD_NEXT, "cuGetProcAddress_v2");
  CUresult r = real(symbol, pfn, version, flags, status);
  if (r == CUDA_SUCCESS && symbol) {
    if (!strcmp(symbol, "cuGraphInstantiateWithFlags") || (!strcmp(symbol, "cuGraphInstantiate") && version >= 12000)) {
      *pfn = (void*)&cuGraphInstantiateWithFlags;
    } else if (!strcmp(symbol, "cuGraphInstantiateWithParams")) {
      *pfn = (void*)&cuGraphInstantiateWithParams;
    }
  }
  return r;
}
