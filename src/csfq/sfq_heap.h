/* The 4-ary min-heap under sfq's compiled core, in plain C so that the compiler sees
 * branch-free comparisons (conditional moves) in the inner loops.
 *
 * An entry is keyed (S, ticket): the flow's meter in sub-units, then the ticket of its head
 * request. Both are non-negative int64 (the core renormalises meters to keep them below
 * 2**62), and tickets are unique, so the order is total and no two keys are equal.
 * pos[slot] is kept equal to the entry's index for every move, so that a flow's entry can be
 * found and re-keyed in place.
 */
#ifndef SFQ_HEAP_H
#define SFQ_HEAP_H

#include <stdint.h>
#include <stddef.h>

typedef struct {
    int64_t S;       /* key 1: the flow's meter, sub-units */
    int64_t ticket;  /* key 2: ticket of the flow's head request (0 in the idle heap) */
    int32_t slot;    /* the flow's slot */
} sfq_entry;

static inline int sfq_less(const sfq_entry *x, const sfq_entry *y) {
    /* (x.S, x.ticket) < (y.S, y.ticket), without branches */
    return (x->S < y->S) | ((x->S == y->S) & (x->ticket < y->ticket));
}

/* index of the smallest of the children c .. min(c+4, n)-1 (c < n) */
static inline ptrdiff_t sfq_min_child(const sfq_entry *a, ptrdiff_t c, ptrdiff_t n) {
    if (c + 3 < n) { /* a full family of four: a two-round tournament */
        ptrdiff_t m1 = sfq_less(&a[c + 1], &a[c]) ? c + 1 : c;
        ptrdiff_t m2 = sfq_less(&a[c + 3], &a[c + 2]) ? c + 3 : c + 2;
        return sfq_less(&a[m2], &a[m1]) ? m2 : m1;
    }
    ptrdiff_t m = c;
    for (ptrdiff_t k = c + 1; k < n; k++)
        m = sfq_less(&a[k], &a[m]) ? k : m;
    return m;
}

/* place e at hole i, moving it towards the root */
static inline void sfq_sift_up(sfq_entry *a, int32_t *pos, ptrdiff_t i, sfq_entry e) {
    while (i > 0) {
        ptrdiff_t p = (i - 1) >> 2;
        if (!sfq_less(&e, &a[p]))
            break;
        a[i] = a[p];
        pos[a[i].slot] = (int32_t)i;
        i = p;
    }
    a[i] = e;
    pos[e.slot] = (int32_t)i;
}

/* place e at hole i, moving it towards the leaves */
static inline void sfq_sift_down(sfq_entry *a, int32_t *pos, ptrdiff_t n, ptrdiff_t i, sfq_entry e) {
    for (;;) {
        ptrdiff_t c = 4 * i + 1;
        if (c >= n)
            break;
        ptrdiff_t m = sfq_min_child(a, c, n);
        if (!sfq_less(&a[m], &e))
            break;
        a[i] = a[m];
        pos[a[i].slot] = (int32_t)i;
        i = m;
    }
    a[i] = e;
    pos[e.slot] = (int32_t)i;
}

/* place e at the root hole when e is likely to belong near the leaves (a flow that was just
 * charged): walk the hole down the path of smallest children to a leaf without comparing
 * against e, then sift e up from there (Floyd's bottom-up variant: one compare per level
 * fewer, and the sift-up is usually zero or one step) */
static inline void sfq_sift_root(sfq_entry *a, int32_t *pos, ptrdiff_t n, sfq_entry e) {
    ptrdiff_t i = 0;
    for (;;) {
        ptrdiff_t c = 4 * i + 1;
        if (c >= n)
            break;
        ptrdiff_t m = sfq_min_child(a, c, n);
        a[i] = a[m];
        pos[a[i].slot] = (int32_t)i;
        i = m;
    }
    sfq_sift_up(a, pos, i, e);
}

/* a hint to start loading a cache line that the next call will need; no effect on results */
static inline void sfq_prefetch(const void *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 1, 3);
#else
    (void)p;
#endif
}

#endif /* SFQ_HEAP_H */
