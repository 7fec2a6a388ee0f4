/* The plan search's dominance scan (pareto.py): rows put in lexicographic order, each kept
 * unless a kept row before it is at most it in every column. numpy runs this as thousands of
 * small-array calls per search; here each pair is left at its first column that separates it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int row_less(const double *keys, int64_t d, int64_t a, int64_t b) {
    const double *x = keys + a * d, *y = keys + b * d;
    for (int64_t c = 0; c < d; c++) {
        if (x[c] != y[c]) return x[c] < y[c];
    }
    return 0;
}

/* Stable merge sort of idx[0..n) by row, through tmp (n entries). */
static void sort_rows(const double *keys, int64_t d, int64_t *idx, int64_t *tmp, int64_t n) {
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = row_less(keys, d, idx[j], idx[i]) ? idx[j++] : idx[i++];
            while (i < mid) tmp[k++] = idx[i++];
            while (j < hi) tmp[k++] = idx[j++];
        }
        memcpy(idx, tmp, (size_t)n * sizeof(int64_t));
    }
}

/* keys: n rows of d doubles (row-major, finite). order: n entries, receives the rows' indices in
 * lexicographic order (stable). kept: room for limit + 1 entries (limit < 0: n), receives the
 * kept rows' indices in that order. Returns how many were kept, stopping at limit + 1 (the caller
 * then knows more than limit rows are non-dominated), or -1 if out of memory. Column 0 is
 * compared last: in lexicographic order it rarely separates an earlier row from a later one. */
int64_t xpu_pareto_scan(const double *keys, int64_t n, int64_t d, int64_t limit, int64_t *order, int64_t *kept) {
    int64_t *tmp = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (!tmp) return -1;
    for (int64_t i = 0; i < n; i++) order[i] = i;
    sort_rows(keys, d, order, tmp, n);
    free(tmp);
    int64_t nk = 0;
    for (int64_t i = 0; i < n; i++) {
        const double *row = keys + order[i] * d;
        int dominated = 0;
        for (int64_t j = nk - 1; j >= 0 && !dominated; j--) {  /* the latest kept rows first */
            const double *k = keys + kept[j] * d;
            int64_t c = 1;
            while (c < d && k[c] <= row[c]) c++;
            dominated = c == d && k[0] <= row[0];
        }
        if (dominated) continue;
        kept[nk++] = order[i];
        if (limit >= 0 && nk > limit) break;
    }
    return nk;
}
