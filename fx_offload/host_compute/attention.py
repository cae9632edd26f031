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
import logging
import math
import statistics
import threading
import time

import torch

from . import native

log = logging.getLogger("fx_offload")

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* one register of fp32: 16 lanes with AVX-512, else 8 */
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
#define BT 32           /* tokens per block: their widened rows and scores stay in L1 */
#define MAXR 64         /* query rows per KV head at most (the caller checks) */
#define MAXD 256        /* head dimension at most, padded (the caller checks) */
#ifndef STRIDE
#define STRIDE 4096     /* each row widened asks the memory for the bytes this far on */
#endif

static inline vf ld(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, vf v) { memcpy(p, &v, sizeof v); }
static inline float hsum(vf v) { float s = 0.0f; for (int i = 0; i < VL; i++) s += v[i];
                                 return s; }

/* the lane sums of eight registers into o[0..7]: a tree of shuffles, each step halving the
   lanes per register (a lane-by-lane sum of each costs several times more) */
#if VL == 16
static inline vf pairs(vf x, vf y, vi lo, vi hi) {
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi); }
static inline void hsum8(vf a0, vf a1, vf a2, vf a3, vf a4, vf a5, vf a6, vf a7, float* o) {
    const vi l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi h1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi l2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi h2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi l3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi h3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi l4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi h4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf w0 = pairs(pairs(a0, a1, l1, h1), pairs(a2, a3, l1, h1), l2, h2);
    vf w1 = pairs(pairs(a4, a5, l1, h1), pairs(a6, a7, l1, h1), l2, h2);
    vf u = pairs(w0, w1, l3, h3);
    vf f = pairs(u, u, l4, h4);
    memcpy(o, &f, 8 * sizeof(float));
}
#else
static inline vf pairs(vf x, vf y, vi lo, vi hi) {
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi); }
static inline void hsum8(vf a0, vf a1, vf a2, vf a3, vf a4, vf a5, vf a6, vf a7, float* o) {
    const vi l1 = {0, 1, 2, 3, 8, 9, 10, 11}, h1 = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi l2 = {0, 1, 4, 5, 8, 9, 12, 13}, h2 = {2, 3, 6, 7, 10, 11, 14, 15};
    const vi l3 = {0, 2, 4, 6, 8, 10, 12, 14}, h3 = {1, 3, 5, 7, 9, 11, 13, 15};
    vf w0 = pairs(pairs(a0, a1, l1, h1), pairs(a2, a3, l1, h1), l2, h2);
    vf w1 = pairs(pairs(a4, a5, l1, h1), pairs(a6, a7, l1, h1), l2, h2);
    vf f = pairs(w0, w1, l3, h3);
    memcpy(o, &f, 8 * sizeof(float));
}
#endif

/* exp(x) for x <= 0, VL at once: 2^n e^f, n = round(x log2 e), |f| <= ln2 / 2; under
   -87 (and -inf): 0 */
static inline vf exp_neg(vf x) {
    const vf lim = (vf){0} - 87.0f;
    vi under = x < lim;
    x = (vf)(((vi)x & ~under) | ((vi)lim & under));
    vi ni = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);    /* x <= 0: truncation */
    vf n = __builtin_convertvector(ni, vf);
    vf f = x - n * 0.693145752f - n * 1.42860677e-06f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666672f + f * (0.0416666418f
              + f * (0.00833336823f + f * 0.00138833765f)))));
    vi bits = (ni + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~under);
}

static inline float exp1(float x) { vf v = {0}; v[0] = x; return exp_neg(v)[0]; }

