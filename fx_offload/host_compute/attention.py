"""Decode attention over a KV cache in host memory, computed by the host's cores where the
cache lives (``kv_cache="host"`` with ``host_compute``): a small C kernel compiled on first
use for this CPU and called through ``ctypes``, as :mod:`.native` is.

The keys and values are read once, in place, each row widened from bf16/fp16 to fp32 in
registers; scores, the softmax and the weighted sum of values accumulate in fp32.  The
work is cut into (sequence, KV head, chunk of tokens) pieces, so that one decode step's
few heads share every core: each piece keeps, for every query row that reads its KV head
(the ``n_rep`` query heads of grouped-query attention times the query's tokens), the
running maximum, the sum of weights and the weighted values of its chunk (the online
softmax), and a last pass merges the chunks of each row::

    for each piece (b, kv head h, tokens [t0, t1)):   rows r = the query heads of h x tokens
        s[r, t] = scale * q[r] . K[b, h, t] + bias[r, t]     (t masked out: skipped)
        m[r] = max s;  l[r] = sum exp(s - m);  a[r] = sum exp(s - m) V[b, h, t]
    out[r] = sum_c exp(m_c - M) a_c / sum_c exp(m_c - M) l_c,   M = max_c m_c

A row whose every token is masked out gives zeros (torch's kernels differ among themselves
there).  The exponential is a polynomial of our own (relative error under 2e-7), so that
the loop over a block of tokens vectorizes.  Built without ``-ffast-math``: masked scores
are infinite, which that flag would let the compiler assume away.  Why and how it is used:
docs/host_compute.md, "Attention over the host KV cache".
"""
from __future__ import annotations

import ctypes
import math
import threading

import torch

from . import native

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* one register of fp32: 16 lanes with AVX-512, else 8 */
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
#define BT 32           /* tokens per block: their widened rows and scores stay in L1 */
#define MAXR 64         /* query rows per KV head at most (the caller checks) */
#define MAXD 256        /* head dimension at most, padded (the caller checks) */

static inline vf ld(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, vf v) { memcpy(p, &v, sizeof v); }
static inline float hsum(vf v) { float s = 0.0f; for (int i = 0; i < VL; i++) s += v[i];
                                 return s; }

/* exp(x) for x <= 0: 2^n e^f, n = round(x log2 e), |f| <= ln2 / 2; under -87: 0 */
static inline float exp_neg(float x) {
    float under = x < -87.0f ? 0.0f : 1.0f;
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    float f = x - n * 0.693145752f - n * 1.42860677e-06f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666672f + f * (0.0416666418f
              + f * (0.00833336823f + f * 0.00138833765f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two; memcpy(&two, &bits, 4);
    return p * two * under;
}

/* n rows of D elements (bf16, fp16 or fp32) as fp32 rows of P >= D, zero-padded */
static void widen(int wt, const char* src, int64_t n, int64_t D, int64_t P, float* dst) {
    for (int64_t t = 0; t < n; t++) {
        float* o = dst + t * P;
        if (wt == 0) {
            const uint16_t* p = (const uint16_t*)src + t * D;
            uint32_t* u = (uint32_t*)o;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) u[d] = (uint32_t)p[d] << 16;
        } else if (wt == 1) {
            const _Float16* p = (const _Float16*)src + t * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] = (float)p[d];
        } else memcpy(o, src + t * D * 4, sizeof(float) * D);
        for (int64_t d = D; d < P; d++) o[d] = 0.0f;
    }
}

