"""The ``loops`` path: a small C kernel compiled on first use for this CPU (``-march=native``)
and called through ``ctypes``.

One parallel region per matmul, over blocks of output rows of every routed expert at once,
so that a decode step's few small matmuls (8 experts of 3 MiB each) share all the cores
instead of running one after another.  Each row is read once, converted from bf16/fp16 to
fp32 in registers and dotted with every token routed to its expert, accumulating in fp32.

The region is OpenMP, linked to the same ``libgomp`` torch loaded (the loader matches it by
its soname), with ``torch.get_num_threads()`` threads: torch's pool, not a second one.
Where no C compiler is found or the build fails, :func:`library` returns ``None`` and the
kernels fall back to torch's paths (with one warning)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

# the host's monotonic clock (ns) a job notes at its start and end; this kernel's and the
# attention kernel's sources both hold it
NOW_NS = r"""
static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
"""

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* one register of fp32: 16 lanes with AVX-512, else 8 (wider types would live on the stack) */
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef uint16_t vh __attribute__((vector_size(2 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
#define INL static inline __attribute__((always_inline))

/* VL weights from i on, as fp32: bf16 widened by a shift, fp16 converted (F16C) */
INL vf load_w(const int wt, const char* w, int64_t i) {
    vf f;
    if (wt == 0) { vh r; memcpy(&r, w + 2 * i, sizeof r); vu u = __builtin_convertvector(r, vu) << 16;
                   memcpy(&f, &u, sizeof f); }
#if VL == 16
    else if (wt == 1) { __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 2 * i)));
                        memcpy(&f, &c, sizeof f); }
#else
    else if (wt == 1) { __m256 c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 2 * i)));
                        memcpy(&f, &c, sizeof f); }
#endif
    else memcpy(&f, w + 4 * i, sizeof f);
    return f;
}

INL float one_w(const int wt, const char* w, int64_t i) {
    if (wt == 0) { uint32_t u = (uint32_t)((const uint16_t*)w)[i] << 16; float f; memcpy(&f, &u, 4);
                   return f; }
    if (wt == 1) return _cvtsh_ss(((const uint16_t*)w)[i]);
    return ((const float*)w)[i];
}

/* out[r * m + t] = w[r] . X[t] for rows r < nr <= 16 of w (stride n) and m <= 8 rows of X
   (stride ldx).  The columns go in chunks of 24 KiB of X: a chunk of X stays in L1 while every
   row's chunk meets it (one token: whole rows, read straight through), each weight is converted
   once and meets every row of X in registers, and the partial sums wait in a small array
   between chunks.  Rows of X a multiple of 4 KiB apart (a hidden size of 4096) would share
   L1 sets and evict one another, so a chunk of several rows is first copied to a buffer whose
   rows are 64 bytes off that.  PREFETCH (bytes, 0: none) asks for the weights that far ahead
   of the row being read, PFLOC the cache level it asks them into (3: every level). */
#ifndef PREFETCH
#define PREFETCH 0
#endif
#ifndef PFLOC
#define PFLOC 3
#endif
INL void dots_m(const int wt, const int m, const char* w, int64_t nr, int64_t n, const float* X,
                int64_t ldx, float* out) {
    vf part[16][8];
    const int64_t KC = (6144 / m) / VL * VL, ldb = KC + 16;
    float buffer[m > 1 ? m * (6144 / m / VL * VL + 16) : 1] __attribute__((aligned(64)));
    int64_t size = wt == 2 ? 4 : 2, nv = n - n % VL;
    for (int64_t r = 0; r < nr; ++r)
        for (int t = 0; t < m; ++t) part[r][t] = (vf){0};
    for (int64_t c = 0; c < nv; c += KC) {
        int64_t end = c + KC < nv ? c + KC : nv;
        const float* xc = X + c;                 /* X[t] at xc + t * lx, from column c on */
        int64_t lx = ldx;
        if (m > 1) {
            for (int t = 0; t < m; ++t)
                memcpy(buffer + t * ldb, X + t * ldx + c, sizeof(float) * (end - c));
            xc = buffer;
            lx = ldb;
        }
        int64_t r = 0;
        /* two rows at once where their accumulators fit the registers (32 with AVX-512, 16
           without): each chunk of X loaded once for both */
        if (m >= 2 && m <= (VL == 16 ? 8 : 4))
            for (; r + 1 < nr; r += 2) {
                const char *row0 = w + r * n * size, *row1 = row0 + n * size;
                vf acc0[8], acc1[8];
                #pragma GCC unroll 8
                for (int t = 0; t < m; ++t) { acc0[t] = part[r][t]; acc1[t] = part[r + 1][t]; }
                for (int64_t i = c; i < end; i += VL) {
                    if (PREFETCH) { __builtin_prefetch(row0 + i * size + PREFETCH, 0, PFLOC);
                                    __builtin_prefetch(row1 + i * size + PREFETCH, 0, PFLOC); }
                    vf w0 = load_w(wt, row0, i), w1 = load_w(wt, row1, i);
                    #pragma GCC unroll 8
                    for (int t = 0; t < m; ++t) {
                        vf xv; memcpy(&xv, xc + t * lx + (i - c), sizeof xv);
                        acc0[t] += w0 * xv; acc1[t] += w1 * xv;
                    }
                }
                #pragma GCC unroll 8
                for (int t = 0; t < m; ++t) { part[r][t] = acc0[t]; part[r + 1][t] = acc1[t]; }
            }
        for (; r < nr; ++r) {
            const char* row = w + r * n * size;
            vf acc[8];
            #pragma GCC unroll 8
            for (int t = 0; t < m; ++t) acc[t] = part[r][t];
            for (int64_t i = c; i < end; i += VL) {
                if (PREFETCH) __builtin_prefetch(row + i * size + PREFETCH, 0, PFLOC);
                vf wv = load_w(wt, row, i);
                #pragma GCC unroll 8
                for (int t = 0; t < m; ++t) {
                    vf xv; memcpy(&xv, xc + t * lx + (i - c), sizeof xv); acc[t] += wv * xv;
                }
            }
            #pragma GCC unroll 8
            for (int t = 0; t < m; ++t) part[r][t] = acc[t];
        }
    }
    for (int64_t r = 0; r < nr; ++r)
        for (int t = 0; t < m; ++t) {
            float s = 0.f;
            for (int j = 0; j < VL; ++j) s += part[r][t][j];
            for (int64_t j = nv; j < n; ++j) s += one_w(wt, w + r * n * size, j) * X[t * ldx + j];
            out[r * m + t] = s;
        }
}

#define CASE(WT, M) case (WT) * 8 + (M) - 1: dots_m(WT, M, w, nr, n, X + t0 * ldx, ldx, v); break;
#define CASES(WT) CASE(WT, 1) CASE(WT, 2) CASE(WT, 3) CASE(WT, 4) CASE(WT, 5) CASE(WT, 6) \
                  CASE(WT, 7) CASE(WT, 8)

/* out[r * ldo + t] = w[r] . X[t] for nr <= 16 rows of w and any m */
static void dots(int wt, const char* w, int64_t nr, int64_t n, const float* X, int64_t ldx,
                 int64_t m, float* out, int64_t ldo) {
    float v[16 * 8];
    for (int64_t t0 = 0; t0 < m; t0 += 8) {
        int k = m - t0 < 8 ? (int)(m - t0) : 8;
        switch (wt * 8 + k - 1) { CASES(0) CASES(1) CASES(2) }
        for (int64_t r = 0; r < nr; ++r)
            for (int t = 0; t < k; ++t) out[r * ldo + t0 + t] = v[r * k + t];
    }
}

static inline float act(int a, float g) {
    if (a == 0) return g / (1.f + expf(-g));
    if (a == 1) return 0.5f * g * (1.f + erff(g * 0.70710678f));
    if (a == 2) return 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
    return g > 0.f ? g : 0.f;
}

static inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

/* Rows per task, at most 16: the fewest tasks per thread that keep a task within 16 rows,
   and as many tasks for each thread (2048 rows on 16 threads: 8 tasks of 16 rows each).
   The tasks are handed out as threads free up (schedule(dynamic)), not dealt out ahead:
   threads reading memory at once do not progress evenly, and a static share leaves the
   region waiting for the slowest (a fifth to a third slower, docs/host_compute.md). */
static inline int64_t block_for(int64_t rows, int threads) {
    if (rows < 1 || threads < 1) return 1;
    int64_t per = (rows + 16 * threads - 1) / (16 * threads);
    int64_t block = (rows + threads * per - 1) / (threads * per);
    return block < 1 ? 1 : block;
}

/* y (m, n) = x (m, k) . w (n, k)^T + bias, blocks of rows of w over the threads; block <= 16,
   v holds a block's results for every row of x */
void fx_linear(int wt, const void* w, int64_t n, int64_t k, const float* x, int64_t m,
               const float* bias, float* y, int threads) {
    int64_t size = wt == 2 ? 4 : 2, block = block_for(n, threads);
    int64_t blocks = (n + block - 1) / block;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t r0 = b * block, nr = lesser(block, n - r0);
        float v[16 * 64];
        for (int64_t t0 = 0; t0 < m; t0 += 64) {
            int64_t mm = lesser(64, m - t0);
            dots(wt, (const char*)w + r0 * k * size, nr, k, x + t0 * k, k, mm, v, mm);
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t t = 0; t < mm; ++t)
                    y[(t0 + t) * n + r0 + r] = v[r * mm + t] + (bias ? bias[r0 + r] : 0.f);
        }
    }
}

/* Routed experts.  ids (tokens, k) and gates (tokens, k) route x (tokens, hidden); an id outside
   [0, n_experts) routes nowhere.  Expert e's gate rows start at gate + e * stride, its up rows
   at up + e * stride (stride in elements; transformers' fused gate_up: up = gate + inter
   rows, stride = 2 * inter * hidden; a dense MLP is one expert, its gate and up apart).  The (token, slot) pairs are sorted by expert (a counting
   sort), each pair's activations gathered into xp, and each expert served in pieces of at
   most 64 pairs.  Scratch: xp (pairs, hidden), h (pairs, inter), gp (pairs) floats and is
   (3 * n_experts + 3 * pairs + 2) ints.  y (tokens, hidden) is written whole. */
void fx_experts(int wt, const void* gate, const void* up, int64_t stride, const void* down,
                int64_t n_experts, int64_t hidden, int64_t inter, const float* x, int64_t tokens, int64_t k,
                const int64_t* ids, const float* gates, int a, float* xp, float* h, float* gp,
                int64_t* is, float* y, int threads) {
    int64_t pairs = tokens * k, size = wt == 2 ? 4 : 2;
    int64_t *offs = is, *token = is + n_experts + 1, *piece_e = token + pairs;
    int64_t *piece_s = piece_e + pairs + n_experts;
    memset(y, 0, sizeof(float) * tokens * hidden);
    memset(offs, 0, sizeof(int64_t) * (n_experts + 1));
    for (int64_t p = 0; p < pairs; ++p)
        if (ids[p] >= 0 && ids[p] < n_experts) offs[ids[p] + 1]++;
    for (int64_t e = 0; e < n_experts; ++e) offs[e + 1] += offs[e];
    int64_t used = offs[n_experts], pieces = 0;
    for (int64_t e = 0; e < n_experts; ++e)
        for (int64_t q = offs[e]; q < offs[e + 1]; q += 64) { piece_e[pieces] = e; piece_s[pieces++] = q; }
    piece_s[pieces] = used;
    for (int64_t p = 0; p < pairs; ++p) {
        int64_t e = ids[p];
        if (e < 0 || e >= n_experts) continue;
        int64_t q = offs[e]++;                 /* offs[e] ends at the next expert's start */
        token[q] = p / k;
        gp[q] = gates[p];
        memcpy(xp + q * hidden, x + (p / k) * hidden, sizeof(float) * hidden);
    }
    if (!used) return;
    int64_t block = block_for(inter, threads), blocks = (inter + block - 1) / block;
    #pragma omp parallel for num_threads(threads) schedule(dynamic) collapse(2)
    for (int64_t s = 0; s < pieces; ++s)
        for (int64_t b = 0; b < blocks; ++b) {
            const char* wg = (const char*)gate + piece_e[s] * stride * size;
            const char* wu = (const char*)up + piece_e[s] * stride * size;
            int64_t p0 = piece_s[s], m = piece_s[s + 1] - p0, r0 = b * block;
            int64_t nr = lesser(block, inter - r0);
            if (m > 64) m = 64;
            float g[16 * 64], u[16 * 64];
            dots(wt, wg + r0 * hidden * size, nr, hidden, xp + p0 * hidden, hidden, m, g, m);
            dots(wt, wu + r0 * hidden * size, nr, hidden, xp + p0 * hidden, hidden, m, u, m);
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t t = 0; t < m; ++t)
                    h[(p0 + t) * inter + r0 + r] = act(a, g[r * m + t]) * u[r * m + t] * gp[p0 + t];
        }
    block = block_for(hidden, threads);
    blocks = (hidden + block - 1) / block;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t s = 0; s < pieces; ++s) {
            const char* w = (const char*)down + piece_e[s] * hidden * inter * size;
            int64_t p0 = piece_s[s], m = piece_s[s + 1] - p0, r0 = b * block;
            int64_t nr = lesser(block, hidden - r0);
            if (m > 64) m = 64;
            float v[16 * 64];
            dots(wt, w + r0 * inter * size, nr, inter, h + p0 * inter, inter, m, v, m);
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t t = 0; t < m; ++t) y[token[p0 + t] * hidden + r0 + r] += v[r * m + t];
        }
}

/* One layer's routed experts as a job the CUDA stream runs (cuLaunchHostFunc): the call's
   arguments, and what it leaves behind: record[0] the distinct experts it read, record[1]
   and record[2] the monotonic clock (ns) at its start and end; done = 1 once finished, so
   the caller knows the job's arguments may be written again. */
typedef struct {
    int32_t wt, act, threads, done;
    const void *gate, *up, *down;
    int64_t stride, n_experts, hidden, inter, tokens, k;
    const float* x; const int64_t* ids; const float* gates;
    float *xp, *h, *gp; int64_t* is; float* y; int64_t* record;
} fx_experts_job;

""" + NOW_NS + r"""
void fx_experts_run(void* arg) {
    fx_experts_job* j = (fx_experts_job*)arg;
    int64_t began = now_ns();
    unsigned char seen[j->n_experts > 0 ? j->n_experts : 1];
    memset(seen, 0, sizeof seen);
    int64_t distinct = 0;
    for (int64_t p = 0; p < j->tokens * j->k; ++p) {
        int64_t e = j->ids[p];
        if (e >= 0 && e < j->n_experts && !seen[e]) { seen[e] = 1; ++distinct; }
    }
    fx_experts(j->wt, j->gate, j->up, j->stride, j->down, j->n_experts, j->hidden, j->inter, j->x, j->tokens,
               j->k, j->ids, j->gates, j->act, j->xp, j->h, j->gp, j->is, j->y, j->threads);
    j->record[0] = distinct;
    j->record[1] = began;
    j->record[2] = now_ns();
    __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
}
"""
FLAGS = ["-O3", "-march=native", "-ffast-math", "-Wno-psabi", "-fopenmp", "-fPIC", "-shared"]
WEIGHT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}