/* n rows of D elements (bf16, fp16 or fp32) as fp32 rows of P >= D, zero-padded */
static void widen(int wt, const char* src, int64_t n, int64_t D, int64_t P, float* dst) {
    for (int64_t t = 0; t < n; t++) {
        float* o = dst + t * P;
        /* one core alone reads no faster than it waits: ask for the rows STRIDE bytes
           on as each is widened, as the experts kernel does (a block at once was slower) */
        int64_t row = (wt == 2 ? 4 : 2) * D;
        for (int64_t b = 0; b < row; b += 64)
            __builtin_prefetch(src + t * row + b + STRIDE);
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
    int64_t r = 0;
#if VL == 16
    /* two rows at once where 32 registers allow: each row of K loaded once for both */
    for (; r + 2 <= R; r += 2) {
        const float* qa = qs + r * P;
        const float* qb = qa + P;
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
            vf b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0}, b5 = {0}, b6 = {0}, b7 = {0};
            const float* k = kf + t * P;
            for (int64_t d = 0; d < P; d += VL) {
                vf x = ld(qa + d), y = ld(qb + d), kk;
                kk = ld(k + d);         a0 += x * kk; b0 += y * kk;
                kk = ld(k + P + d);     a1 += x * kk; b1 += y * kk;
                kk = ld(k + 2 * P + d); a2 += x * kk; b2 += y * kk;
                kk = ld(k + 3 * P + d); a3 += x * kk; b3 += y * kk;
                kk = ld(k + 4 * P + d); a4 += x * kk; b4 += y * kk;
                kk = ld(k + 5 * P + d); a5 += x * kk; b5 += y * kk;
                kk = ld(k + 6 * P + d); a6 += x * kk; b6 += y * kk;
                kk = ld(k + 7 * P + d); a7 += x * kk; b7 += y * kk;
            }
            hsum8(a0, a1, a2, a3, a4, a5, a6, a7, s + r * BT + t);
            hsum8(b0, b1, b2, b3, b4, b5, b6, b7, s + (r + 1) * BT + t);
        }
        for (; t < n; t++) {
            vf a = {0}, b = {0};
            for (int64_t d = 0; d < P; d += VL) {
                vf kk = ld(kf + t * P + d);
                a += ld(qa + d) * kk; b += ld(qb + d) * kk;
            }
            s[r * BT + t] = hsum(a);
            s[(r + 1) * BT + t] = hsum(b);
        }
    }
#endif
    for (; r < R; r++) {
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
            hsum8(a0, a1, a2, a3, a4, a5, a6, a7, s + r * BT + t);
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
    int64_t r = 0;
#if VL == 16
    /* two rows at once: each row of V loaded once for both */
    for (; r + 2 <= R; r += 2)
        for (int64_t d = 0; d < P; d += 8 * VL) {
            float* ar = a + r * P + d;
            float* br = ar + P;
            vf c0 = ld(ar), c1 = ld(ar + VL), c2 = ld(ar + 2 * VL), c3 = ld(ar + 3 * VL),
               c4 = ld(ar + 4 * VL), c5 = ld(ar + 5 * VL), c6 = ld(ar + 6 * VL),
               c7 = ld(ar + 7 * VL);
            vf e0 = ld(br), e1 = ld(br + VL), e2 = ld(br + 2 * VL), e3 = ld(br + 3 * VL),
               e4 = ld(br + 4 * VL), e5 = ld(br + 5 * VL), e6 = ld(br + 6 * VL),
               e7 = ld(br + 7 * VL);
            for (int64_t t = 0; t < n; t++) {
                float p = s[r * BT + t], q = s[(r + 1) * BT + t];
                const float* v = vfb + t * P + d;
                vf x;
                x = ld(v);          c0 += p * x; e0 += q * x;
                x = ld(v + VL);     c1 += p * x; e1 += q * x;
                x = ld(v + 2 * VL); c2 += p * x; e2 += q * x;
                x = ld(v + 3 * VL); c3 += p * x; e3 += q * x;
                x = ld(v + 4 * VL); c4 += p * x; e4 += q * x;
                x = ld(v + 5 * VL); c5 += p * x; e5 += q * x;
                x = ld(v + 6 * VL); c6 += p * x; e6 += q * x;
                x = ld(v + 7 * VL); c7 += p * x; e7 += q * x;
            }
            st(ar, c0); st(ar + VL, c1); st(ar + 2 * VL, c2); st(ar + 3 * VL, c3);
            st(ar + 4 * VL, c4); st(ar + 5 * VL, c5); st(ar + 6 * VL, c6);
            st(ar + 7 * VL, c7);
            st(br, e0); st(br + VL, e1); st(br + 2 * VL, e2); st(br + 3 * VL, e3);
            st(br + 4 * VL, e4); st(br + 5 * VL, e5); st(br + 6 * VL, e6);
            st(br + 7 * VL, e7);
        }
#endif
    for (; r < R; r++)
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
        widen(wt, k + b0 * D * es, n, D, PK, buf);
        scores(buf, n, PK, qs, R, s);
        for (int64_t r = 0; r < R; r++) {
            float* sr = s + r * BT;
            const float* br = bias ? bias + bias_row[r] + b0 : 0;
            float top = m[r];
            int64_t t = 0;
            vf tops = (vf){0} + top;
            for (; t + VL <= n; t += VL) {
                vf x = ld(sr + t) * scale;
                if (br) x += ld(br + t);
                st(sr + t, x);
                vi more = x > tops;
                tops = (vf)(((vi)x & more) | ((vi)tops & ~more));
            }
            for (int i = 0; i < VL; i++) top = tops[i] > top ? tops[i] : top;
            for (; t < n; t++) {
                float x = sr[t] * scale + (br ? br[t] : 0.0f);
                sr[t] = x;
                top = x > top ? x : top;
            }
            for (; t < BT; t++) sr[t] = -INFINITY;      /* past the block: weight 0 */
            if (top == -INFINITY) { for (t = 0; t < BT; t++) sr[t] = 0.0f; continue; }
            float keep = m[r] == -INFINITY ? 0.0f : exp1(m[r] - top);
            vf sums = {0};
            for (t = 0; t < BT; t += VL) {
                vf p = exp_neg(ld(sr + t) - top);      /* -inf: 0 */
                st(sr + t, p);
                sums += p;
            }
            l[r] = l[r] * keep + hsum(sums);
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
            float w = exp1(p[r] - top);
            total += w * p[R + r];
            const float* a = p + 2 * R + r * PV;
            for (int64_t d = 0; d < DV; d++) o[d] += w * a[d];
        }
        for (int64_t d = 0; d < DV; d++) o[d] /= total;
    }
}

