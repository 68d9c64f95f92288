// The one definition of taking a block from a TimelineRing (hcq/timeline_ring.py), the wrapping bump allocator the kernargs of
// fast launches come from. TimelineRing.alloc runs it (through the hot-path extension's `timeline_ring_take`, or,
// without the extension, a small library built from this header on first use) and so do the extension's launches,
// straight on the ring's state; what stays in Python is only the wait for earlier work this may ask for.
//
// `state` is (head, current segment, end of the current segment, lap); `tags` holds the newest tag (the timeline value
// of the submission that will read it) of each of the `ntags` segments of `seg_size` bytes. Callers hold the GIL, so
// one take is whole with respect to every other.
#include <stdint.h>

#define HCQ_TIMELINE_RING_NEVER_FITS (-1)  // a block this size (or alignment, or a ring in this state) cannot be had
#define HCQ_TIMELINE_RING_WAIT (-2)        // first wait for the tag in *need (earlier work reading the segments entered)

// The offset of a block of `size` bytes aligned to `alignment`, to be read by the submission with `tag` (tags must not
// decrease), with the ring's state advanced; or HCQ_TIMELINE_RING_WAIT with nothing changed, when the block enters
// segments used on the previous lap whose newest tag `*need` is past `waited` (the caller waits for it and asks again
// with `waited = *need`); or HCQ_TIMELINE_RING_NEVER_FITS. A block of 0 bytes is taken as 1 byte.
static inline int64_t hcq_timeline_ring_take(int64_t *state, int64_t *tags, int64_t ntags, int64_t ring_size, int64_t seg_size,
                                             int64_t size, int64_t tag, int64_t alignment, int64_t waited, int64_t *need) {
  if (size == 0) size = 1;
  if (size < 0 || size > ring_size || alignment <= 0 || seg_size <= 0) return HCQ_TIMELINE_RING_NEVER_FITS;
  int64_t head = state[0], cur = state[1], lap = state[3], start = head, end;
  int64_t rem = (alignment & (alignment - 1)) == 0 ? head & (alignment - 1) : head % alignment;  // (no division for the usual 16)
  if (head < 0 || head > ring_size || cur < 0 || cur >= ntags) return HCQ_TIMELINE_RING_NEVER_FITS;
  if (rem && __builtin_add_overflow(head, alignment - rem, &start)) start = INT64_MAX;
  if (__builtin_add_overflow(start, size, &end)) end = INT64_MAX;
  if (end <= state[2]) {  // still inside the current segment: nothing to wait for
    tags[cur] = tag;
    state[0] = end;
    return start;
  }
  if (end > ring_size) start = 0, end = size, cur = -1, lap += 1;  // wrap
  int64_t first = start / seg_size, last = (end - 1) / seg_size;
  if (last >= ntags) return HCQ_TIMELINE_RING_NEVER_FITS;
  if (last != cur) {  // entering segments used on the previous lap: their readers must be done first
    int64_t newest = 0;
    for (int64_t s = first != cur ? first : first + 1; s <= last; s++) newest = tags[s] > newest ? tags[s] : newest;
    if (newest > waited) {
      *need = newest;
      return HCQ_TIMELINE_RING_WAIT;
    }
    for (int64_t s = first; s <= last; s++) tags[s] = tag;
    state[1] = last;
    state[2] = (last + 1) * seg_size < ring_size ? (last + 1) * seg_size : ring_size;
    state[3] = lap;
  } else {
    tags[last] = tag;
  }
  state[0] = end;
  return start;
}
