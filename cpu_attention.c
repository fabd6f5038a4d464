/* Causal grouped-query attention for CPU training, forward and backward, fp32.

   What it is for: torch 2.13's CPU flash kernel walks keys in blocks of 512 and computes a
   block whole even where the causal mask removes it, so at T <= 512 causal attention costs
   what full attention does. This kernel stops every query block at its own causal frontier:
   query block i (BQ rows) meets keys [0, (i+1) BQ) only, so it computes about half the
   scores plus half a diagonal block (0.53 of T^2 at BQ = 32, T = 512; torch computes 1.0).

   The algorithm is FlashAttention-2's (arXiv 2307.08691, alg. 1 and 2): the forward keeps a
   running max and sum over key chunks of KB (online softmax) and saves the log-sum-exp of
   every row; the backward recomputes P = exp(S - lse) chunk by chunk, with
   dS = P * (dP - rowsum(dO * O)). The block products go to the BLAS `sgemm_` that torch
   itself links (MKL on x86-64 wheels), passed in by `attn_init`, each worker thread set
   to one BLAS thread so the workers do not oversubscribe the cores.

   Notable choices: the R = H/G query heads that share a key/value head are stacked into one
   block of R * BQ rows, so K and V are read once per group and the products are R times
   taller; forward tasks are (batch, kv head, query block), longest first, handed out by an
   atomic counter; backward tasks are (batch, kv head), each owning its dK and dV (no
   atomics). Workers are fresh pthreads per call (about 30 us), so the caller's BLAS and
   OpenMP state is never touched. Compiled with -ffast-math: every score is finite
   (masked entries are skipped, never set to -inf), and the vectorised expf needs it.

   Layout: q, out, dO, dq are [B, H, T, d] and k, v, dk, dv are [B, G, T, d], each with any
   strides for the first three dims (in elements) and d contiguous; lse is [B, H, T] fp32,
   contiguous. Shape legend: B batch, H query heads, G kv heads, R = H / G, T tokens,
   d head dim, M = R * rows stacked query rows of a block, N keys in a chunk. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);
typedef int (*local_threads_fn)(const int*);
static sgemm_fn sgemm;
static local_threads_fn blas_set_local_threads; /* mkl_set_num_threads_local (Fortran ABI: int*) */

void attn_init(void* sgemm_ptr, void* local_threads_ptr) {
  sgemm = (sgemm_fn)sgemm_ptr;
  blas_set_local_threads = (local_threads_fn)local_threads_ptr;
}

/* Row-major C[M,N] = alpha op(A) op(B) + beta C through the column-major BLAS: C^T = op(B)^T op(A)^T. */
static void mm(int ta, int tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
               float beta, float* C, int ldc) {
  char ca = tb ? 'T' : 'N', cb = ta ? 'T' : 'N';
  sgemm(&ca, &cb, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

typedef struct {
  int B, H, G, T, d, BQ, KB, blas_threads, ntasks, next; /* next: the atomic task counter */
  float scale;
  const float *q, *k, *v, *o, *lse, *go;
  float *out, *lse_out, *dq, *dk, *dv;
  int64_t sq[3], sk[3], sv[3], so[3], sgo[3], sdq[3], sdk[3], sdv[3]; /* strides of dims 0-2 */
} Job;

#define ROW(p, s, b, h, t) ((p) + (b) * (s)[0] + (h) * (s)[1] + (t) * (s)[2])
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Forward task t: kv head g of batch row b, query block i, its R heads stacked. */
static void fwd_task(Job* a, int t, float* buf) {
  int R = a->H / a->G, d = a->d, nq = (a->T + a->BQ - 1) / a->BQ;
  int i = nq - 1 - t / (a->B * a->G), b = t % (a->B * a->G) / a->G, g = t % a->G; /* longest first */
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
static void bwd_task(Job* a, int t, float* buf) {
  int R = a->H / a->G, d = a->d, T = a->T, b = t / a->G, g = t % a->G, Mmax = R * a->BQ;
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

typedef struct {
  Job* job;
  int backward;
} Worker;

static void* work(void* arg) {
  Worker* w = (Worker*)arg;
  Job* a = w->job;
  blas_set_local_threads(&a->blas_threads);
  size_t M = (size_t)(a->H / a->G) * a->BQ;
  float* buf = malloc(sizeof(float) * M * (w->backward ? 3 * a->d + 2 * a->KB + 2 : 2 * a->d + a->KB + 2));
  if (!buf) return NULL; /* the other workers take this one's share */
  for (int t; (t = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED)) < a->ntasks;)
    (w->backward ? bwd_task : fwd_task)(a, t, buf);
  free(buf);
  return NULL;
}

/* Runs the job's tasks on min(nthreads, tasks) fresh threads (fewer tasks: more BLAS threads each).
   Returns 0, or -1 when no thread could start or allocate its buffer (then the outputs are incomplete). */
static int run(Job* a, int backward, int nthreads) {
  enum { MAX_THREADS = 256 };
  pthread_t threads[MAX_THREADS];
  int n = MIN(MIN(nthreads, a->ntasks), MAX_THREADS), started = 0;
  if (a->ntasks <= 0) return 0;
  if (n < 1) n = 1;
  a->blas_threads = nthreads > n ? nthreads / n : 1;
  a->next = 0;
  Worker w = {a, backward};
  while (started < n && pthread_create(&threads[started], NULL, work, &w) == 0) started++;
  for (int i = 0; i < started; i++) pthread_join(threads[i], NULL);
  return a->next >= a->ntasks ? 0 : -1;
}

#define SHAPE_ARGS int B, int H, int G, int T, int d, int BQ, int KB, float scale, int nthreads
#define SET_SHAPE(a) \
  (a).B = B, (a).H = H, (a).G = G, (a).T = T, (a).d = d, (a).BQ = BQ, (a).KB = KB, (a).scale = scale

int attn_fwd(SHAPE_ARGS, const float* q, const int64_t* sq, const float* k, const int64_t* sk, const float* v,
             const int64_t* sv, float* out, const int64_t* so, float* lse) {
  Job a = {0};
  SET_SHAPE(a);
  a.q = q, a.k = k, a.v = v, a.out = out, a.lse_out = lse;
  memcpy(a.sq, sq, sizeof a.sq), memcpy(a.sk, sk, sizeof a.sk), memcpy(a.sv, sv, sizeof a.sv);
  memcpy(a.so, so, sizeof a.so);
  a.ntasks = B * G * ((T + BQ - 1) / BQ);
  return run(&a, 0, nthreads);
}

int attn_bwd(SHAPE_ARGS, const float* go, const int64_t* sgo, const float* q, const int64_t* sq, const float* k,
             const int64_t* sk, const float* v, const int64_t* sv, const float* o, const int64_t* so, const float* lse,
             float* dq, const int64_t* sdq, float* dk, const int64_t* sdk, float* dv, const int64_t* sdv) {
  Job a = {0};
  SET_SHAPE(a);
  a.go = go, a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse, a.dq = dq, a.dk = dk, a.dv = dv;
  memcpy(a.sgo, sgo, sizeof a.sgo), memcpy(a.sq, sq, sizeof a.sq), memcpy(a.sk, sk, sizeof a.sk);
  memcpy(a.sv, sv, sizeof a.sv), memcpy(a.so, so, sizeof a.so), memcpy(a.sdq, sdq, sizeof a.sdq);
  memcpy(a.sdk, sdk, sizeof a.sdk), memcpy(a.sdv, sdv, sizeof a.sdv);
  a.ntasks = B * G;
  return run(&a, 1, nthreads);
}