/* One layer's attention as a job a CUDA stream runs (cuLaunchHostFunc), its valid tokens
   read when it runs: one past the largest position written (index), or the whole cache
   where there is no bias or the bias lets a row read further.  chunks: what the scratch
   holds at most.  It leaves record[0] the tokens read, record[1] and record[2] the
   monotonic clock (ns) at its start and end, and done = 1. */
typedef struct {
    int32_t wt, threads, done, hb;
    const char *k, *v;
    int64_t B, KVH, T, D, DV, rep, NQ, TB, n_index, chunks;
    const float *q, *bias;
    const int64_t* index;
    float scale, unused;
    float *out, *scratch;
    int64_t* record;
} fx_attend_job;

""" + native.NOW_NS + r"""
void fx_attend_run(void* arg) {
    fx_attend_job* j = (fx_attend_job*)arg;
    int64_t began = now_ns(), L = 0;
    for (int64_t i = 0; i < j->n_index; i++) if (j->index[i] + 1 > L) L = j->index[i] + 1;
    if (L > j->T) L = j->T;
    if (!j->bias) L = j->T;
    for (int64_t r = 0; j->bias && L < j->T && r < j->B * j->hb * j->NQ; r++)
        for (int64_t t = L; t < j->TB; t++)
            if (j->bias[r * j->TB + t] != -INFINITY) { L = j->T; break; }
    int64_t pieces = j->B * j->KVH, chunks = (4 * j->threads + pieces - 1) / pieces;
    int64_t most = L / 256 > 1 ? L / 256 : 1;
    chunks = chunks < most ? chunks : most;
    chunks = chunks < j->chunks ? chunks : j->chunks;
    fx_attend(j->wt, j->k, j->v, j->B, j->KVH, j->T, j->D, j->DV, L, j->q, j->rep, j->NQ,
              j->bias, j->hb, j->TB, j->scale, j->out, j->scratch, chunks > 0 ? chunks : 1,
              j->threads);
    j->record[0] = L;
    j->record[1] = began;
    j->record[2] = now_ns();
    __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
}
"""
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-strict-aliasing", "-Wno-psabi",
         "-fopenmp", "-fPIC", "-shared"]
MAX_ROWS = 64           # query rows per KV head (MAXR of the source)
MAX_DIM = 256           # head dimension (the source's row buffers)
CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

_lock = threading.Lock()
_state: list = []


def load(flags: list = FLAGS):
    """The kernel built with ``flags`` (a variant's ``-D`` settings, for a benchmark), or
    ``None`` where it cannot be built."""
    lib = native.build(SOURCE, flags, "attention")
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.fx_attend.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr,
                                  i64, i64, ptr, i64, i64, ctypes.c_float, ptr, ptr, i64,
                                  ctypes.c_int]
        lib.fx_attend_run.argtypes = [ptr]
    return lib


def library():
    """The compiled kernel, or ``None`` where it cannot be built (no C compiler)."""
    if not _state:
        with _lock:
            if not _state:
                _state.append(load())
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


RATE_KEY = "host attention v2"      # a new version whenever the kernel or the probe changes


def rate() -> float:
    """Bytes/s of cache the kernel reads at a decode step, on this machine: measured once
    (a second) over four layers of bf16 cache of Llama-3-8B's heads, 32k tokens each (512
    MiB in all, more than a last-level cache: one layer of 128 MiB, read again and again,
    stayed in the 300 MiB cache of a 32-core host and read faster than a model's layers
    do), one token of 32 query heads; cached beside the device rates.  What ``"auto"`` weighs against the link: the kernel,
    not the memory, is what the host attention runs at (docs/host_compute.md, "Attention
    over the host KV cache")."""
    from ..selection import device_rates
    key = f"{RATE_KEY} | {device_rates._device_key(torch.device('cpu'), torch.float32)}"
    cached = device_rates._read_cache().get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached)
    lib = library()
    if lib is None:
        return 0.0
    # written, not left empty: untouched pages all read the one zero page, from the cache
    layers = [[torch.full((1, 8, 32768, 128), 0.01, dtype=torch.bfloat16) for _ in range(2)]
              for _ in range(4)]
    q = torch.randn(1, 32, 1, 128)
    out = torch.empty(1, 32, 1, 128)
    seconds = []
    for _ in range(6):
        start = time.perf_counter()
        for keys, values in layers:
            attend(lib, q, keys, values, 32768, None, None, out)
        seconds.append(time.perf_counter() - start)
    measured = sum(t.numel() * t.element_size() for kv in layers for t in kv) / \
        statistics.median(seconds[1:])
    log.warning("fx_offload: measured the host attention kernel's rate for "
                "host_compute='auto': %.1f GB/s of KV cache at a decode step (cached in %s)",
                measured / 1e9, device_rates.cache_path())
    device_rates._write_cache(key, measured)
    return measured


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
    # (the source's PV at most: 8 registers of 16 lanes)
    floats, chunks = scratch_floats(q.shape, kvh, tokens, dv, threads)
    scratch = torch.empty(floats)
    lib.fx_attend(CODES[keys.dtype], keys.data_ptr(), values.data_ptr(), b, kvh, t, d, dv,
                  tokens, q.data_ptr(), rep, nq, None if bias is None else bias.data_ptr(),
                  0 if bias is None else bias.shape[1], 0 if bias is None else bias.shape[-1],
                  float(scale if scale is not None else 1 / math.sqrt(d)), out.data_ptr(),
                  scratch.data_ptr(), chunks, threads)
    return out


