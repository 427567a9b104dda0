// The GPU vector index's search: one fused pass over the fp16 rows (see embedder/src/cuda/index.rs).
// Compiled at run time with NVRTC, once per index, with the row width baked in:
//   -DIDX_CHUNKS=<row stride in 16-byte chunks of 8 halves>
// No header is included: fp16 -> fp32 is the PTX `cvt.f32.f16` that cuda_fp16.h's __half2float
// wraps.
//
// Work split: a block of SCAN_THREADS threads is SCAN_THREADS / 16 groups of 16 lanes (half-warps);
// a group scores two adjacent rows per step (16 lanes x IDX_CHUNKS / 16 chunks of 16 bytes each,
// all loads of both rows issued before the first use), grid-striding over the rows. Lane 0 of a
// group keeps that group's best k (k <= MAX_K) above the threshold in shared memory; at the end
// thread 0 merges the block's groups into the block's best k, so the kernel writes
// blocks * k candidates and never a score per row. Rows of other namespaces cost 16 bytes (their
// namespace and expiry), not their vector; free rows carry the expiry FREE_ROW.
//
// Output `out` (u32): [0] = number of expired rows met (may exceed expired_cap),
// [1 .. 1 + expired_cap] = those rows, then per block b and rank i < k the pair
// (score bits, row) at 1 + expired_cap + 2 * (b * k + i); row 0xffffffff = no candidate.

#ifndef IDX_CHUNKS
#error "IDX_CHUNKS (row stride / 8) must be defined"
#endif

#define SCAN_THREADS 256
#define LANES 16
#define GROUPS (SCAN_THREADS / LANES)
#define PER_LANE ((IDX_CHUNKS + LANES - 1) / LANES)
#define MAX_K 16
#define FREE_ROW (-9223372036854775807LL - 1LL)
#define NO_ROW 0xffffffffu