# Bytes ahead of the row being read that the kernel asks the memory for.  A gate/up row of a
# 2048-wide bf16 expert is one 4 KiB page, and the hardware's prefetcher starts again at every
# page; asking a page ahead keeps each core's reads in flight across it (the distances
# measured: docs/host_compute.md).
PREFETCH = 4096

_lock = threading.Lock()
_state: dict = {}


def library(prefetch: int = PREFETCH):
    """The compiled kernel (a ``ctypes.CDLL``), or ``None`` where it cannot be built;
    ``prefetch`` bytes ahead of the weights being read (0: leave it to the hardware)."""
    if prefetch not in _state:
        with _lock:
            if prefetch not in _state:
                _state[prefetch] = _build([*FLAGS, f"-DPREFETCH={prefetch}"])
    return _state[prefetch]


def build(source: str, flags: list, name: str):
    """``source`` compiled with ``flags`` into a shared library and loaded (``ctypes.CDLL``),
    kept in the temporary folder by a hash of both; ``None`` (with a warning) where no C
    compiler is found or the build fails."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("fx_offload.host_compute: no C compiler found; the %r kernel is not "
                    "built", name)
        return None
    key = hashlib.sha256((source + " ".join(flags) + compiler).encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"fx_offload_host_{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, f"{name}_{key}.so")
    if not os.path.exists(target):
        src = os.path.join(folder, f"{name}_{key}.c")
        with open(src, "w") as f:
            f.write(source)
        partial = f"{target}.{os.getpid()}"
        done = subprocess.run([compiler, *flags, src, "-o", partial, "-lm"],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            log.warning("fx_offload.host_compute: building the %r kernel failed:\n%s", name,
                        done.stderr[-2000:])
            return None
        os.replace(partial, target)            # atomic: another process may build it too
    try:
        return ctypes.CDLL(target)
    except OSError as err:
        log.warning("fx_offload.host_compute: loading the %r kernel failed (%s)", name, err)
        return None


def _build(flags: list):
    lib = build(SOURCE, flags, "kernels")
    if lib is None:
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.fx_linear.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, ptr, i32]
    lib.fx_experts.argtypes = [i32, ptr, ptr, i64, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr,
                               i32, ptr, ptr, ptr, ptr, ptr, i32]
    lib.fx_experts_run.argtypes = [ptr]
    return lib


class ExpertsJob(ctypes.Structure):
    """``fx_experts_job`` of the C source: one layer's routed experts, run by the stream."""
    _fields_ = [("wt", ctypes.c_int32), ("act", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("done", ctypes.c_int32), ("gate", ctypes.c_void_p), ("up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("stride", ctypes.c_int64),
                ("n_experts", ctypes.c_int64),
                ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("tokens", ctypes.c_int64), ("k", ctypes.c_int64),
                *((name, ctypes.c_void_p) for name in
                  ("x", "ids", "gates", "xp", "h", "gp", "is_", "y", "record"))]


class JobRing:
    """Arguments of the jobs a stream runs as host functions, reused in turn: a job's are
    written again only once it has run (its ``done``), after waiting for the stream if not."""

    def __init__(self, make, size: int = 64):
        self.jobs = [make() for _ in range(size)]
        self.queued = [False] * size
        self.next = 0

    def take(self, stream) -> ctypes.Structure:
        i, self.next = self.next, (self.next + 1) % len(self.jobs)
        job = self.jobs[i]
        if self.queued[i] and not job.done:     # a ring behind: wait for it
            stream.synchronize()
        self.queued[i] = True
        return job

    def pending(self) -> bool:
        """A job queued on a stream has not finished."""
        return any(q and not j.done for q, j in zip(self.queued, self.jobs))


# what a job leaves behind: the distinct experts it read, and the monotonic clock (ns) at its
# start and end (``time.monotonic_ns`` reads the same clock)
JobRecord = ctypes.c_int64 * 3


def scratch_sizes(pairs: int, hidden: int, inter: int, experts: int) -> tuple[int, int]:
    """(floats, ints) of scratch ``fx_experts`` needs for ``pairs`` (token, expert) pairs."""
    return pairs * (hidden + inter + 1), 3 * experts + 3 * pairs + 2


def gate_and_up(gate_up) -> tuple[int, int, int]:
    """(gate's address, up's, elements from one expert's to the next) of transformers' fused
    ``gate_up (E, 2I, H)``, or of a dense MLP's ``(gate (I, H), up (I, H))``: one expert."""
    if isinstance(gate_up, tuple):
        gate, up = gate_up
        return gate.data_ptr(), up.data_ptr(), gate.numel()
    inter = gate_up.shape[1] // 2
    return (gate_up.data_ptr(), gate_up.data_ptr() + inter * gate_up.stride(1) *
            gate_up.element_size(), gate_up.stride(0))


def fill_job(job: ExpertsJob, gate_up, down: torch.Tensor, act: str,
             x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, floats: torch.Tensor,
             ints: torch.Tensor, y: torch.Tensor, record: JobRecord,
             threads: int) -> None:
    """``job``'s fields for the experts on ``x`` (fp32), ``ids`` (int64), ``gates`` (fp32)
    into ``y`` (fp32), host tensors that stay alive until the job has run.  ``gate_up``:
    see :func:`gate_and_up`; ``down`` (E, H, I), or (H, I) for a dense MLP."""
    (T, H), k = x.shape, ids.shape[1]
    E, I, pairs = (down.shape[0] if down.dim() == 3 else 1), down.shape[-1], T * k
    base, f = floats.data_ptr(), 4
    job.wt, job.act, job.threads, job.done = WEIGHT_CODES[down.dtype], ACT_CODES[act], \
        threads, 0
    job.gate, job.up, job.stride = gate_and_up(gate_up)
    job.down = down.data_ptr()
    job.n_experts, job.hidden, job.inter, job.tokens, job.k = E, H, I, T, k
    job.x, job.ids, job.gates = x.data_ptr(), ids.data_ptr(), gates.data_ptr()
    job.xp, job.h, job.gp = base, base + f * pairs * H, base + f * pairs * (H + I)
    job.is_, job.y, job.record = ints.data_ptr(), y.data_ptr(), ctypes.addressof(record)


_driver: list = []


def launch_host_function(lib, stream: int, job: ctypes.Structure,
                         function: str = "fx_experts_run") -> None:
    """Enqueue ``function(job)`` of ``lib`` on the CUDA ``stream`` (a ``cudaStream_t`` as an int):
    the stream runs it on a thread of the driver once the work before it is done, and the
    work after it waits for it; the caller does not wait."""
    if not _driver:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        cuda.cuLaunchHostFunc.restype = ctypes.c_int
        _driver.append(cuda)
    fn = ctypes.cast(getattr(lib, function), ctypes.c_void_p)
    status = _driver[0].cuLaunchHostFunc(stream, fn, ctypes.addressof(job))
    if status:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUDA driver error {status}")


def linear(lib, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x (m, k) @ w.T + bias`` in fp32 by the kernel; ``x`` fp32 contiguous."""
    m, (n, k) = x.shape[0], w.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.fx_linear(WEIGHT_CODES[w.dtype], w.data_ptr(), n, k, x.data_ptr(), m,
                      None if bias is None else bias.data_ptr(), y.data_ptr(),
                      torch.get_num_threads())
    return y


def experts(lib, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor,
            gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """The routed experts by the kernel: ``x`` fp32 (T, H), ``ids`` int64 and ``gates`` fp32
    (T, k), all contiguous; the routing is sorted inside the kernel (a few torch calls here
    would cost more than the matmuls at one token)."""
    (T, H), k = x.shape, ids.shape[1]
    E, I, pairs = gate_up.shape[0], down.shape[2], T * ids.shape[1]
    out = torch.empty(T, H, dtype=torch.float32)
    nfloats, nints = scratch_sizes(pairs, H, I, E)
    floats, ints = torch.empty(nfloats), torch.empty(nints, dtype=torch.int64)
    base, f = floats.data_ptr(), 4
    lib.fx_experts(WEIGHT_CODES[gate_up.dtype], *gate_and_up(gate_up), down.data_ptr(), E, H,
                   I, x.data_ptr(), T, k, ids.data_ptr(), gates.data_ptr(), ACT_CODES[act], base,
                   base + f * pairs * H, base + f * pairs * (H + I), ints.data_ptr(),
                   out.data_ptr(), torch.get_num_threads())
    return out
