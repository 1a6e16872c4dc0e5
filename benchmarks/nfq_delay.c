/* Delays packets by MEAN +- JITTER milliseconds (uniform), as netem's "delay MEAN JITTER" would; this
 * kernel has no netem. Packets sent to NFQUEUE number QUEUE (iptables ... -j NFQUEUE --queue-num QUEUE
 * --queue-bypass) are held and accepted when due; with jitter they may leave out of order, as with
 * netem. Run it in the network namespace whose packets it delays. Used by benchmarks/bench_cluster.py,
 * which compiles it: cc -O2 -o nfq_delay nfq_delay.c -lnetfilter_queue -lnfnetlink
 *
 * Usage: nfq_delay QUEUE MEAN_MS JITTER_MS
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

struct held {
    uint32_t id;
    double due;
};

static struct held *heap;
static size_t count, capacity;
static double mean_s, jitter_s;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void push(uint32_t id, double due) {
    if (count == capacity) {
        capacity = capacity ? 2 * capacity : 1024;
        heap = realloc(heap, capacity * sizeof *heap);
        if (!heap) {
            perror("nfq_delay: realloc");
            exit(1);
        }
    }
    size_t i = count++;
    while (i > 0 && heap[(i - 1) / 2].due > due) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i].id = id;
    heap[i].due = due;
}

static struct held pop(void) {
    struct held top = heap[0], last = heap[--count];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= count) break;
        if (c + 1 < count && heap[c + 1].due < heap[c].due) c++;
        if (heap[c].due >= last.due) break;
        heap[i] = heap[c];
        i = c;
    }
    if (count) heap[i] = last;
    return top;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *data, void *arg) {
    (void)qh;
    (void)msg;
    (void)arg;
    struct nfqnl_msg_packet_hdr *hdr = nfq_get_msg_packet_hdr(data);
    if (!hdr) return 0;
    double delay = mean_s + jitter_s * (2.0 * drand48() - 1.0);
    push(ntohl(hdr->packet_id), now() + (delay > 0 ? delay : 0));
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s QUEUE MEAN_MS JITTER_MS\n", argv[0]);
        return 2;
    }
    int queue = atoi(argv[1]);
    mean_s = atof(argv[2]) / 1000.0;
    jitter_s = atof(argv[3]) / 1000.0;
    srand48((long)now());
    struct nfq_handle *h = nfq_open();
    if (!h) {
        perror("nfq_delay: nfq_open");
        return 1;
    }
    struct nfq_q_handle *qh = nfq_create_queue(h, (uint16_t)queue, &on_packet, NULL);
    if (!qh) {
        perror("nfq_delay: nfq_create_queue");
        return 1;
    }
    nfq_set_mode(qh, NFQNL_COPY_META, 0);
    nfq_set_queue_maxlen(qh, 1 << 16);
    nfnl_rcvbufsiz(nfq_nfnlh(h), 1 << 24);
    int fd = nfq_fd(h);
    char buf[1 << 16];
    for (;;) {
        double wait = count ? heap[0].due - now() : 1.0;
        struct timespec ts = {0, 0};
        if (wait > 0) {
            ts.tv_sec = (time_t)wait;
            ts.tv_nsec = (long)((wait - (double)ts.tv_sec) * 1e9);
        }
        struct pollfd p = {fd, POLLIN, 0};
        if (ppoll(&p, 1, &ts, NULL) < 0 && errno != EINTR) {
            perror("nfq_delay: ppoll");
            return 1;
        }
        if (p.revents & POLLIN) {
            ssize_t n;
            while ((n = recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0) nfq_handle_packet(h, buf, (int)n);
        }
        double t = now();
        while (count && heap[0].due <= t) nfq_set_verdict(qh, pop().id, NF_ACCEPT, 0, NULL);
    }
}
