// Kernels of the GPU transformer (all-MiniLM-L6-v2) and of the GPU static table, compiled at run
// time with NVRTC (see embedder/src/cuda/mod.rs). Plain CUDA C: no header is included, so NVRTC
// needs nothing but its own built-ins.
//
// Layouts (all f32, row-major, C order):
//   hidden states   x      [tokens, h]            tokens = texts * len (padded batch)
//   per-head q/k/v         [texts, heads, len, dh]  dh = h / heads
//   attention scores       [texts * heads, len, len] (row = query position, column = key)
//   attention mask         [texts, len] as u32, 1 = real token, 0 = padding
// "One warp per row" kernels take blockDim.x a multiple of 32; a warp whose row is out of range
// returns as a whole, so the warp-wide shuffles never see a partial warp.

#define FULL_MASK 0xffffffffu
#define NEG_MAX (-3.402823466e38f)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Layer normalisation of one row held by one warp, in place in `o` (each lane touches only its own
// columns c = lane, lane + 32, ...: no synchronisation needed between the passes). Two passes
// (mean, then variance of the centred values), as candle's LayerNorm.
__device__ __forceinline__ void warp_layernorm(float* o, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, int h, float eps,
                                               int lane, float sum) {
    const float mean = warp_sum(sum) / (float)h;
    float sq = 0.f;
    for (int c = lane; c < h; c += 32) {
        const float d = o[c] - mean;
        sq += d * d;
    }
    const float denom = sqrtf(warp_sum(sq) / (float)h + eps);
    for (int c = lane; c < h; c += 32) o[c] = (o[c] - mean) / denom * gamma[c] + beta[c];
}

// x[t] = LayerNorm(word[ids[t]] + type0 + pos[t % len]); one warp per token.
extern "C" __global__ void embed_layernorm(const unsigned int* __restrict__ ids,
                                           const float* __restrict__ word,
                                           const float* __restrict__ pos,
                                           const float* __restrict__ type0,
                                           const float* __restrict__ gamma,
                                           const float* __restrict__ beta,
                                           float* __restrict__ x, int tokens, int len, int h,
                                           float eps) {
    const int t = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= tokens) return;
    const float* w = word + (size_t)ids[t] * h;
    const float* p = pos + (size_t)(t % len) * h;
    float* o = x + (size_t)t * h;
    float sum = 0.f;
    for (int c = lane; c < h; c += 32) {
        // candle: (word + token type) + position.
        const float v = (w[c] + type0[c]) + p[c];
        o[c] = v;
        sum += v;
    }
    warp_layernorm(o, gamma, beta, h, eps, lane, sum);
}

// qkv [tokens, 3h] (the fused projection, without bias) -> q, k, v [texts, heads, len, dh] with
// the bias added. One thread per element of qkv.
extern "C" __global__ void split_heads(const float* __restrict__ qkv,
                                       const float* __restrict__ bias, float* __restrict__ q,
                                       float* __restrict__ k, float* __restrict__ v, int tokens,
                                       int len, int h, int heads) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t width = (size_t)3 * h;
    if (i >= (size_t)tokens * width) return;
    const int col = (int)(i % width);
    const int t = (int)(i / width);
    const int which = col / h;
    const int c = col - which * h;
    const int dh = h / heads;
    const int head = c / dh;
    const int d = c - head * dh;
    const int text = t / len;
    const int at = t - text * len;
    const size_t dst = (((size_t)text * heads + head) * len + at) * dh + d;
    const float val = qkv[i] + bias[col];
    if (which == 0) {
        q[dst] = val;
    } else if (which == 1) {
        k[dst] = val;
    } else {
        v[dst] = val;
    }
}

// Softmax over each row of scores [rows = texts * heads * len, len], padding keys masked out
// (weight exactly 0, as candle's additive f32::MIN mask gives). One warp per row. `mask` points at
// the first text of this chunk of the batch.
extern "C" __global__ void softmax_masked(float* __restrict__ scores,
                                          const unsigned int* __restrict__ mask, int rows, int len,
                                          int heads) {
    const int row = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int text = row / (heads * len);
    float* s = scores + (size_t)row * len;
    const unsigned int* m = mask + (size_t)text * len;
    float mx = NEG_MAX;
    for (int j = lane; j < len; j += 32)
        if (m[j] != 0u) mx = fmaxf(mx, s[j]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int j = lane; j < len; j += 32) {
        const float e = m[j] != 0u ? expf(s[j] - mx) : 0.f;
        s[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    // A row always has its [CLS] key; the guard only keeps an all-padding row finite.
    const float denom = sum > 0.f ? sum : 1.f;
    for (int j = lane; j < len; j += 32) s[j] = s[j] / denom;
}

// Per-head context [texts, heads, len, dh] -> [tokens, h] (heads side by side). One thread per
// output element.
extern "C" __global__ void merge_heads(const float* __restrict__ ctx_heads,
                                       float* __restrict__ out, int tokens, int len, int h,
                                       int heads) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * h) return;
    const int c = (int)(i % h);
    const int t = (int)(i / h);
    const int dh = h / heads;
    const int head = c / dh;
    const int d = c - head * dh;
    const int text = t / len;
    const int at = t - text * len;
    out[i] = ctx_heads[(((size_t)text * heads + head) * len + at) * dh + d];
}