/* s[r, t] = q[r] . k[t] for n widened rows: eight tokens at once, eight chains of FMAs */
static void scores(const float* kf, int64_t n, int64_t P, const float* qs, int64_t R,
                   float* s) {
    for (int64_t r = 0; r < R; r++) {
        const float* qr = qs + r * P;
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
            const float* k = kf + t * P;
            for (int64_t d = 0; d < P; d += VL) {
                vf q = ld(qr + d);
                a0 += q * ld(k + d);         a1 += q * ld(k + P + d);
                a2 += q * ld(k + 2 * P + d); a3 += q * ld(k + 3 * P + d);
                a4 += q * ld(k + 4 * P + d); a5 += q * ld(k + 5 * P + d);
                a6 += q * ld(k + 6 * P + d); a7 += q * ld(k + 7 * P + d);
            }
            float* o = s + r * BT + t;
            o[0] = hsum(a0); o[1] = hsum(a1); o[2] = hsum(a2); o[3] = hsum(a3);
            o[4] = hsum(a4); o[5] = hsum(a5); o[6] = hsum(a6); o[7] = hsum(a7);
        }
        for (; t < n; t++) {
            vf a = {0};
            for (int64_t d = 0; d < P; d += VL) a += ld(qr + d) * ld(kf + t * P + d);
            s[r * BT + t] = hsum(a);
        }
    }
}

/* a[r] += sum_t p[r, t] v[t]: eight registers of a row held across the block's tokens */
static void accumulate(const float* vfb, int64_t n, int64_t P, const float* s, int64_t R,
                       float* a) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < P; d += 8 * VL) {
            float* ar = a + r * P + d;
            vf c0 = ld(ar), c1 = ld(ar + VL), c2 = ld(ar + 2 * VL), c3 = ld(ar + 3 * VL),
               c4 = ld(ar + 4 * VL), c5 = ld(ar + 5 * VL), c6 = ld(ar + 6 * VL),
               c7 = ld(ar + 7 * VL);
            for (int64_t t = 0; t < n; t++) {
                float p = s[r * BT + t];
                const float* v = vfb + t * P + d;
                c0 += p * ld(v);          c1 += p * ld(v + VL);
                c2 += p * ld(v + 2 * VL); c3 += p * ld(v + 3 * VL);
                c4 += p * ld(v + 4 * VL); c5 += p * ld(v + 5 * VL);
                c6 += p * ld(v + 6 * VL); c7 += p * ld(v + 7 * VL);
            }
            st(ar, c0); st(ar + VL, c1); st(ar + 2 * VL, c2); st(ar + 3 * VL, c3);
            st(ar + 4 * VL, c4); st(ar + 5 * VL, c5); st(ar + 6 * VL, c6);
            st(ar + 7 * VL, c7);
        }
}

/* one piece: rows R of one (sequence, kv head) over tokens [t0, t1); k, v at the row's
   token 0; qs: R query rows padded to PK; writes m, l and a (R rows padded to PV) */
