/* How both flavours' kvf_decode_attention split their work: each sequence's S positions fall into chunks of
 * chunk_positions(S) (32, more past 512: at most 16 chunks), a task is one chunk of one sequence with every head,
 * and each (sequence, query head) merges its chunks' partials in ascending order. The chunks follow from S alone,
 * so a row's bits depend neither on the rows beside it nor on which thread took which task. */
#pragma once
#include <stdint.h>

/* Positions per chunk of a sequence of S: always a multiple of 32. */
static inline int64_t chunk_positions(int64_t S) { return S <= 512 ? 32 : (S + 511) / 512 * 32; }

/* The number of tasks of n sequences (sequence i's positions starts[i] .. starts[i + 1]); *longest gets the
 * longest S. */
static inline int64_t chunk_tasks(const int64_t *starts, int64_t n, int64_t *longest) {
    int64_t tasks = 0;
    *longest = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t S = starts[i + 1] - starts[i];
        tasks += (S + chunk_positions(S) - 1) / chunk_positions(S);
        *longest = S > *longest ? S : *longest;
    }
    return tasks;
}

/* Per task t: table[2 t] its sequence, table[2 t + 1] its first position; first[i] sequence i's first task
 * (first[n] = the number of tasks). */
static inline void chunk_table(const int64_t *starts, int64_t n, int64_t *table, int64_t *first) {
    int64_t t = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t S = starts[i + 1] - starts[i], C = chunk_positions(S);
        first[i] = t;
        for (int64_t p = 0; p < S; p += C, t++) table[2 * t] = i, table[2 * t + 1] = p;
    }
    first[n] = t;
}