class AttendJob(ctypes.Structure):
    """``fx_attend_job`` of the C source: one layer's attention, run by a CUDA stream."""
    _fields_ = [("wt", ctypes.c_int32), ("threads", ctypes.c_int32), ("done", ctypes.c_int32),
                ("hb", ctypes.c_int32), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in
                  ("B", "KVH", "T", "D", "DV", "rep", "NQ", "TB", "n_index", "chunks")),
                ("q", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("index", ctypes.c_void_p),
                ("scale", ctypes.c_float), ("unused", ctypes.c_float),
                ("out", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("record", ctypes.c_void_p)]


def scratch_floats(q_shape, kvh: int, tokens: int, dv: int, threads: int) -> tuple[int, int]:
    """(floats of scratch, chunks it holds) for :func:`attend` over up to ``tokens``."""
    b, h, nq, _ = q_shape
    chunks = chunks_for(b * kvh, tokens, threads)
    return b * kvh * chunks * h // kvh * nq * (-(-dv // 128) * 128 + 2), chunks


def fill_job(job: AttendJob, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             index: torch.Tensor, bias: torch.Tensor | None, scale: float | None,
             out: torch.Tensor, scratch: torch.Tensor, chunks: int, record,
             threads: int) -> None:
    """``job``'s fields for :func:`attend`'s arguments, the valid tokens left to the job
    (from ``index``, int64, and ``bias``); host tensors that stay alive until it has run."""
    (b, h, nq, d), kvh, t, dv = q.shape, keys.shape[1], keys.shape[2], values.shape[-1]
    job.wt, job.threads, job.done = CODES[keys.dtype], threads, 0
    job.hb = 0 if bias is None else bias.shape[1]
    job.k, job.v = keys.data_ptr(), values.data_ptr()
    job.B, job.KVH, job.T, job.D, job.DV, job.rep, job.NQ = b, kvh, t, d, dv, h // kvh, nq
    job.TB = 0 if bias is None else bias.shape[-1]
    job.n_index, job.chunks = index.numel(), chunks
    job.q, job.bias = q.data_ptr(), None if bias is None else bias.data_ptr()
    job.index = index.data_ptr()
    job.scale = float(scale if scale is not None else 1 / math.sqrt(d))
    job.out, job.scratch = out.data_ptr(), scratch.data_ptr()
    job.record = ctypes.addressof(record)
