// moelab CPU-graph kernels beyond handoff.cu's four (execute/graph_cpu.py; compiled after
// gpu_kernels.cu, expert_kernels_v4.cu and handoff.cu in one module, whose helpers they use). Off
// by default until measured on a GPU: MOELAB_GRAPH_CPU_STREAM=1 (graphcpu_put_seen: the put that
// hands each block's route to the host) and MOELAB_GRAPH_CPU_V4=1 (two launches a block).

// graphcpu_put's work (handoff.cu), by one whole block of any size, that first copies the block's
// route and miss count into `seen` (mapped, 2k + 1 words) and writes *seen_flag = seq: the host
// settles the block's step from there while the graph runs on.
__device__ void graphcpu_put_seen_block(const float* __restrict__ route, const unsigned long long* __restrict__ table,
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
        for (int j = 0; j < 2 * k; j++) seen[j] = route[j];  // the host settles the block from here
        seen[2 * k] = __int_as_float(n);
        __threadfence_system();
        ho_release(seen_flag, seq);
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

#define GRAPHCPU_PUT_SEEN_PARAMS                                                                   \
    const float *__restrict__ route, const unsigned long long *__restrict__ table, int k,                          \
        const float *__restrict__ x, int hidden, long long *ids, float *xin, int *pick, long long *ctrl, int gen,  \
        int gate, int broken, const long long *seq0, int layer, long long *ring, int ring_slots, int ring_fields, \
        int j_n, long long timeout_ns, long long *err, long long *stamps, int stamp_slots, float *seen,           \
        long long *seen_flag
#define GRAPHCPU_PUT_SEEN_ARGS                                                                                \
    route, table, k, x, hidden, ids, xin, pick, ctrl, gen, gate, broken, seq0, layer, ring, ring_slots, \
        ring_fields, j_n, timeout_ns, err, stamps, stamp_slots, seen, seen_flag

// graphcpu_put with the seen copy (MOELAB_GRAPH_CPU_STREAM=1 with the four launches). grid 1,
// block 256.
extern "C" __global__ void graphcpu_put_seen(GRAPHCPU_PUT_SEEN_PARAMS) {
    graphcpu_put_seen_block(GRAPHCPU_PUT_SEEN_ARGS);
}

// ---- the CPU graph's v4 launches (MOELAB_GRAPH_CPU_V4=1): two per block ------------------------
// graphcpu_gate_up_v4 is graphcpu_put_seen (the block (0, k)) beside moe1r_gate_up_v4's rows of the
// resident pairs (blocks (x, j < k)); graphcpu_down_combine_v4 is moe1r_down_combine_v4's rows of
// the resident pairs, then graphcpu_combine's wait and sum for its rows (each block reads its
// rows of the CPU's output, one load per pair and row). Both are launched
// programmatically (the router's output is read after the wait; the put's pick after the second
// launch's wait); the sums are v4's, the bits of v1 (see expert_kernels_v4.cu), so of the
// block-by-block hand-off.

// grid (ceil(ffn / (WARPS * rows_per_warp)), k + 1), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS, 6) graphcpu_gate_up_v4(
        GRAPHCPU_PUT_SEEN_PARAMS, float* __restrict__ h, int ffn, int rows_per_warp, long long off_g, int qt_g,
        long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ uint4 stg[V4_GU_STG];
    pdl_wait_trigger();
    int j = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (j == k) {
        if (blockIdx.x == 0) graphcpu_put_seen_block(GRAPHCPU_PUT_SEEN_ARGS);
        return;
    }
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    if (!e) return;  // a CPU pair
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, r1 = min(r0 + rows_per_warp, ffn);
    if (qt_g != Q8_0 || qt_u != Q8_0) {
        gate_up_rows_v2(e, j, r0, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias, x, h,
                        lane);
        return;
    }
    const int cap = V4_GU_STG / WARPS;
    uint4* buf = stg + warp * cap;
    const unsigned char* rows[4];
    for (int r = r0; r < r1; r += 2) {  // gate and up of rows r and r + 1, staged together
        int r2 = min(r + 1, r1 - 1), nr = r2 > r ? 4 : 2;
        rows[0] = e + off_g + r * rb_g;
        rows[1] = e + off_u + r * rb_u;
        rows[2] = e + off_g + r2 * rb_g;
        rows[3] = e + off_u + r2 * rb_u;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        q8_rows_dot<4>(rows, nr, hidden, x, buf, cap, false, acc, lane);
        #pragma unroll
        for (int p = 0; p < 2; p++) {
            float a = warp_sum(acc[2 * p]), b = warp_sum(acc[2 * p + 1]);
            int rr = r + p;
            if (2 * p < nr) {
                if (bias) {
                    a += reinterpret_cast<const float*>(e)[rr];
                    b += reinterpret_cast<const float*>(e)[ffn + rr];
                }
                if (lane == 0) h[(long long)j * ffn + rr] = expert_act(act, a, b);
            }
        }
    }
}

