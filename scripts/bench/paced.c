/*
 * paced: the C reference at a given rate. redis-benchmark is a closed loop, so it runs at its
 * own ceiling, where the server never sleeps; loadgen is an open loop at a set rate, where
 * both sides pay for waking an idle CPU. This sends the same RL.CHECK the same way loadgen
 * does (open loop, due times every 1/rate s, N connections taken in turn, latency from the
 * due time), with nothing but system calls in one thread, and, per connection and tick, one
 * write of every check that fell due (loadgen's connections share writes between checks in
 * flight the same way).
 *
 *   paced PORT RATE SECONDS [CONNS=10] [KEYS=200000] [TICK_US=150] [wake|sleep]
 *
 * TICK_US defaults to 150, about what loadgen's pacer (asking for 50 us) really gets here
 * (loadgen reports it as pacer_tick_us: 142-148 us on 2026-12-05, ~180 before).
 * wake (default): epoll wakes it for each reply and for a timerfd every TICK_US, as
 * loadgen's runtime is woken. sleep: it sleeps to each tick (plus the kernel's timer slack),
 * then reads the replies that came in meanwhile and writes the checks that fell due: one
 * wake-up per tick (replies wait up to a tick, in their latency).
 *
 * Prints one line: checks, checks/s, p50/p99/p99.9 us, CPU us per check (user + system,
 * getrusage). An error reply ends it with status 1. Built by scripts/bench/e2e with the system C compiler.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 64
#define RING 65536          /* due times of checks in flight, per connection */
#define HIST_US 1000000     /* latency histogram: 1 us buckets up to 1 s */