__device__ __forceinline__ float h2f(unsigned int bits) {
    float f;
    const unsigned short h = (unsigned short)(bits & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Dot product of 8 halves packed in a uint4 with 8 floats of the query.
__device__ __forceinline__ float dot8(const uint4 v, const float* q, float acc) {
    acc = fmaf(h2f(v.x), q[0], acc);
    acc = fmaf(h2f(v.x >> 16), q[1], acc);
    acc = fmaf(h2f(v.y), q[2], acc);
    acc = fmaf(h2f(v.y >> 16), q[3], acc);
    acc = fmaf(h2f(v.z), q[4], acc);
    acc = fmaf(h2f(v.z >> 16), q[5], acc);
    acc = fmaf(h2f(v.w), q[6], acc);
    acc = fmaf(h2f(v.w >> 16), q[7], acc);
    return acc;
}

// (score, row) ordering: higher score first, and on equal scores the lower row. Within a group
// rows arrive in increasing order, so this keeps the earlier entry on a tie, as CpuIndex does;
// in the block merge (groups offered in group order, which stops being row order once the
// grid-stride loop wraps) it keeps the merge consistent with the host's ordering by row.
__device__ __forceinline__ bool ahead(float s, unsigned int r, float t, unsigned int q) {
    return s > t || (s == t && r < q);
}

// Offer (score, row) to a group's sorted list of `count` entries, at most k kept. A full list
// rejects an entry that is not ahead of its last.
__device__ __forceinline__ void offer(float* s_score, unsigned int* s_row, int& count, int k,
                                      float score, unsigned int row) {
    if (count == k && !ahead(score, row, s_score[k - 1], s_row[k - 1])) return;
    int at = count < k ? count : k - 1;
    while (at > 0 && ahead(score, row, s_score[at - 1], s_row[at - 1])) {
        s_score[at] = s_score[at - 1];
        s_row[at] = s_row[at - 1];
        --at;
    }
    s_score[at] = score;
    s_row[at] = row;
    if (count < k) ++count;
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
scan_topk(const uint4* __restrict__ data, const unsigned long long* __restrict__ row_ns,
          const long long* __restrict__ row_expires, const float* __restrict__ query, int rows,
          unsigned long long ns, long long now, float threshold, int k,
          unsigned int* __restrict__ out, int expired_cap) {
    __shared__ float s_score[GROUPS][MAX_K];
    __shared__ unsigned int s_row[GROUPS][MAX_K];
    __shared__ int s_count[GROUPS];

    const int lane = threadIdx.x % LANES;
    const int group = threadIdx.x / LANES;
    // The 16 lanes of this half-warp: the shuffles below never involve the other half, whose
    // group may be on another row or done.
    const unsigned int half_mask = 0xffffu << (threadIdx.x & 16);
    const long long groups_total = (long long)gridDim.x * GROUPS;
    const long long first = (long long)blockIdx.x * GROUPS + group;

    // The query slice this lane multiplies, in registers for the whole scan.
    float q[PER_LANE][8];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int c = lane + j * LANES;
#pragma unroll
        for (int e = 0; e < 8; ++e) q[j][e] = c < IDX_CHUNKS ? query[c * 8 + e] : 0.f;
    }

    int count = 0;  // entries in this group's list (meaningful in lane 0)
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (long long r0 = first * 2; r0 < rows; r0 += groups_total * 2) {
        const long long r1 = r0 + 1;
        const bool has1 = r1 < rows;
        const unsigned long long ns0 = row_ns[r0];
        const long long exp0 = row_expires[r0];
        const unsigned long long ns1 = has1 ? row_ns[r1] : 0ull;
        const long long exp1 = has1 ? row_expires[r1] : FREE_ROW;
        const bool ok0 = ns0 == ns && exp0 != FREE_ROW;
        const bool ok1 = has1 && ns1 == ns && exp1 != FREE_ROW;
        if (!ok0 && !ok1) continue;  // uniform across the group

        uint4 a[PER_LANE];
        uint4 b[PER_LANE];
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            const int c = lane + j * LANES;
            const bool in = c < IDX_CHUNKS;
            a[j] = (ok0 && in) ? data[(size_t)r0 * IDX_CHUNKS + c] : zero;
            b[j] = (ok1 && in) ? data[(size_t)r1 * IDX_CHUNKS + c] : zero;
        }
        float s0 = 0.f;
        float s1 = 0.f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            s0 = dot8(a[j], q[j], s0);
            s1 = dot8(b[j], q[j], s1);
        }
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) {
            s0 += __shfl_xor_sync(half_mask, s0, o);
            s1 += __shfl_xor_sync(half_mask, s1, o);
        }
        if (lane == 0) {
            // Row 1 after row 0: equal scores keep scan order.
            const float sc[2] = {s0, s1};
            const bool ok[2] = {ok0, ok1};
            const long long ex[2] = {exp0, exp1};
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                if (!ok[i] || !(sc[i] >= threshold)) continue;
                const unsigned int row = (unsigned int)(r0 + i);
                if (ex[i] <= now) {
                    const unsigned int slot = atomicAdd(&out[0], 1u);
                    if (slot < (unsigned int)expired_cap) out[1 + slot] = row;
                    continue;
                }
                offer(s_score[group], s_row[group], count, k, sc[i], row);
            }
        }
    }
    if (lane == 0) s_count[group] = count;
    __syncthreads();

    if (threadIdx.x == 0) {
        // Merge the groups' lists into the block's best k (in group order, then rank order).
        float best[MAX_K];
        unsigned int best_row[MAX_K];
        int n = 0;
        for (int g = 0; g < GROUPS; ++g)
            for (int i = 0; i < s_count[g]; ++i)
                offer(best, best_row, n, k, s_score[g][i], s_row[g][i]);
        unsigned int* dst = out + 1 + expired_cap + (size_t)2 * blockIdx.x * k;
        for (int i = 0; i < k; ++i) {
            dst[2 * i] = i < n ? __float_as_uint(best[i]) : 0u;
            dst[2 * i + 1] = i < n ? best_row[i] : NO_ROW;
        }
    }
}
