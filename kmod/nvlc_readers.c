// SPDX-License-Identifier: GPL-2.0
/*
 * Readers of /dev/nvlink_stats: who may open it, and the window statistics of each open file.
 *
 * Windows. The timer adds every sample to one shared segment (nvlc_seg): its work in hard
 * interrupt context is O(links), however many files are open. Wherever a window must end or
 * begin (a snapshot, an open, a new source) the segment is swapped for an empty one under
 * nvlc_lock, at the same instant as the sampler's marks are taken, and then folded into the
 * window of every open file in process context, under nvlc_readers_mutex, where it can be
 * preempted. A file's window is therefore exactly the samples since its previous snapshot, as
 * if the timer updated every file itself; the cost of many readers is paid by their own
 * system calls, not by the timer.
 *
 * Limits. Every open file costs memory and a share of each fold, so their number is bounded:
 * max_open in all, max_open_per_user for one real uid other than root, and root_reserve of
 * the max_open that only root may take. Whatever other users hold, root (the daemon) can
 * open the device. Real uid, as the kernel's own per-user limits count: a set-user-ID program
 * does not move a user's files onto its owner's account.
 */
#include <linux/cred.h>
#include <linux/ktime.h>
#include <linux/minmax.h>
#include <linux/mm.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/string.h>

#include "nvlc.h"

static DEFINE_MUTEX(nvlc_readers_mutex);
/* Everything below is under nvlc_readers_mutex. */
static LIST_HEAD(nvlc_files);
static unsigned int nvlc_open_total;
static unsigned int nvlc_open_unprivileged;	/* of them, opened by a real uid other than root */
static struct nvlc_win *nvlc_seg_spare;		/* all zero between folds */
static struct nvlc_limits nvlc_limits;

int nvlc_readers_init(const struct nvlc_limits *limits)
{
	struct nvlc_win *a = kvzalloc(NVLC_SEGMENT_BYTES, GFP_KERNEL);
	struct nvlc_win *b = kvzalloc(NVLC_SEGMENT_BYTES, GFP_KERNEL);
	unsigned long flags;

	if (!a || !b) {
		kvfree(a);
		kvfree(b);
		return -ENOMEM;
	}
	nvlc_limits = *limits;
	nvlc_seg_spare = b;
	spin_lock_irqsave(&nvlc_lock, flags);
	nvlc_seg = a;
	spin_unlock_irqrestore(&nvlc_lock, flags);
	return 0;
}

/* After the sampler stopped: no file is open and the timer no longer runs. */
void nvlc_readers_exit(void)
{
	kvfree(nvlc_seg);
	kvfree(nvlc_seg_spare);
	nvlc_seg = NULL;
	nvlc_seg_spare = NULL;
}

static void nvlc_win_fold(struct nvlc_win *dst, const struct nvlc_win *src)
{
	unsigned int i;

	dst->samples += src->samples;
	for (i = 0; i < NVLC_NUM_COUNTERS; i++)
		dst->max_delta[i] = max(dst->max_delta[i], src->max_delta[i]);
	dst->max_util = max(dst->max_util, src->max_util);
	dst->max_stall = max(dst->max_stall, src->max_stall);
	dst->over_stall += src->over_stall;
	dst->over_util += src->over_util;
	for (i = 0; i < NVLC_HIST_BUCKETS; i++) {
		dst->util_hist[i] += src->util_hist[i];
		dst->stall_hist[i] += src->stall_hist[i];
	}
}

/*
 * End the timer's segment now. nvlc_lock held, nvlc_readers_mutex held. Returns the ended
 * segment, for nvlc_fold_segment() once the lock is dropped.
 */
static struct nvlc_win *nvlc_end_segment_locked(struct nvlc_marks *m)
{
	struct nvlc_win *done = nvlc_seg;

	nvlc_seg = nvlc_seg_spare;
	nvlc_marks_locked(m);
	return done;
}

/*
 * Add the ended segment's @nlinks links to every open file's window and make it the empty
 * spare again. nvlc_readers_mutex held. A link without samples in the segment holds zeros
 * only (the timer counts a sample wherever it updates a window), so it is skipped.
 */
static void nvlc_fold_segment(struct nvlc_win *done, u32 nlinks)
{
	struct nvlc_file *f;
	u32 i;

	for (i = 0; i < nlinks; i++) {
		if (!done[i].samples)
			continue;
		list_for_each_entry(f, &nvlc_files, node)
			nvlc_win_fold(&f->win[i], &done[i]);
		cond_resched();
	}
	memset(done, 0, nlinks * sizeof(*done));
	nvlc_seg_spare = done;
}

