// moelab GPU <-> CPU pool hand-off kernels (compiled after gpu_kernels.cu in one module; see
// execute/handoff.py). The pool's counters (`ctrl`, int64 words) live in host-mapped memory: the
// GPU writes the gate word once a call's inputs are in place and reads the done word (and the
// broken word) to know when the call's outputs are; nobody synchronizes a stream.
//
// Ordering: inputs are written, then __threadfence_system(), then the gate (st.release.sys); the
// CPU's last worker writes the outputs, then the done word (x86 stores are ordered), and the GPU
// reads the done word with ld.acquire.sys before it reads the outputs with volatile loads.

__device__ __forceinline__ long long ho_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (long long)t;
}

__device__ __forceinline__ long long ho_acquire(const long long* p) {
    long long v;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ho_release(long long* p, long long v) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// xin[i, :] = x[rows ? rows[i] : 0, :] for the call's n input rows, then ctrl[gate] = seq and
// stamps[0] = the GPU clock when the gate was written. The last block to finish writes the gate
// (counter: a device word, 0 between calls). grid any, block 256.
extern "C" __global__ void handoff_put(const float* __restrict__ x, const int* __restrict__ rows, int n, int hidden,
                                       float* xin, long long* ctrl, int gate, long long seq,
                                       unsigned int* counter, long long* stamps) {
    long long total = (long long)n * hidden;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / hidden, c = i - r * hidden;
        xin[i] = x[(long long)(rows ? rows[r] : 0) * hidden + c];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(counter, 1u) == gridDim.x - 1) {
        *counter = 0u;
        __threadfence_system();
        stamps[0] = ho_now();
        ho_release(ctrl + gate, seq);
    }
}

// Wait (thread 0 of a block) until ctrl[done] >= seq: a block first looks at the device word
// `relay` (set by whichever block saw the call done first); block 0 reads the mapped done word
// itself every 16th look, the others every 4096th (so no block depends on another being resident,
// and a grid of a thousand blocks does not flood the link with reads of host memory: they queue
// before the rows the kernel then reads from it). Gives up when ctrl[broken] is set or after
// timeout_ns: then err (mapped) = seq, ctrl[broken] = 1 (the pool's gates open, later waits end
// at once) and false. Block 0 stamps stamps[2] when it starts waiting; the first block to see the
// call done stamps stamps[1].
__device__ bool ho_wait(const long long* ctrl, int done, int broken, long long seq, long long timeout_ns,
                        long long* relay, long long* err, long long* stamps) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        long long t0 = ho_now();
        if (blockIdx.x == 0 && !*(volatile long long*)(stamps + 2)) stamps[2] = t0;  // the call's first wait
        int r = -1, every = gridDim.x == 1 ? 0 : blockIdx.x == 0 ? 15 : 4095;
        for (int it = 0; r < 0; it++) {
            if (*(volatile long long*)relay >= seq) {
                r = 1;
            } else if ((it & every) == 0) {
                if (ho_acquire(ctrl + done) >= seq) {
                    if (atomicMax((unsigned long long*)relay, (unsigned long long)seq) < (unsigned long long)seq)
                        stamps[1] = ho_now();
                    r = 1;
                } else if (*(volatile const long long*)(ctrl + broken)) {
                    r = 0;
                } else if (ho_now() - t0 > timeout_ns) {
                    atomicCAS((unsigned long long*)err, 0ull, (unsigned long long)seq);
                    *(volatile long long*)(ctrl + broken) = 1;
                    __threadfence_system();
                    r = 0;
                }
            }
            if (r < 0) __nanosleep(200);
        }
        __threadfence();
        ok = r;
    }
    __syncthreads();
    return ok;
}

// One block waits (ho_wait, reading the mapped done word at every look) until the call is done:
// queued before a copy of the call's rows to device memory, so that the kernels after it read
// them there (reads of mapped host memory cost the link a round trip each). grid 1, block 32.
extern "C" __global__ void handoff_wait(const long long* ctrl, int done, int broken, long long seq,
                                        long long timeout_ns, long long* relay, long long* err, long long* stamps) {
    ho_wait(ctrl, done, broken, seq, timeout_ns, relay, err, stamps);
}

