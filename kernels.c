/* The CPU compute kernels kernels.py calls through ctypes (fp32, forward and backward):
   causal grouped-query attention, and the SwiGLU experts of a MoE layer. Both exist because
   torch's own CPU ops do work these layers do not need; both run their block products on
   the BLAS `sgemm_` that torch itself links (MKL on x86-64 wheels, handed over by
   `kernels_init`), on the threads of torch's OpenMP pool, each taking tasks from an atomic
   counter with one BLAS thread.

   Attention. torch 2.13's CPU flash kernel walks keys in blocks of 512 and computes a block
   whole even where the causal mask removes it, so at T <= 512 causal attention costs what
   full attention does. Here every query block stops at its own causal frontier: block i
   (BQ rows) meets keys [0, (i+1) BQ) only, about half the scores plus half a diagonal block
   (0.53 of T^2 at BQ = 32, T = 512; torch computes 1.0). The algorithm is FlashAttention-2's
   (arXiv 2307.08691, alg. 1 and 2): the forward keeps a running max and sum over key chunks
   of KB (online softmax) and saves each row's log-sum-exp; the backward recomputes
   P = exp(S - lse) chunk by chunk, with dS = P * (dP - rowsum(dO * O)). The R = H/J query
   heads that share a kv head are stacked into one block of R * BQ rows, so K and V are
   read once per group and the products are R times taller. Forward tasks are (batch, kv
   head, query block), longest first; backward tasks are (batch, kv head), each owning its
   dK and dV (no atomics).

   Experts. A MoE layer's experts as torch runs them are three passes through memory over
   the routed rows: a grouped GEMM writing h = x W13 [R, 2I], SwiGLU reading it and writing
   g [R, I], a grouped GEMM reading g; the backward adds as many. Here each task is one
   expert (largest first), its rows taken RB at a time: x_b W13 -> SwiGLU -> g W2 while the
   block is in cache, h kept only where the caller saves it for the backward, g never
   stored (the backward recomputes it from h). The backward per block: g again,
   dW2 += g^T dy, dg = dy W2^T, dh = SwiGLU'(h) dg, dW13 += x^T dh, dx = dh W13^T; each task
   owns its expert's dW13 and dW2.

   Combine. Each token's K expert outputs, read back through the inverse of the sort by
   expert and weighted by the gate, summed in one pass (torch: a gather of [N K, D], a
   product, a sum; the backward as many), the backward writing each routed row's gradient
   once (the sort is a permutation) and the gate weights' gradients as dot products.

   Compiled with -ffast-math for the vectorised expf: every value is finite (masked scores
   are skipped, never set to -inf).

   Layouts (row-major, in elements): attention q, out, dO, dq [B, H, T, d] and k, v, dk, dv
   [B, J, T, d] with any strides for the first three dims and d contiguous, lse [B, H, T]
   contiguous; experts x, y, dx [R, D], h [R, 2I] (gate | up), W13 [E, D, 2I], W2 [E, I, D],
   all contiguous, rows grouped by expert (counts[e] rows each); combine out, dout [N K, D],
   y, dy [N, D], w, dw [N, K], inverse [N K] int64, contiguous. Shape legend: B batch,
   H query heads, J kv heads, R = H / J (attention) or routed rows (experts), T tokens,
   d head dim, M stacked query rows of a block, N keys in a chunk, E experts, D model dim,
   I expert hidden dim. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* ---------------------------------------------------------------- BLAS and worker threads */

typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);
typedef int (*local_threads_fn)(const int*);
static sgemm_fn sgemm;
static local_threads_fn blas_set_local_threads; /* mkl_set_num_threads_local (Fortran ABI: int*) */

void kernels_init(void* sgemm_ptr, void* local_threads_ptr) {
  sgemm = (sgemm_fn)sgemm_ptr;
  blas_set_local_threads = (local_threads_fn)local_threads_ptr;
}