struct conn {
    int fd;
    uint64_t due[RING];     /* ns, in send order */
    uint64_t head, tail;    /* sent = tail, answered = head */
    char out[1 << 16];
    size_t out_len;
    int lines;              /* CRLFs seen of the reply being read (5 per reply) */
    int mid_reply;          /* bytes of the reply being read seen */
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint32_t hist[HIST_US + 1];
static uint64_t answered;

static uint64_t quantile(double q) {
    uint64_t want = (uint64_t)(q * (double)answered), seen = 0;
    for (uint64_t us = 0; us <= HIST_US; us++) {
        seen += hist[us];
        if (seen > want) return us;
    }
    return HIST_US;
}

static int flush_out(struct conn *c) {
    size_t off = 0;
    while (off < c->out_len) {
        ssize_t n = write(c->fd, c->out + off, c->out_len - off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1; /* a full socket buffer means the server stopped reading: give up */
        }
        off += (size_t)n;
    }
    c->out_len = 0;
    return 0;
}

/* Reads what the server sent; every reply is "*4\r\n" and four integers: five CRLFs.
 * -1: the connection is lost; -2: the server answered an error. */
static int read_replies(struct conn *c) {
    char buf[1 << 16];
    for (;;) {
        ssize_t n = read(c->fd, buf, sizeof buf);
        if (n < 0) return errno == EAGAIN ? 0 : -1;
        if (n == 0) return -1;
        uint64_t t = now_ns();
        for (ssize_t i = 0; i < n; i++) {
            if (!c->mid_reply && buf[i] != '*') return -2;
            c->mid_reply = 1;
            if (buf[i] != '\n' || ++c->lines < 5) continue;
            c->lines = 0;
            c->mid_reply = 0;
            if (c->head == c->tail) return -1; /* a reply to nothing sent */
            uint64_t us = (t - c->due[c->head++ % RING]) / 1000;
            hist[us > HIST_US ? HIST_US : us]++;
            answered++;
        }
        if ((size_t)n < sizeof buf) return 0;
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: paced PORT RATE SECONDS [CONNS] [KEYS] [TICK_US] [wake|sleep]\n");
        return 2;
    }
    int port = atoi(argv[1]);
    double rate = atof(argv[2]), seconds = atof(argv[3]);
    int nconns = argc > 4 ? atoi(argv[4]) : 10;
    long keys = argc > 5 ? atol(argv[5]) : 200000;
    long tick_us = argc > 6 ? atol(argv[6]) : 150;
    int sleep_ticks = argc > 7 && strcmp(argv[7], "sleep") == 0;
    if (argc > 8 || (argc > 7 && !sleep_ticks && strcmp(argv[7], "wake") != 0)) {
        fprintf(stderr, "paced: too many arguments, or a mode other than wake or sleep\n");
        return 2;
    }
    if (port <= 0 || rate <= 0 || seconds <= 0 || nconns < 1 || nconns > MAX_CONNS || keys < 1 ||
        tick_us < 1 || tick_us > 999999) {
        fprintf(stderr, "paced: bad arguments\n");
        return 2;
    }
    static struct conn conns[MAX_CONNS];
    int ep = epoll_create1(0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < nconns; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
            perror("paced: connect");
            return 1;
        }
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (fcntl(fd, F_SETFL, O_NONBLOCK) < 0) {
            perror("paced: fcntl");
            return 1;
        }
        conns[i].fd = fd;
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    }
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct itimerspec every = {{0, tick_us * 1000}, {0, tick_us * 1000}};
    if (!sleep_ticks) timerfd_settime(tfd, 0, &every, NULL);
    struct epoll_event tev = {.events = EPOLLIN, .data.u32 = MAX_CONNS};
    if (!sleep_ticks) epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &tev);

    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    uint64_t start = now_ns(), end = start + (uint64_t)(seconds * 1e9), sent = 0;
    uint64_t per_check = (uint64_t)(1e9 / rate);
    unsigned seed = 12345;
    int pacing = 1;
    struct epoll_event evs[MAX_CONNS + 1];
    for (;;) {
        uint64_t t = now_ns();
        if (pacing && t >= end) {
            pacing = 0;
            end = t + 1000000000u; /* a second for the last answers */
        }
        if (!pacing && (answered >= sent || t >= end)) break;
        int n;
        if (sleep_ticks) {
            /* Asleep until the tick, then whatever is ready, then the tick itself. */
            uint64_t into = (now_ns() - start) % (uint64_t)(tick_us * 1000);
            struct timespec nap = {0, (long)((uint64_t)tick_us * 1000 - into)};
            nanosleep(&nap, NULL);
            n = epoll_wait(ep, evs, MAX_CONNS, 0);
            if (n < 0) n = 0;
            evs[n++].data.u32 = MAX_CONNS;
        } else {
            n = epoll_wait(ep, evs, MAX_CONNS + 1, 10);
        }
        for (int e = 0; e < n; e++) {
            uint32_t i = evs[e].data.u32;
            if (i == MAX_CONNS) {
                uint64_t ticks;
                if (!sleep_ticks && read(tfd, &ticks, sizeof ticks) < 0 && errno != EAGAIN) return 1;
                if (!pacing) continue;
                uint64_t due = (now_ns() - start) / per_check;
                for (; sent < due; sent++) {
                    struct conn *c = &conns[sent % (uint64_t)nconns];
                    if (c->tail - c->head >= RING || c->out_len + 128 > sizeof c->out) break;
                    char key[24];
                    int kl = snprintf(key, sizeof key, "k:%ld", (long)(rand_r(&seed) % keys));
                    c->out_len += (size_t)snprintf(c->out + c->out_len, sizeof c->out - c->out_len,
                        "*5\r\n$8\r\nRL.CHECK\r\n$%d\r\n%s\r\n$18\r\n1.6666666666666667\r\n"
                        "$2\r\n20\r\n$1\r\n1\r\n", kl, key);
                    c->due[c->tail++ % RING] = start + sent * per_check;
                }
                for (int k = 0; k < nconns; k++) {
                    if (conns[k].out_len && flush_out(&conns[k]) < 0) {
                        perror("paced: write");
                        return 1;
                    }
                }
            } else {
                int r = read_replies(&conns[i]);
                if (r < 0) {
                    fprintf(stderr, "paced: connection %u: %s\n", i,
                            r == -2 ? "the server answered an error" : "lost");
                    return 1;
                }
            }
        }
    }
    getrusage(RUSAGE_SELF, &r1);
    double cpu_us = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) * 1e6 +
                    (double)(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) +
                    (double)(r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) * 1e6 +
                    (double)(r1.ru_stime.tv_usec - r0.ru_stime.tv_usec);
    printf("%llu %.0f %llu %llu %llu %.2f\n", (unsigned long long)answered,
           (double)answered / seconds, (unsigned long long)quantile(0.5),
           (unsigned long long)quantile(0.99), (unsigned long long)quantile(0.999),
           cpu_us / (double)(answered ? answered : 1));
    return 0;
}