// One-token layer with CPU pairs: moe1_down_combine where pair j with base[j] == 0 is computed by
// the CPU pool, its unweighted output row pick[j] of `ycpu` (device memory, copied after
// handoff_wait; its ho_wait then returns at the first look); the sum is in j order as
// moe_combine's. grid ceil(hidden / rows_per_block), block 32 * k.
extern "C" __global__ void handoff1_down_combine(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                                 int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                                 int qt_d, long long rb_d, int bias, const long long* ctrl, int done,
                                                 int broken, long long seq, long long timeout_ns, long long* relay,
                                                 long long* err, long long* stamps, const float* ycpu) {
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(ex.base[j]);
    if (e) down1_rows(e, j, h, ffn, hidden, r0, rows_per_block, off_d, qt_d, rb_d, bias, ys[j]);
    bool ok = ho_wait(ctrl, done, broken, seq, timeout_ns, relay, err, stamps);
    if (!e && lane < rows_per_block && r0 + lane < hidden)
        ys[j][lane] = ok ? *(volatile const float*)(ycpu + (long long)ex.pick[j] * hidden + r0 + lane) : 0.f;
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows_per_block && r0 + i < hidden) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += ex.weight[jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}

// y[row0 + i, :] = ycpu[i, :] for the call's n rows, once the CPU pool has finished the call
// (see ho_wait). grid any, block 256.
extern "C" __global__ void handoff_get(const long long* ctrl, int done, int broken, long long seq, long long timeout_ns,
                                       long long* relay, long long* err, long long* stamps, const float* ycpu,
                                       float* __restrict__ y, long long n) {
    bool ok = ho_wait(ctrl, done, broken, seq, timeout_ns, relay, err, stamps);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = ok ? *(volatile const float*)(ycpu + i) : 0.f;
}

// Clock pairing for the edge measurements: round r waits for ctrl[ping] == r (the host writes it
// with its clock), stamps the GPU clock in stamps[r] and answers ctrl[pong] = r. One thread.
extern "C" __global__ void handoff_clock(long long* ctrl, int ping, int pong, int rounds, long long* stamps,
                                         long long timeout_ns) {
    long long t0 = ho_now();
    for (int r = 1; r <= rounds; r++) {
        while (ho_acquire(ctrl + ping) < r)
            if (ho_now() - t0 > timeout_ns) return;
        stamps[r - 1] = ho_now();
        ho_release(ctrl + pong, r);
    }
}

// GPU work of a given length (the microbenchmark's stand-in for a layer's GPU part). One thread.
extern "C" __global__ void handoff_busy(long long ns) {
    long long t0 = ho_now();
    while (ho_now() - t0 < ns) __nanosleep(1000);
}

// ---- misses inside a token's graph (execute/graph_cpu.py) --------------------------------------
// Per block of the graph: graphcpu_put, graphcpu_gate_up, graphcpu_down, graphcpu_combine. Pair j
// is the block's j-th routed expert (route: the router's ids as int bits [0, k), weights [k, 2k));
// table: the block's row of the slot table (expert -> device address, 0 when not resident). A
// missing pair goes to the CPU pool: its call (number seq = *seq0 + layer + 1) was submitted
// gated by the host with k pairs; graphcpu_put waits until the host has published it
// (ctrl[gen] >= seq), writes the misses' ids (compacted, rank order) into `ids`, their count into
// the call's job (ring slot seq % ring_slots, field j_n: the team reads it only after the gate),
// the block's input row into their rows of `xin`, then the gate. pick[j]: pair j's row of the
// call (-1: on the GPU), pick[k]: the count. With `seen` (mapped, 2k + 1 words; null: none) the
// put first copies the route and the count there and writes *seen_flag = seq (a streamed graph).
// graphcpu_combine waits for the call only when the count is nonzero (ho_wait) and sums in j order
// as moe1_down_combine / handoff1_down_combine.