/* Row-major C[M,N] = alpha op(A) op(B) + beta C through the column-major BLAS: C^T = op(B)^T op(A)^T. */
static void mm(int ta, int tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
               float beta, float* C, int ldc) {
  char ca = tb ? 'T' : 'N', cb = ta ? 'T' : 'N';
  sgemm(&ca, &cb, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

typedef void (*task_fn)(const void* job, int task, float* buf);
typedef struct {
  const void* job;
  task_fn task;
  size_t buf_floats;
  int ntasks, next; /* next: the atomic task counter */
} Pool;

static void work(Pool* p, int blas_threads) {
  int prev = blas_set_local_threads(&blas_threads);
  /* 64-byte aligned like torch's tensors: MKL's blocking (so its rounding) may depend on alignment */
  float* buf = aligned_alloc(64, (sizeof(float) * p->buf_floats + 127) / 64 * 64);
  if (buf) { /* else the other workers take this one's share */
    for (int t; (t = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED)) < p->ntasks;) p->task(p->job, t, buf);
    free(buf);
  }
  blas_set_local_threads(&prev);
}

/* Runs tasks 0..ntasks-1 on min(nthreads, ntasks) threads of the OpenMP pool, each with a
   scratch buffer of buf_floats and one BLAS thread; one task runs on the caller with a BLAS
   of nthreads. The pool is torch's own (this library's libgomp.so.1 resolves to the copy
   torch loaded), so its threads, which spin a few ms after each torch op, are the workers
   here rather than competing with them. Returns 0, or -1 when no worker could allocate its
   buffer (then the outputs are incomplete). */
static int run_tasks(const void* job, task_fn task, int ntasks, size_t buf_floats, int nthreads) {
  if (ntasks <= 0) return 0;
  Pool p = {job, task, buf_floats, ntasks, 0};
  int n = MIN(nthreads, ntasks);
  if (n <= 1) {
    work(&p, nthreads > 1 ? nthreads : 1);
  } else {
#pragma omp parallel num_threads(n)
    work(&p, 1);
  }
  return p.next >= ntasks ? 0 : -1;
}

/* ---------------------------------------------------------------- causal attention */

typedef struct {
  int B, H, J, T, d, BQ, KB;
  float scale;
  const float *q, *k, *v, *o, *lse, *go;
  float *out, *lse_out, *dq, *dk, *dv;
  int64_t sq[3], sk[3], sv[3], so[3], sgo[3], sdq[3], sdk[3], sdv[3]; /* strides of dims 0-2 */
} Attn;

#define ROW(p, s, b, h, t) ((p) + (b) * (s)[0] + (h) * (s)[1] + (t) * (s)[2])

/* Forward task t: kv head g of batch row b, query block i, its R heads stacked. */
static void attn_fwd_task(const void* job, int t, float* buf) {
  const Attn* a = job;
  int R = a->H / a->J, d = a->d, nq = (a->T + a->BQ - 1) / a->BQ;
  int i = nq - 1 - t / (a->B * a->J), b = t % (a->B * a->J) / a->J, g = t % a->J; /* longest first */
  int q0 = i * a->BQ, rows = MIN(a->BQ, a->T - q0), M = R * rows, keys = q0 + rows;
  float *Q = buf, *O = Q + (size_t)M * d, *S = O + (size_t)M * d, *mx = S + (size_t)M * a->KB, *sum = mx + M;
  for (int m = 0; m < M; m++) memcpy(Q + (size_t)m * d, ROW(a->q, a->sq, b, g * R + m / rows, q0 + m % rows), d * 4);
  const float *K = ROW(a->k, a->sk, b, g, 0), *V = ROW(a->v, a->sv, b, g, 0);
  for (int n0 = 0; n0 < keys; n0 += a->KB) {
    int N = MIN(a->KB, keys - n0);
    mm(0, 1, M, N, d, a->scale, Q, d, K + n0 * a->sk[2], (int)a->sk[2], 0.f, S, N); /* S = scale Q K^T */
    for (int m = 0; m < M; m++) {
      float* s = S + (size_t)m * N;
      int valid = MIN(N, q0 + m % rows - n0 + 1); /* keys at or before this query's position */
      float m_new = n0 ? mx[m] : s[0], acc = 0.f;
      for (int j = 0; j < valid; j++) m_new = s[j] > m_new ? s[j] : m_new;
      for (int j = 0; j < valid; j++) acc += (s[j] = expf(s[j] - m_new));
      for (int j = valid > 0 ? valid : 0; j < N; j++) s[j] = 0.f;
      if (n0) { /* rescale what the earlier chunks accumulated to the new running max */
        float c = expf(mx[m] - m_new);
        sum[m] = sum[m] * c + acc;
        for (int x = 0; x < d; x++) O[(size_t)m * d + x] *= c;
      } else {
        sum[m] = acc;
      }
      mx[m] = m_new;
    }
    mm(0, 0, M, d, N, 1.f, S, N, V + n0 * a->sv[2], (int)a->sv[2], n0 ? 1.f : 0.f, O, d); /* O += P V */
  }
  for (int m = 0; m < M; m++) {
    int h = g * R + m / rows, r = q0 + m % rows;
    float inv = 1.f / sum[m], *dst = ROW(a->out, a->so, b, h, r);
    for (int x = 0; x < d; x++) dst[x] = O[(size_t)m * d + x] * inv;
    a->lse_out[((size_t)b * a->H + h) * a->T + r] = mx[m] + logf(sum[m]);
  }
}

/* Backward task t: kv head g of batch row b; query blocks in turn, keys in chunks of KB. */
static void attn_bwd_task(const void* job, int t, float* buf) {
  const Attn* a = job;
  int R = a->H / a->J, d = a->d, T = a->T, b = t / a->J, g = t % a->J, Mmax = R * a->BQ;
  float *Q = buf, *dO = Q + (size_t)Mmax * d, *dQ = dO + (size_t)Mmax * d, *P = dQ + (size_t)Mmax * d;
  float *dP = P + (size_t)Mmax * a->KB, *delta = dP + (size_t)Mmax * a->KB, *lse = delta + Mmax;
  const float *K = ROW(a->k, a->sk, b, g, 0), *V = ROW(a->v, a->sv, b, g, 0);
  float *dK = ROW(a->dk, a->sdk, b, g, 0), *dV = ROW(a->dv, a->sdv, b, g, 0);
  for (int n = 0; n < T; n++) {
    memset(dK + n * a->sdk[2], 0, d * 4);
    memset(dV + n * a->sdv[2], 0, d * 4);
  }
  for (int q0 = 0; q0 < T; q0 += a->BQ) {
    int rows = MIN(a->BQ, T - q0), M = R * rows, keys = q0 + rows;
    for (int m = 0; m < M; m++) {
      int h = g * R + m / rows, r = q0 + m % rows;
      const float *go = ROW(a->go, a->sgo, b, h, r), *o = ROW(a->o, a->so, b, h, r);
      float D = 0.f;
      for (int x = 0; x < d; x++) D += go[x] * o[x];
      delta[m] = D; /* rowsum(dO * O) = sum_j P_j dP_j */
      lse[m] = a->lse[((size_t)b * a->H + h) * T + r];
      memcpy(Q + (size_t)m * d, ROW(a->q, a->sq, b, h, r), d * 4);
      memcpy(dO + (size_t)m * d, go, d * 4);
    }
    for (int n0 = 0; n0 < keys; n0 += a->KB) {
      int N = MIN(a->KB, keys - n0);
      const float *Kc = K + n0 * a->sk[2], *Vc = V + n0 * a->sv[2];
      mm(0, 1, M, N, d, a->scale, Q, d, Kc, (int)a->sk[2], 0.f, P, N); /* S = scale Q K^T */
      mm(0, 1, M, N, d, 1.f, dO, d, Vc, (int)a->sv[2], 0.f, dP, N);     /* dP = dO V^T */
      for (int m = 0; m < M; m++) {
        float *p = P + (size_t)m * N, *dp = dP + (size_t)m * N, l = lse[m], D = delta[m];
        int valid = MIN(N, q0 + m % rows - n0 + 1);
        for (int j = 0; j < valid; j++) {
          p[j] = expf(p[j] - l);
          dp[j] = p[j] * (dp[j] - D); /* dS */
        }
        for (int j = valid > 0 ? valid : 0; j < N; j++) p[j] = dp[j] = 0.f;
      }
      mm(1, 0, N, d, M, 1.f, P, N, dO, d, 1.f, dV + n0 * a->sdv[2], (int)a->sdv[2]);      /* dV += P^T dO */
      mm(0, 0, M, d, N, a->scale, dP, N, Kc, (int)a->sk[2], n0 ? 1.f : 0.f, dQ, d);       /* dQ = s dS K */
      mm(1, 0, N, d, M, a->scale, dP, N, Q, d, 1.f, dK + n0 * a->sdk[2], (int)a->sdk[2]); /* dK += s dS^T Q */
    }
    for (int m = 0; m < M; m++)
      memcpy(ROW(a->dq, a->sdq, b, g * R + m / rows, q0 + m % rows), dQ + (size_t)m * d, d * 4);
  }
}

#define ATTN_ARGS int B, int H, int J, int T, int d, int BQ, int KB, float scale, int nthreads
#define ATTN_SHAPE {.B = B, .H = H, .J = J, .T = T, .d = d, .BQ = BQ, .KB = KB, .scale = scale}

int attn_fwd(ATTN_ARGS, const float* q, const int64_t* sq, const float* k, const int64_t* sk, const float* v,
             const int64_t* sv, float* out, const int64_t* so, float* lse) {
  Attn a = ATTN_SHAPE;
  a.q = q, a.k = k, a.v = v, a.out = out, a.lse_out = lse;
  memcpy(a.sq, sq, sizeof a.sq), memcpy(a.sk, sk, sizeof a.sk), memcpy(a.sv, sv, sizeof a.sv);
  memcpy(a.so, so, sizeof a.so);
  size_t M = (size_t)(H / J) * BQ;
  return run_tasks(&a, attn_fwd_task, B * J * ((T + BQ - 1) / BQ), M * (2 * d + KB + 2), nthreads);
}

int attn_bwd(ATTN_ARGS, const float* go, const int64_t* sgo, const float* q, const int64_t* sq, const float* k,
             const int64_t* sk, const float* v, const int64_t* sv, const float* o, const int64_t* so, const float* lse,
             float* dq, const int64_t* sdq, float* dk, const int64_t* sdk, float* dv, const int64_t* sdv) {
  Attn a = ATTN_SHAPE;
  a.go = go, a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse, a.dq = dq, a.dk = dk, a.dv = dv;
  memcpy(a.sgo, sgo, sizeof a.sgo), memcpy(a.sq, sq, sizeof a.sq), memcpy(a.sk, sk, sizeof a.sk);
  memcpy(a.sv, sv, sizeof a.sv), memcpy(a.so, so, sizeof a.so), memcpy(a.sdq, sdq, sizeof a.sdq);
  memcpy(a.sdk, sdk, sizeof a.sdk), memcpy(a.sdv, sdv, sizeof a.sdv);
  size_t M = (size_t)(H / J) * BQ;
  return run_tasks(&a, attn_bwd_task, B * J, M * (3 * d + 2 * KB + 2), nthreads);
}

/* ---------------------------------------------------------------- SwiGLU experts */

typedef struct {
  int E, D, I, RB;
  const int64_t *counts, *start; /* rows of each expert and where they begin */
  const int* order;              /* experts by decreasing rows: the task order */
  const float *x, *w13, *w2, *h_saved, *dy;
  float *h, *y, *dx, *dw13, *dw2;
} Experts;

/* g = silu(gate) * up for rows h = [gate | up] (arXiv 2002.05202) */
static void swiglu(const float* h, float* g, int rows, int I) {
  for (int r = 0; r < rows; r++) {
    const float *a = h + (size_t)r * 2 * I, *u = a + I;
    float* o = g + (size_t)r * I;
    for (int j = 0; j < I; j++) o[j] = a[j] / (1.f + expf(-a[j])) * u[j];
  }
}

static void experts_fwd_task(const void* job, int t, float* buf) {
  const Experts* X = job;
  int e = X->order[t], n = (int)X->counts[e], D = X->D, I = X->I;
  const float *w13 = X->w13 + (size_t)e * D * 2 * I, *w2 = X->w2 + (size_t)e * I * D;
  float* g = buf;
  for (int r0 = 0; r0 < n; r0 += X->RB) {
    int rows = MIN(X->RB, n - r0);
    size_t row = (size_t)X->start[e] + r0;
    float* h = X->h ? X->h + row * 2 * I : buf + (size_t)X->RB * I; /* kept for the backward, or scratch */
    mm(0, 0, rows, 2 * I, D, 1.f, X->x + row * D, D, w13, 2 * I, 0.f, h, 2 * I);
    swiglu(h, g, rows, I);
    mm(0, 0, rows, D, I, 1.f, g, I, w2, D, 0.f, X->y + row * D, D);
  }
}

static void experts_bwd_task(const void* job, int t, float* buf) {
  const Experts* X = job;
  int e = X->order[t], n = (int)X->counts[e], D = X->D, I = X->I;
  const float *w13 = X->w13 + (size_t)e * D * 2 * I, *w2 = X->w2 + (size_t)e * I * D;
  float *dw13 = X->dw13 + (size_t)e * D * 2 * I, *dw2 = X->dw2 + (size_t)e * I * D;
  float *g = buf, *dg = g + (size_t)X->RB * I, *dh = dg + (size_t)X->RB * I;
  if (n == 0) {
    memset(dw13, 0, sizeof(float) * D * 2 * I);
    memset(dw2, 0, sizeof(float) * I * D);
  }
  for (int r0 = 0; r0 < n; r0 += X->RB) {
    int rows = MIN(X->RB, n - r0);
    size_t row = (size_t)X->start[e] + r0;
    const float *h = X->h_saved + row * 2 * I, *dy = X->dy + row * D, *x = X->x + row * D;
    float beta = r0 ? 1.f : 0.f; /* the first block writes the weight gradients, the rest add */
    swiglu(h, g, rows, I);
    mm(1, 0, I, D, rows, 1.f, g, I, dy, D, beta, dw2, D); /* dW2 += g^T dy */
    mm(0, 1, rows, I, D, 1.f, dy, D, w2, D, 0.f, dg, I);  /* dg = dy W2^T */
    for (int r = 0; r < rows; r++) {
      const float *a = h + (size_t)r * 2 * I, *u = a + I, *gr = dg + (size_t)r * I;
      float *da = dh + (size_t)r * 2 * I, *du = da + I;
      for (int j = 0; j < I; j++) { /* silu'(a) = s (1 + a (1 - s)), s = sigmoid(a) */
        float s = 1.f / (1.f + expf(-a[j]));
        du[j] = gr[j] * a[j] * s;
        da[j] = gr[j] * u[j] * s * (1.f + a[j] * (1.f - s));
      }
    }
    mm(1, 0, D, 2 * I, rows, 1.f, x, D, dh, 2 * I, beta, dw13, 2 * I);        /* dW13 += x^T dh */
    mm(0, 1, rows, D, 2 * I, 1.f, dh, 2 * I, w13, 2 * I, 0.f, X->dx + row * D, D); /* dx = dh W13^T */
  }
}

/* Fills start and order (experts by decreasing rows, insertion sort: E is small); -1 without memory. */
static int plan_experts(Experts* X, int64_t** start, int** order) {
  *start = malloc(sizeof(int64_t) * (X->E + 1));
  *order = malloc(sizeof(int) * (X->E + 1));
  if (!*start || !*order) return -1;
  int64_t row = 0;
  for (int e = 0; e < X->E; e++) {
    (*start)[e] = row;
    row += X->counts[e];
    int j = e;
    for (; j > 0 && X->counts[(*order)[j - 1]] < X->counts[e]; j--) (*order)[j] = (*order)[j - 1];
    (*order)[j] = e;
  }
  X->start = *start, X->order = *order;
  return 0;
}

static int run_experts(Experts* X, task_fn task, size_t buf_floats, int nthreads) {
  int64_t* start = NULL;
  int* order = NULL;
  int rc = plan_experts(X, &start, &order) ? -1 : run_tasks(X, task, X->E, buf_floats, nthreads);
  free(start);
  free(order);
  return rc;
}

int experts_fwd(int E, int D, int I, int RB, const int64_t* counts, const float* x, const float* w13,
                const float* w2, float* h, float* y, int nthreads) {
  Experts X = {.E = E, .D = D, .I = I, .RB = RB, .counts = counts, .x = x, .w13 = w13, .w2 = w2, .h = h, .y = y};
  return run_experts(&X, experts_fwd_task, (size_t)RB * (h ? I : 3 * I), nthreads);
}

int experts_bwd(int E, int D, int I, int RB, const int64_t* counts, const float* x, const float* w13,
                const float* w2, const float* h, const float* dy, float* dx, float* dw13, float* dw2, int nthreads) {
  Experts X = {.E = E, .D = D, .I = I, .RB = RB, .counts = counts, .x = x, .w13 = w13, .w2 = w2, .h_saved = h,
               .dy = dy, .dx = dx, .dw13 = dw13, .dw2 = dw2};
  return run_experts(&X, experts_bwd_task, (size_t)RB * 4 * I, nthreads);
}

/* ---------------------------------------------------------------- combine */

typedef struct {
  int N, K, D, tokens_per_task;
  const float *out, *w, *dy;
  const int64_t* inverse; /* (token, k) pair n*K + k -> its row of out */
  float *y, *dout, *dw;
} Combine;

/* y[n] = sum_k w[n, k] out[inverse[n K + k]], for a task's tokens. */
static void combine_fwd_task(const void* job, int t, float* buf) {
  const Combine* c = job;
  (void)buf;
  int D = c->D, K = c->K;
  for (int n = t * c->tokens_per_task, end = MIN(c->N, n + c->tokens_per_task); n < end; n++) {
    float* y = c->y + (size_t)n * D;
    const float* o = c->out + c->inverse[(size_t)n * K] * D;
    float w = c->w[(size_t)n * K];
    for (int x = 0; x < D; x++) y[x] = w * o[x];
    for (int k = 1; k < K; k++) {
      o = c->out + c->inverse[(size_t)n * K + k] * D, w = c->w[(size_t)n * K + k];
      for (int x = 0; x < D; x++) y[x] += w * o[x];
    }
  }
}

/* dout[inverse[n K + k]] = w[n, k] dy[n] (each row written once: inverse is a permutation),
   dw[n, k] = <dy[n], out[inverse[n K + k]]>. */
static void combine_bwd_task(const void* job, int t, float* buf) {
  const Combine* c = job;
  (void)buf;
  int D = c->D, K = c->K;
  for (int n = t * c->tokens_per_task, end = MIN(c->N, n + c->tokens_per_task); n < end; n++) {
    const float* dy = c->dy + (size_t)n * D;
    for (int k = 0; k < K; k++) {
      int64_t r = c->inverse[(size_t)n * K + k];
      const float* o = c->out + r * D;
      float w = c->w[(size_t)n * K + k], dot = 0.f, *d = c->dout + r * D;
      for (int x = 0; x < D; x++) {
        d[x] = w * dy[x];
        dot += dy[x] * o[x];
      }
      c->dw[(size_t)n * K + k] = dot;
    }
  }
}

enum { COMBINE_TOKENS_PER_TASK = 256 };

int combine_fwd(int N, int K, int D, const float* out, const int64_t* inverse, const float* w, float* y, int nthreads) {
  Combine c = {.N = N, .K = K, .D = D, .tokens_per_task = COMBINE_TOKENS_PER_TASK, .out = out, .w = w,
               .inverse = inverse, .y = y};
  return run_tasks(&c, combine_fwd_task, (N + COMBINE_TOKENS_PER_TASK - 1) / COMBINE_TOKENS_PER_TASK, 0, nthreads);
}

int combine_bwd(int N, int K, int D, const float* dy, const float* out, const int64_t* inverse, const float* w,
                float* dout, float* dw, int nthreads) {
  Combine c = {.N = N, .K = K, .D = D, .tokens_per_task = COMBINE_TOKENS_PER_TASK, .out = out, .w = w, .dy = dy,
               .inverse = inverse, .dout = dout, .dw = dw};
  return run_tasks(&c, combine_bwd_task, (N + COMBINE_TOKENS_PER_TASK - 1) / COMBINE_TOKENS_PER_TASK, 0, nthreads);
}