// x[t] = LayerNorm((y[t] + bias) + x[t]): a dense layer's bias, the residual connection and the
// layer norm, fused. One warp per token; `x` is read and written in place.
extern "C" __global__ void bias_residual_layernorm(const float* __restrict__ y,
                                                   const float* __restrict__ bias,
                                                   float* __restrict__ x,
                                                   const float* __restrict__ gamma,
                                                   const float* __restrict__ beta, int tokens,
                                                   int h, float eps) {
    const int t = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= tokens) return;
    const float* yr = y + (size_t)t * h;
    float* o = x + (size_t)t * h;
    float sum = 0.f;
    for (int c = lane; c < h; c += 32) {
        const float v = (yr[c] + bias[c]) + o[c];
        o[c] = v;
        sum += v;
    }
    warp_layernorm(o, gamma, beta, h, eps, lane, sum);
}

// a[i] = gelu(a[i] + bias[i % width]), GELU in its exact erf form, written as candle writes it:
// (erf(v / sqrt 2) + 1) * 0.5 * v.
extern "C" __global__ void bias_gelu(float* __restrict__ a, const float* __restrict__ bias,
                                     int rows, int width) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * width) return;
    const float v = a[i] + bias[i % width];
    a[i] = (erff(v * 0.7071067811865476f) + 1.f) * 0.5f * v;
}

// out[b] = normalize(mean of x[b, j] over the real tokens j). One warp per text.
extern "C" __global__ void mean_pool_normalize(const float* __restrict__ x,
                                               const unsigned int* __restrict__ mask,
                                               float* __restrict__ out, int texts, int len,
                                               int h) {
    const int b = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (b >= texts) return;
    const unsigned int* m = mask + (size_t)b * len;
    float count = 0.f;
    for (int j = 0; j < len; ++j) count += m[j] != 0u ? 1.f : 0.f;
    count = fmaxf(count, 1e-9f);
    float* o = out + (size_t)b * h;
    float sq = 0.f;
    for (int c = lane; c < h; c += 32) {
        float acc = 0.f;
        for (int j = 0; j < len; ++j)
            if (m[j] != 0u) acc += x[((size_t)b * len + j) * h + c];
        const float mean = acc / count;
        o[c] = mean;
        sq += mean * mean;
    }
    const float norm = fmaxf(sqrtf(warp_sum(sq)), 1e-12f);
    for (int c = lane; c < h; c += 32) o[c] = o[c] / norm;
}

// x[t] /= max(|x[t]|, 1e-12), in place. One warp per token.
extern "C" __global__ void l2_normalize_rows(float* __restrict__ x, int rows, int h) {
    const int t = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= rows) return;
    float* o = x + (size_t)t * h;
    float sq = 0.f;
    for (int c = lane; c < h; c += 32) sq += o[c] * o[c];
    const float norm = fmaxf(sqrtf(warp_sum(sq)), 1e-12f);
    for (int c = lane; c < h; c += 32) o[c] = o[c] / norm;
}

// The static path: out[b] = normalize(sum of table[ids[j]] for j in offsets[b]..offsets[b+1]),
// ids past the table skipped, a zero sum left zero (as StaticEmbedder::embed_ids). One block per
// text; blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ void static_pool(const float* __restrict__ table,
                                       const unsigned int* __restrict__ ids,
                                       const unsigned int* __restrict__ offsets,
                                       float* __restrict__ out, int texts, int dim,
                                       unsigned int vocab) {
    __shared__ float partial[32];
    const int b = blockIdx.x;
    if (b >= texts) return;
    const unsigned int start = offsets[b];
    const unsigned int end = offsets[b + 1];
    float* o = out + (size_t)b * dim;
    float sq = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float acc = 0.f;
        for (unsigned int j = start; j < end; ++j) {
            const unsigned int id = ids[j];
            if (id < vocab) acc += table[(size_t)id * dim + c];
        }
        o[c] = acc;
        sq += acc * acc;
    }
    sq = warp_sum(sq);
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    if (lane == 0) partial[warp] = sq;
    __syncthreads();
    if (warp == 0) {
        const int warps = (int)((blockDim.x + 31) >> 5);
        float v = lane < warps ? partial[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    const float norm = sqrtf(partial[0]);
    if (norm > 0.f)
        for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = o[c] / norm;
}