/* Start @f's window at @m with @nlinks links to clear. nvlc_readers_mutex held. */
static void nvlc_file_start(struct nvlc_file *f, const struct nvlc_marks *m, u32 nlinks)
{
	f->start_seq = m->seq;
	f->start_ticks = m->ticks;
	f->start_ns = m->ns;
	WRITE_ONCE(f->event_seen, m->event_seq);
	memset(f->win, 0, nlinks * sizeof(f->win[0]));
}

static unsigned int nvlc_open_by(kuid_t uid)
{
	const struct nvlc_file *f;
	unsigned int n = 0;

	list_for_each_entry(f, &nvlc_files, node)
		n += uid_eq(f->uid, uid);
	return n;
}

/*
 * Count @f as open, or refuse: EBUSY when every file that @f's user may take is held (all of
 * them for root; all but the root reserve for anyone else), EMFILE when its user already
 * holds its own limit. @f's window starts now (its win[] is zero from allocation).
 */
int nvlc_reader_attach(struct nvlc_file *f)
{
	kuid_t uid = current_uid();
	bool root = uid_eq(uid, GLOBAL_ROOT_UID);
	struct nvlc_win *done;
	struct nvlc_marks m;
	unsigned long flags;
	u32 nlinks;
	int ret;

	ret = mutex_lock_killable(&nvlc_readers_mutex);
	if (ret)
		return ret;
	if (nvlc_open_total >= nvlc_limits.max_open)
		ret = -EBUSY;
	else if (!root && nvlc_open_unprivileged >=
		 nvlc_limits.max_open - nvlc_limits.root_reserve)
		ret = -EBUSY;
	else if (!root && nvlc_open_by(uid) >= nvlc_limits.max_open_per_user)
		ret = -EMFILE;
	if (ret)
		goto out;

	/* The samples so far belong to the files already open, not to this one. */
	spin_lock_irqsave(&nvlc_lock, flags);
	done = nvlc_end_segment_locked(&m);
	nlinks = nvlc_cur ? nvlc_cur->nlinks : 0;
	spin_unlock_irqrestore(&nvlc_lock, flags);
	nvlc_fold_segment(done, nlinks);

	f->uid = uid;
	nvlc_file_start(f, &m, 0);
	list_add_tail(&f->node, &nvlc_files);
	nvlc_open_total++;
	if (!root)
		nvlc_open_unprivileged++;
out:
	mutex_unlock(&nvlc_readers_mutex);
	return ret;
}

void nvlc_reader_detach(struct nvlc_file *f)
{
	mutex_lock(&nvlc_readers_mutex);
	list_del(&f->node);
	nvlc_open_total--;
	if (!uid_eq(f->uid, GLOBAL_ROOT_UID))
		nvlc_open_unprivileged--;
	mutex_unlock(&nvlc_readers_mutex);
}

unsigned int nvlc_open_files(void)
{
	unsigned int n;

	mutex_lock(&nvlc_readers_mutex);
	n = nvlc_open_total;
	mutex_unlock(&nvlc_readers_mutex);
	return n;
}

/* Whether a link crossed a threshold or a device went away since @f's window began. */
bool nvlc_reader_event(const struct nvlc_file *f)
{
	return READ_ONCE(nvlc_event_seq) != READ_ONCE(f->event_seen);
}

/*
 * What every reader sees at this instant: the header's sampler figures and each link's
 * cumulative figures into @buf (zeroed by the caller). nvlc_lock held. Returns the records.
 */