// out[r] = sum_j weight_j * y_j[r] in j order for this block's rows: y_j the resident pair's down
// row (moe1r_down_combine_v4's), or the CPU call's output row pick[j] of `yout` (mapped; read once
// the call is done, one load per pair and row, all of a block's in flight at once).
// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32.
extern "C" __global__ void __launch_bounds__(32 * MAXK) graphcpu_down_combine_v4(
        const float* __restrict__ route, const unsigned long long* __restrict__ table, const int* pick,
        const float* __restrict__ h, float* __restrict__ out, int k, int ffn, int hidden, int rows_per_block,
        long long off_d, int qt_d, long long rb_d, int bias, const float* yout, const long long* ctrl, int done,
        int broken, const long long* seq0, int layer, long long timeout_ns, long long* relay, long long* err,
        long long* stamps, int stamp_slots) {
    __shared__ float ys[MAXK][32];
    __shared__ uint4 stg[V4_DN_STG];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    int cap = V4_DN_STG / (blockDim.x >> 5), units = ffn >> 5, r1 = min(r0 + rows_per_block, hidden);
    uint4* buf = stg + j * cap;
    bool q8 = qt_d == Q8_0;
    const unsigned char* rows[4];
    if (q8 && r0 < r1 && e) {  // the first four rows' copies, before the wait (a CPU pair: none)
        #pragma unroll
        for (int i = 0; i < 4; i++) rows[i] = e + off_d + min(r0 + i, r1 - 1) * rb_d;
        int w = q8_window(cap, 4, units);
        q8_stage<4>(rows, min(4, r1 - r0), 0, min(w, units), buf, q8_stride(w), lane);
    }
    pdl_wait_trigger();  // h and pick come from graphcpu_gate_up_v4
    for (int i = 0; e && r0 + i < r1; i += 4) {  // four rows per batch (the whole warp: e is the pair's)
        int r = r0 + i, nr = min(4, r1 - r);
        float a[4] = {0.f, 0.f, 0.f, 0.f};
        if (q8) {
            #pragma unroll
            for (int t = 0; t < 4; t++) rows[t] = e + off_d + min(r + t, r1 - 1) * rb_d;
            q8_rows_dot<4>(rows, nr, ffn, hj, buf, cap, i == 0, a, lane);
        } else {
            #pragma unroll
            for (int t = 0; t < 4; t += 2) {
                if (t < nr) {
                    int n2 = min(2, nr - t);
                    const unsigned char* rs[2] = {e + off_d + (r + t) * rb_d, e + off_d + (r + t + n2 - 1) * rb_d};
#define V2_D(T) rows_dot_v2<T, 2>(rs, n2, ffn, hj, a + t)
                    V2_DISPATCH(qt_d, V2_D)
#undef V2_D
                }
            }
        }
        #pragma unroll
        for (int t = 0; t < 4; t++) {
            float s = warp_sum(a[t]);
            if (lane == 0 && t < nr) ys[j][i + t] = bias ? s + bd[r + t] : s;
        }
    }
    if (pick[k]) {  // the block's CPU pairs: their rows once the call is done
        long long seq = *(volatile const long long*)seq0 + layer + 1;
        bool ok = ho_wait(ctrl, done, broken, seq, timeout_ns, relay, err, stamps + 3 * (seq % stamp_slots));
        int p = pick[j];
        if (p >= 0 && lane < r1 - r0)
            ys[j][lane] = ok ? *(volatile const float*)(yout + (long long)p * hidden + r0 + lane) : 0.f;
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < r1 - r0) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += route[k + jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}