// grid 1, block 256.
extern "C" __global__ void graphcpu_put(const float* __restrict__ route, const unsigned long long* __restrict__ table,
                                        int k, const float* __restrict__ x, int hidden, long long* ids, float* xin,
                                        int* pick, long long* ctrl, int gen, int gate, int broken,
                                        const long long* seq0, int layer, long long* ring, int ring_slots,
                                        int ring_fields, int j_n, long long timeout_ns, long long* err,
                                        long long* stamps, int stamp_slots, float* seen, long long* seen_flag) {
    __shared__ int n_s;
    long long seq = *(volatile const long long*)seq0 + layer + 1;
    if (threadIdx.x == 0) {
        int n = 0;
        for (int j = 0; j < k; j++) {
            int id = __float_as_int(route[j]);
            if (table[id] == 0ull) {
                pick[j] = n;
                *(volatile long long*)(ids + n) = id;
                n++;
            } else {
                pick[j] = -1;
            }
        }
        pick[k] = n;
        if (seen) {  // streamed: the host settles the block from its route and miss count while the graph runs
            for (int j = 0; j < 2 * k; j++) seen[j] = route[j];
            seen[2 * k] = __int_as_float(n);
            __threadfence_system();
            ho_release(seen_flag, seq);
        }
        long long t0 = ho_now();
        while (ho_acquire(ctrl + gen) < seq) {  // the host has filled and published the call
            if (*(volatile const long long*)(ctrl + broken)) break;
            if (ho_now() - t0 > timeout_ns) {
                atomicCAS((unsigned long long*)err, 0ull, (unsigned long long)seq);
                *(volatile long long*)(ctrl + broken) = 1;
                __threadfence_system();
                break;
            }
            __nanosleep(500);
        }
        *(volatile long long*)(ring + (seq % ring_slots) * ring_fields + j_n) = n;
        n_s = n;
    }
    __syncthreads();
    long long total = (long long)n_s * hidden;
    for (long long i = threadIdx.x; i < total; i += blockDim.x) xin[i] = x[i % hidden];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        stamps[3 * (seq % stamp_slots)] = ho_now();
        ho_release(ctrl + gate, seq);
    }
}

// h[j] = act(gate_j x, up_j x) for the resident pairs (moe1_gate_up's rows).
// grid (ceil(ffn / (WARPS * rows_per_warp)), k), block 32 * WARPS.
extern "C" __global__ void graphcpu_gate_up(const float* __restrict__ route, const unsigned long long* __restrict__ table,
                                            int k, const float* __restrict__ x, float* __restrict__ h, int ffn,
                                            int hidden, int rows_per_warp, long long off_g, int qt_g, long long rb_g,
                                            long long off_u, int qt_u, long long rb_u, int act, int bias) {
    int j = blockIdx.y;
    unsigned long long b = route_base(route, table, j);
    if (j >= k || !b) return;
    gate_up1_rows(reinterpret_cast<const unsigned char*>(b), j, x, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g,
                  off_u, qt_u, rb_u, act, bias);
}

// ys[j, r] = (down_j h[j] + bd_j)[r] for the resident pairs (moe1_down_combine's rows, before
// the sum). grid ceil(hidden / rows_per_block), block 32 * k.
extern "C" __global__ void graphcpu_down(const float* __restrict__ route, const unsigned long long* __restrict__ table,
                                         const float* __restrict__ h, float* __restrict__ ys, int k, int ffn,
                                         int hidden, int rows_per_block, long long off_d, int qt_d, long long rb_d,
                                         int bias) {
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block, tok[TB] = {0, 0, 0, 0};
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    if (!e) return;  // the whole warp: a CPU pair
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    for (int i = 0; i < rows_per_block && r0 + i < hidden; i++) {
        int r = r0 + i;
        float a[TB] = {0.f, 0.f, 0.f, 0.f};
        row_dot(qt_d, e + off_d + r * rb_d, ffn, h + (long long)j * ffn, 0, tok, 1, a);
        float s = warp_sum(a[0]);
        if (lane == 0) ys[(long long)j * hidden + r] = bias ? s + bd[r] : s;
    }
}

// out[r] = sum_j weight_j * y_j[r] in j order: y_j = ys[j] (GPU pair) or row pick[j] of `yout`
// (mapped; the CPU call's output, read once the call is done). grid ceil(hidden / 256), block 256.
extern "C" __global__ void graphcpu_combine(const float* __restrict__ route, const int* __restrict__ pick, int k,
                                            int hidden, const float* __restrict__ ys, const float* yout,
                                            float* __restrict__ out, const long long* ctrl, int done, int broken,
                                            const long long* seq0, int layer, long long timeout_ns, long long* relay,
                                            long long* err, long long* stamps, int stamp_slots) {
    long long seq = *(volatile const long long*)seq0 + layer + 1;
    bool ok = true;
    if (pick[k]) ok = ho_wait(ctrl, done, broken, seq, timeout_ns, relay, err, stamps + 3 * (seq % stamp_slots));
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < hidden) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) {
            int p = pick[jj];
            float y = p < 0 ? ys[(long long)jj * hidden + r]
                            : (ok ? *(volatile const float*)(yout + (long long)p * hidden + r) : 0.f);
            s += route[k + jj] * y;
        }
        out[r] = s;
    }
}