static u32 nvlc_fill_cumulative_locked(u8 *buf)
{
	struct nvlc_header *h = (struct nvlc_header *)buf;
	struct nvlc_record *r = (struct nvlc_record *)(buf + sizeof(*h));
	struct nvlc_state *s = nvlc_cur;
	u32 n = s ? s->nlinks : 0;
	u32 i;

	h->magic = NVLC_MAGIC;
	h->abi_version = NVLC_ABI_VERSION;
	h->header_size = sizeof(*h);
	h->record_size = sizeof(*r);
	h->record_count = n;
	h->source = s ? s->source : NVLC_SOURCE_NONE;
	h->period_ns = nvlc_period_ns;
	h->stall_threshold = nvlc_stall_threshold;
	h->util_threshold = nvlc_util_threshold;

	for (i = 0; i < n; i++, r++) {
		const struct nvlc_link *l = &s->links[i];
		unsigned int c;

		r->device = l->device;
		r->link = l->link;
		r->flags = l->flags;
		for (c = 0; c < NVLC_NUM_COUNTERS; c++)
			if (s->source == NVLC_SOURCE_SIM || l->regs[c])
				r->flags |= 1U << (NVLC_LINK_COUNTER_SHIFT + c);
		if (l->flags & NVLC_LINK_DEVICE_GONE)
			h->flags |= NVLC_HDR_DEVICE_GONE;
		r->capacity_bps = l->capacity;
		memcpy(r->counters, l->cum, sizeof(r->counters));
		r->samples = l->samples;
		memcpy(r->util_hist, l->util_hist, sizeof(r->util_hist));
		memcpy(r->stall_hist, l->stall_hist, sizeof(r->stall_hist));
	}
	return n;
}

/* @f's window, ended at @m, into the header and the @n records of @buf. */
static void nvlc_fill_window(const struct nvlc_file *f, const struct nvlc_marks *m, u8 *buf,
			     u32 n)
{
	struct nvlc_header *h = (struct nvlc_header *)buf;
	struct nvlc_record *r = (struct nvlc_record *)(buf + sizeof(*h));
	u32 i;

	h->sequence = m->seq;
	h->ticks = m->ticks;
	h->timestamp_ns = m->ns;
	h->window_ns = m->ns - f->start_ns;
	h->window_samples = m->seq - f->start_seq;
	h->window_ticks = m->ticks - f->start_ticks;
	if (m->event_seq != f->event_seen)
		h->flags |= NVLC_HDR_THRESHOLD_EVENT;
	if (h->window_ticks > h->window_samples)
		h->flags |= NVLC_HDR_MISSED_TICKS;

	for (i = 0; i < n; i++, r++) {
		const struct nvlc_win *w = &f->win[i];

		r->window_samples = w->samples;
		memcpy(r->window_max_delta, w->max_delta, sizeof(r->window_max_delta));
		r->window_max_util = w->max_util;
		r->window_max_stall = w->max_stall;
		r->window_over_stall = w->over_stall;
		r->window_over_util = w->over_util;
		memcpy(r->window_util_hist, w->util_hist, sizeof(r->window_util_hist));
		memcpy(r->window_stall_hist, w->stall_hist, sizeof(r->window_stall_hist));
	}
}

/* The snapshot of @f into @buf (zeroed by the caller), and the start of its next window. */
int nvlc_snapshot(struct nvlc_file *f, u8 *buf, size_t *len)
{
	struct nvlc_win *done;
	struct nvlc_marks m;
	unsigned long flags;
	u32 n;
	int ret;

	ret = mutex_lock_killable(&nvlc_readers_mutex);
	if (ret)
		return ret;
	spin_lock_irqsave(&nvlc_lock, flags);
	n = nvlc_fill_cumulative_locked(buf);
	done = nvlc_end_segment_locked(&m);
	spin_unlock_irqrestore(&nvlc_lock, flags);
	nvlc_fold_segment(done, n);
	nvlc_fill_window(f, &m, buf, n);
	nvlc_file_start(f, &m, n);
	mutex_unlock(&nvlc_readers_mutex);
	*len = sizeof(struct nvlc_header) + (size_t)n * sizeof(struct nvlc_record);
	return 0;
}

/* Make @next the configured source (NULL: none); returns the old one for the caller to free. */
struct nvlc_state *nvlc_swap_state(struct nvlc_state *next)
{
	struct nvlc_state *old;
	struct nvlc_win *done;
	struct nvlc_file *f;
	struct nvlc_marks m;
	unsigned long flags;

	mutex_lock(&nvlc_readers_mutex);
	spin_lock_irqsave(&nvlc_lock, flags);
	old = nvlc_cur;
	if (next)
		next->epoch_ns = ktime_get_ns();
	nvlc_cur = next;
	done = nvlc_end_segment_locked(&m);
	spin_unlock_irqrestore(&nvlc_lock, flags);
	/* Windows are per link index: a new link table starts every window afresh. */
	memset(done, 0, NVLC_SEGMENT_BYTES);
	nvlc_seg_spare = done;
	list_for_each_entry(f, &nvlc_files, node)
		nvlc_file_start(f, &m, NVLC_MAX_LINKS);
	mutex_unlock(&nvlc_readers_mutex);
	return old;
}
