/* Expert reads on native threads (engine/native_reads.py loads this with ctypes).

   A pool of threads takes jobs from one first-in first-out queue. A job reads one byte range of
   a file with preadv into the caller's buffers (its iovecs), after counting with mincore
   whether every page of the range was in the page cache (the load's cold flag), and stamps
   when it started and finished on the clock of Python's time.perf_counter_ns. No Python runs
   on these threads, so a read never waits for the interpreter lock; the caller waits for its
   jobs in rp_wait, which ctypes calls with the lock released. The caller owns every job and
   its iovecs and keeps them alive until the job is done. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_IOV 1024  /* the kernel's IOV_MAX; the caller splits longer reads */

typedef struct job {
    int32_t fd;
    int32_t iovcnt;
    int64_t offset;
    int64_t length;
    const struct iovec *iov;
    const unsigned char *map;   /* the file's untouched PROT_READ mapping, or NULL: cold unknown */
    int64_t state;              /* 0 queued, 1 running, 2 done */
    int64_t result;             /* bytes read, or -errno */
    int64_t cold;               /* 1: a page was not resident before the read; -1 unknown */
    int64_t started_ns, finished_ns;
    const int64_t *drops;       /* ndrops x (fd, offset, length): pages to drop after the read */
    int64_t ndrops;
    struct job *next;
} job_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    job_t *head, *tail;
    int stop, nthreads;
    pthread_t threads[64];
} pool_t;

static int64_t now_ns(void) {
#ifdef __APPLE__
    return (int64_t)clock_gettime_nsec_np(CLOCK_UPTIME_RAW);
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
#endif
}

static int64_t is_cold(const job_t *j) {
    if (!j->map) return -1;
    long page = sysconf(_SC_PAGESIZE);
    int64_t start = j->offset / page * page;
    int64_t end = j->offset + j->length;
    size_t pages = (size_t)((end - start + page - 1) / page);
    unsigned char vec[4096];
    while (pages) {
        size_t n = pages < sizeof vec ? pages : sizeof vec;
        if (mincore((void *)(j->map + start), n * page, (void *)vec) != 0) return -1;
        for (size_t i = 0; i < n; i++) if (!(vec[i] & 1)) return 1;
        pages -= n; start += (int64_t)n * page;
    }
    return 0;
}

static void run(job_t *j) {
    j->started_ns = now_ns();
    j->cold = is_cold(j);
    int64_t done = 0;
    struct iovec local[MAX_IOV];
    int cnt = j->iovcnt;
    if (cnt < 1 || cnt > MAX_IOV) { j->result = -EINVAL; goto out; }
    memcpy(local, j->iov, sizeof(struct iovec) * cnt);
    struct iovec *v = local;
    while (done < j->length) {
        ssize_t n = preadv(j->fd, v, cnt, j->offset + done);
        if (n < 0) { if (errno == EINTR) continue; j->result = -errno; goto out; }
        if (n == 0) break;  /* end of file: a short read, finished or named by the caller */
        done += n;
        while (cnt && (size_t)n >= v->iov_len) { n -= v->iov_len; v++; cnt--; }
        if (cnt && n) { v->iov_base = (char *)v->iov_base + n; v->iov_len -= n; }
    }
    j->result = done;
out:
    j->finished_ns = now_ns();
    /* the page-cache budget's victims (engine.page_cache_budget), after the read and its
       stamp, as a Python reader drops them after its read */
    for (int64_t i = 0; i < j->ndrops; i++) {
        const int64_t *d = j->drops + 3 * i;
#ifdef POSIX_FADV_DONTNEED
        posix_fadvise((int)d[0], (off_t)d[1], (off_t)d[2], POSIX_FADV_DONTNEED);
#else
        (void)d;  /* no per-range page dropping here (macOS): no budget either */
#endif
    }
}

/* Take `j` (after `prev`, NULL at the head) off the queue and run it; called and returning
   with the pool's lock held, which the read itself does not hold. */
static void take_and_run(pool_t *p, job_t *prev, job_t *j) {
    if (prev) prev->next = j->next; else p->head = j->next;
    if (p->tail == j) p->tail = prev;
    j->state = 1;
    pthread_mutex_unlock(&p->lock);
    run(j);
    pthread_mutex_lock(&p->lock);
    j->state = 2;
    pthread_cond_broadcast(&p->done);
}

static void *worker(void *arg) {
    pool_t *p = arg;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->head && !p->stop) pthread_cond_wait(&p->work, &p->lock);
        if (!p->head) break;
        take_and_run(p, NULL, p->head);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

pool_t *rp_create(int n) {
    if (n < 1 || n > 64) return NULL;
    pool_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 0; i < n; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) break;
        p->nthreads++;
    }
    if (p->nthreads == 0) { free(p); return NULL; }
    return p;
}

/* Queue `j`; one idle thread wakes for it. */
void rp_submit(pool_t *p, job_t *j) {
    j->state = 0; j->next = NULL;
    pthread_mutex_lock(&p->lock);
    if (p->tail) p->tail->next = j; else p->head = j;
    p->tail = j;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->lock);
}

/* Run `j` on the calling thread if no pool thread has taken it yet (it is taken off the
   queue): 1 when it ran here, 0 when a pool thread has it or had it. The main thread, about
   to wait for a read no reader has started, reads it itself instead of sleeping through a
   thread's hand-off (engine.readers' help_main), with the interpreter lock released. */
int rp_help(pool_t *p, job_t *j) {
    pthread_mutex_lock(&p->lock);
    job_t *prev = NULL, *at = p->head;
    while (at && at != j) { prev = at; at = at->next; }
    int here = at != NULL;  /* still queued: no pool thread has it */
    if (here) take_and_run(p, prev, j);
    pthread_mutex_unlock(&p->lock);
    return here;
}

/* Wait until every job of `jobs` is done (the queue's jobs are run even after rp_destroy is
   asked, so a caller never waits on a job no thread will take). */
void rp_wait(pool_t *p, job_t **jobs, int n) {
    pthread_mutex_lock(&p->lock);
    for (int i = 0; i < n; i++)
        while (jobs[i]->state != 2) pthread_cond_wait(&p->done, &p->lock);
    pthread_mutex_unlock(&p->lock);
}

/* The CPU time the pool's threads have used so far, ns (their kernel CPU clocks; the
   recorder's reader_cpu_ns), or -1 where it cannot be read (macOS: no thread CPU clocks). */
int64_t rp_cpu_ns(pool_t *p) {
#ifdef __APPLE__
    (void)p;
    return -1;
#else
    int64_t total = 0;
    for (int i = 0; i < p->nthreads; i++) {
        clockid_t clock;
        struct timespec ts;
        if (pthread_getcpuclockid(p->threads[i], &clock) != 0 || clock_gettime(clock, &ts) != 0)
            return -1;
        total += (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    return total;
#endif
}

/* Stop the threads once the queue is empty, join them, free the pool. */
void rp_destroy(pool_t *p) {
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    free(p);
}