static void piece(int wt, const char* k, const char* v, int64_t D, int64_t DV, int64_t PK,
                  int64_t PV, const float* qs, const float* bias, const int64_t* bias_row,
                  float scale, int64_t R, int64_t t0, int64_t t1, float* m, float* l,
                  float* a) {
    float buf[BT * MAXD], s[MAXR * BT];
    int64_t es = wt == 2 ? 4 : 2;
    for (int64_t r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(a, 0, sizeof(float) * R * PV);
    for (int64_t b0 = t0; b0 < t1; b0 += BT) {
        int64_t n = t1 - b0 < BT ? t1 - b0 : BT;
        /* the next block's rows asked of the memory now: they arrive while this one is
           computed (one core alone reads no faster than it waits) */
        int64_t ahead = t1 - b0 - n < BT ? t1 - b0 - n : BT;
        for (int64_t o = 0; o < ahead * D * es; o += 64)
            __builtin_prefetch(k + (b0 + n) * D * es + o);
        for (int64_t o = 0; o < ahead * DV * es; o += 64)
            __builtin_prefetch(v + (b0 + n) * DV * es + o);
        widen(wt, k + b0 * D * es, n, D, PK, buf);
        scores(buf, n, PK, qs, R, s);
        for (int64_t r = 0; r < R; r++) {
            float* sr = s + r * BT;
            const float* br = bias ? bias + bias_row[r] + b0 : 0;
            float top = m[r];
            for (int64_t t = 0; t < n; t++) {
                float x = sr[t] * scale + (br ? br[t] : 0.0f);
                sr[t] = x;
                top = x > top ? x : top;
            }
            if (top == -INFINITY) { for (int64_t t = 0; t < n; t++) sr[t] = 0.0f; continue; }
            float keep = m[r] == -INFINITY ? 0.0f : exp_neg(m[r] - top), sum = 0.0f;
            #pragma omp simd reduction(+:sum)
            for (int64_t t = 0; t < n; t++) {
                float p = exp_neg(sr[t] - top);     /* -inf: 0 */
                sr[t] = p;
                sum += p;
            }
            l[r] = l[r] * keep + sum;
            m[r] = top;
            if (keep != 1.0f)
                for (int64_t d = 0; d < PV; d++) a[r * PV + d] *= keep;
        }
        widen(wt, v + b0 * DV * es, n, DV, PV, buf);
        accumulate(buf, n, PV, s, R, a);
    }
}

/* k, v: [B, KVH, T, D] / [B, KVH, T, DV], read up to token L; q: [B, KVH * rep, NQ, D]
   fp32; bias: NULL or fp32 [B, HB, NQ, TB] (HB 1 or KVH * rep); out: [B, KVH * rep, NQ, DV]
   fp32; scratch: B * KVH * chunks * R * (PV + 2) floats, R = rep * NQ */
void fx_attend(int wt, const char* k, const char* v, int64_t B, int64_t KVH, int64_t T,
               int64_t D, int64_t DV, int64_t L, const float* q, int64_t rep, int64_t NQ,
               const float* bias, int64_t HB, int64_t TB, float scale, float* out,
               float* scratch, int64_t chunks, int threads) {
    int64_t R = rep * NQ, per = (L + chunks - 1) / chunks, es = wt == 2 ? 4 : 2;
    int64_t PK = (D + VL - 1) / VL * VL, PV = (DV + 8 * VL - 1) / (8 * VL) * (8 * VL);
    int64_t pieces = B * KVH * chunks, part = R * (PV + 2);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < pieces; i++) {
        int64_t c = i % chunks, h = (i / chunks) % KVH, b = i / chunks / KVH;
        int64_t t0 = c * per, t1 = t0 + per < L ? t0 + per : L;
        float* m = scratch + i * part;
        float* l = m + R;
        float* a = l + R;
        float qs[MAXR * MAXD];
        int64_t bias_row[MAXR];
        for (int64_t j = 0; j < rep; j++)
            for (int64_t n = 0; n < NQ; n++) {
                int64_t head = h * rep + j, r = j * NQ + n;
                memcpy(qs + r * PK, q + ((b * KVH * rep + head) * NQ + n) * D,
                       sizeof(float) * D);
                for (int64_t d = D; d < PK; d++) qs[r * PK + d] = 0.0f;
                bias_row[r] = ((b * HB + (HB == 1 ? 0 : head)) * NQ + n) * TB;
            }
        if (t0 >= t1) { for (int64_t r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
                        continue; }
        int64_t base = (b * KVH + h) * T;
        piece(wt, k + base * D * es, v + base * DV * es, D, DV, PK, PV, qs, bias, bias_row,
              scale, R, t0, t1, m, l, a);
    }
    #pragma omp parallel for num_threads(threads)
    for (int64_t i = 0; i < B * KVH * R; i++) {
        int64_t r = i % R, bh = i / R, j = r / NQ, n = r % NQ, h = bh % KVH, b = bh / KVH;
        float top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            float mc = scratch[(bh * chunks + c) * part + r];
            top = mc > top ? mc : top;
        }
        float* o = out + ((b * KVH * rep + h * rep + j) * NQ + n) * DV;
        memset(o, 0, sizeof(float) * DV);
        if (top == -INFINITY) continue;
        for (int64_t c = 0; c < chunks; c++) {
            const float* p = scratch + (bh * chunks + c) * part;
            if (p[r] == -INFINITY) continue;
            float w = exp_neg(p[r] - top);
            total += w * p[R + r];
            const float* a = p + 2 * R + r * PV;
            for (int64_t d = 0; d < DV; d++) o[d] += w * a[d];
        }
        for (int64_t d = 0; d < DV; d++) o[d] /= total;
    }
}
"""
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-strict-aliasing", "-Wno-psabi",
         "-fopenmp", "-fPIC", "-shared"]
MAX_ROWS = 64           # query rows per KV head (MAXR of the source)
MAX_DIM = 256           # head dimension (the source's row buffers)
CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

_lock = threading.Lock()
_state: list = []


def library():
    """The compiled kernel, or ``None`` where it cannot be built (no C compiler)."""
    if not _state:
        with _lock:
            if not _state:
                lib = native.build(SOURCE, FLAGS, "attention")
                if lib is not None:
                    i64, ptr = ctypes.c_int64, ctypes.c_void_p
                    lib.fx_attend.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, i64, i64,
                                              i64, ptr, i64, i64, ptr, i64, i64,
                                              ctypes.c_float, ptr, ptr, i64, ctypes.c_int]
                _state.append(lib)
    return _state[0]


def unsupported(q_shape, k_shape, v_shape, dtype: torch.dtype, rows: bool = True) -> str | None:
    """Why the kernel cannot take these shapes (``q [B, H, NQ, D]``, keys ``[B, KVH, T, D]``,
    values ``[B, KVH, T, DV]``), else None; ``rows``: check the query rows per KV head too."""
    (b, h, nq, d), (kb, kvh, _, kd), dv = q_shape, k_shape, v_shape[-1]
    if dtype not in CODES:
        return f"its cache is {dtype}, the host kernel reads bf16, fp16 and fp32"
    if kb != b or kd != d or v_shape[:3] != k_shape[:3] or h % kvh:
        return "its query, keys and values do not line up as grouped-query attention"
    if d > MAX_DIM or dv > MAX_DIM:
        return f"its heads are wider than {MAX_DIM}"
    if rows and h // kvh * nq > MAX_ROWS:
        return (f"{h // kvh * nq} query rows read each KV head (at most {MAX_ROWS} on the "
                "host)")
    return None


def chunks_for(pieces: int, tokens: int, threads: int) -> int:
    """Chunks per (sequence, KV head): four pieces per thread, none under 256 tokens."""
    want = max(1, -(-4 * threads // max(pieces, 1)))
    return max(1, min(want, tokens // 256 or 1))


def attend(lib, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tokens: int,
           bias: torch.Tensor | None, scale: float, out: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """``softmax(scale q K^T + bias) V`` over the first ``tokens`` of host ``keys``/``values``
    (contiguous ``[B, KVH, T, D]``), the query heads grouped over the KV heads as
    ``repeat_kv`` does; ``q`` fp32 contiguous ``[B, H, NQ, D]``; ``bias`` fp32 contiguous
    ``[B, 1 or H, NQ, T]`` (``-inf``: masked out) or None.  fp32 ``[B, H, NQ, DV]``."""
    (b, h, nq, d), kvh, t, dv = q.shape, keys.shape[1], keys.shape[2], values.shape[-1]
    threads = threads or torch.get_num_threads()
    out = torch.empty(b, h, nq, dv) if out is None else out
    rep, tokens = h // kvh, min(int(tokens), t)
    chunks = chunks_for(b * kvh, tokens, threads)
    padded = -(-dv // 128) * 128           # the source's PV, for 8 registers of 16 lanes
    scratch = torch.empty(b * kvh * chunks * rep * nq * (padded + 2))
    lib.fx_attend(CODES[keys.dtype], keys.data_ptr(), values.data_ptr(), b, kvh, t, d, dv,
                  tokens, q.data_ptr(), rep, nq, None if bias is None else bias.data_ptr(),
                  0 if bias is None else bias.shape[1], 0 if bias is None else bias.shape[-1],
                  float(scale if scale is not None else 1 / math.sqrt(d)), out.data_ptr(),
                  scratch.data_ptr(), chunks, threads)
    return out
