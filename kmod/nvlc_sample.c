// SPDX-License-Identifier: GPL-2.0
/*
 * The sampler: an hrtimer in hard interrupt context reads every configured link, folds the
 * per-sample deltas into cumulative histograms and into the window of every open file.
 *
 * Everything the timer touches is protected by nvlc_lock (taken with interrupts saved from
 * process context). The timer never allocates, sleeps or copies to user space; configuration
 * is built outside the lock and swapped in whole (nvlc_swap_state).
 */
#include <linux/hrtimer.h>
#include <linux/ktime.h>
#include <linux/math64.h>
#include <linux/minmax.h>
#include <linux/overflow.h>
#include <linux/poll.h>
#include <linux/slab.h>
#include <linux/string.h>

#include "nvlc.h"

DEFINE_SPINLOCK(nvlc_lock);
LIST_HEAD(nvlc_files);
DECLARE_WAIT_QUEUE_HEAD(nvlc_wq);
struct nvlc_state *nvlc_cur;
u64 nvlc_period_ns = NVLC_PERIOD_DEFAULT_NS;
u64 nvlc_stall_threshold = 2000;
u64 nvlc_util_threshold = NVLC_UTIL_ONE * 9 / 10;

static struct hrtimer nvlc_timer;
static u64 nvlc_seq;		/* samples taken */
static u64 nvlc_ticks;		/* periods elapsed, from the overrun counts */
static u64 nvlc_last_ns;	/* time of the latest sample */

/* a * b / c, saturating instead of trapping when the quotient does not fit in 64 bits. */
static u64 nvlc_scale(u64 a, u64 b, u64 c)
{
	u64 p;

	if (!c)
		return U64_MAX;
	if (!check_mul_overflow(a, b, &p))
		return div64_u64(p, c);
#ifdef CONFIG_ARCH_SUPPORTS_INT128
	if ((u64)(((unsigned __int128)a * b) >> 64) >= c)
		return U64_MAX;
	return mul_u64_u64_div_u64(a, b, c);
#else
	return U64_MAX;
#endif
}

/* rate (per second) * t_ns / 1e9, wrapping like a hardware counter after 2^64. */
static u64 nvlc_integrate(u64 rate, u64 t_ns)
{
	u32 rem;
	u64 secs = div_u64_rem(t_ns, NSEC_PER_SEC, &rem);

	return rate * secs + nvlc_scale(rate, rem, NSEC_PER_SEC);
}

u64 nvlc_sim_value(const struct nvlc_sim_link *l, unsigned int counter, u64 t_ns)
{
	u64 v = nvlc_integrate(l->rate[counter], t_ns);

	if (counter <= NVLC_COUNTER_STALL_CYCLES && l->burst_period_ns && l->burst_pct > 100) {
		u64 full = div64_u64(t_ns, l->burst_period_ns);
		u64 rem = t_ns - full * l->burst_period_ns;
		u64 burst_ns = full * l->burst_len_ns + min(rem, l->burst_len_ns);
		/* rate <= NVLC_MAX_SIM_RATE and pct <= NVLC_MAX_BURST_PCT: the product fits. */
		u64 extra = div_u64(l->rate[counter] * (l->burst_pct - 100), 100);

		v += nvlc_integrate(extra, burst_ns);
	}
	return v;
}

static unsigned int nvlc_bucket(u64 v)
{
	return v ? min_t(unsigned int, fls64(v), NVLC_HIST_BUCKETS - 1) : 0;
}

static void nvlc_mark_event_locked(void)
{
	struct nvlc_file *f;

	list_for_each_entry(f, &nvlc_files, node)
		f->event = true;
}

/* One sample of every link; returns whether readers must be woken. */
static bool nvlc_sample_locked(u64 now)
{
	struct nvlc_state *s = nvlc_cur;
	bool wake = false;
	u32 i;

	if (!s)
		return false;
	for (i = 0; i < s->nlinks; i++) {
		struct nvlc_link *l = &s->links[i];
		u64 delta[NVLC_NUM_COUNTERS];
		u64 elapsed, util, stall;
		unsigned int bu, bs, c;
		bool over_s, over_u, crossed;
		struct nvlc_file *f;

		if (l->flags & NVLC_LINK_DEVICE_GONE)
			continue;
		if (s->source == NVLC_SOURCE_SIM) {
			u64 t_ns = now > s->epoch_ns ? now - s->epoch_ns : 0;

			for (c = 0; c < NVLC_NUM_COUNTERS; c++)
				l->cum[c] = nvlc_sim_value(&l->sim, c, t_ns);
		} else if (!nvlc_mmio_read_link(l)) {
			l->flags |= NVLC_LINK_DEVICE_GONE;
			nvlc_mark_event_locked();
			wake = true;
			continue;
		}
		if (!l->primed) {
			memcpy(l->prev, l->cum, sizeof(l->prev));
			l->last_ns = now;
			l->primed = true;
			continue;
		}
		elapsed = now - l->last_ns;
		if (!elapsed)
			continue;
		for (c = 0; c < NVLC_NUM_COUNTERS; c++) {
			delta[c] = l->cum[c] - l->prev[c];
			l->prev[c] = l->cum[c];
		}
		l->last_ns = now;

		util = max(nvlc_scale(delta[NVLC_COUNTER_TX_BYTES], NSEC_PER_SEC, elapsed),
			   nvlc_scale(delta[NVLC_COUNTER_RX_BYTES], NSEC_PER_SEC, elapsed));
		util = nvlc_scale(util, NVLC_UTIL_ONE, l->capacity);
		stall = nvlc_scale(delta[NVLC_COUNTER_STALL_CYCLES], NSEC_PER_USEC, elapsed);
		bu = nvlc_bucket(util);
		bs = nvlc_bucket(stall);
		l->samples++;
		l->util_hist[bu]++;
		l->stall_hist[bs]++;

		over_s = stall > nvlc_stall_threshold;
		over_u = util > nvlc_util_threshold;
		crossed = (over_s && !(l->flags & NVLC_LINK_OVER_STALL)) ||
			  (over_u && !(l->flags & NVLC_LINK_OVER_UTIL));
		l->flags &= ~(NVLC_LINK_OVER_STALL | NVLC_LINK_OVER_UTIL);
		if (over_s)
			l->flags |= NVLC_LINK_OVER_STALL;
		if (over_u)
			l->flags |= NVLC_LINK_OVER_UTIL;

		list_for_each_entry(f, &nvlc_files, node) {
			struct nvlc_win *w = &f->win[i];

			w->samples++;
			for (c = 0; c < NVLC_NUM_COUNTERS; c++)
				w->max_delta[c] = max(w->max_delta[c], delta[c]);
			w->max_util = max(w->max_util, util);
			w->max_stall = max(w->max_stall, stall);
			w->over_stall += over_s;
			w->over_util += over_u;
			w->util_hist[bu]++;
			w->stall_hist[bs]++;
			if (crossed)
				f->event = true;
		}
		wake |= crossed;
	}
	return wake;
}

static enum hrtimer_restart nvlc_tick(struct hrtimer *t)
{
	/* The overrun count makes the accounting exact: ticks - samples periods were missed. */
	u64 n = hrtimer_forward_now(t, ns_to_ktime(READ_ONCE(nvlc_period_ns)));
	bool wake;
	u64 now;

	spin_lock(&nvlc_lock);
	/*
	 * Read the clock under the lock: a source swapped in on another CPU sets its epoch under
	 * the same lock, so every sample of it is taken at or after its epoch.
	 */
	now = ktime_get_ns();
	nvlc_ticks += n;
	nvlc_seq++;
	nvlc_last_ns = now;
	wake = nvlc_sample_locked(now);
	spin_unlock(&nvlc_lock);
	if (wake)
		wake_up_interruptible_poll(&nvlc_wq, EPOLLIN | EPOLLRDNORM | EPOLLPRI);
	return HRTIMER_RESTART;
}

int nvlc_sampler_start(u64 period_ns)
{
	WRITE_ONCE(nvlc_period_ns, period_ns);
	nvlc_last_ns = ktime_get_ns();
	hrtimer_init(&nvlc_timer, CLOCK_MONOTONIC, HRTIMER_MODE_REL_HARD);
	nvlc_timer.function = nvlc_tick;
	hrtimer_start(&nvlc_timer, ns_to_ktime(period_ns), HRTIMER_MODE_REL_HARD);
	return 0;
}

void nvlc_sampler_stop(void)
{
	hrtimer_cancel(&nvlc_timer);
}

void nvlc_file_reset_locked(struct nvlc_file *f)
{
	f->start_seq = nvlc_seq;
	f->start_ticks = nvlc_ticks;
	f->start_ns = nvlc_last_ns;
	f->event = false;
	memset(f->win, 0, sizeof(f->win));
}

/* The snapshot of @f into @buf (zeroed by the caller), and the start of its next window. */
size_t nvlc_build_snapshot_locked(struct nvlc_file *f, u8 *buf)
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
	h->sequence = nvlc_seq;
	h->ticks = nvlc_ticks;
	h->timestamp_ns = nvlc_last_ns;
	h->period_ns = nvlc_period_ns;
	h->window_ns = nvlc_last_ns - f->start_ns;
	h->window_samples = nvlc_seq - f->start_seq;
	h->window_ticks = nvlc_ticks - f->start_ticks;
	h->stall_threshold = nvlc_stall_threshold;
	h->util_threshold = nvlc_util_threshold;
	if (f->event)
		h->flags |= NVLC_HDR_THRESHOLD_EVENT;
	if (h->window_ticks > h->window_samples)
		h->flags |= NVLC_HDR_MISSED_TICKS;

	for (i = 0; i < n; i++, r++) {
		const struct nvlc_link *l = &s->links[i];
		const struct nvlc_win *w = &f->win[i];
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
		r->window_samples = w->samples;
		memcpy(r->window_max_delta, w->max_delta, sizeof(r->window_max_delta));
		r->window_max_util = w->max_util;
		r->window_max_stall = w->max_stall;
		r->window_over_stall = w->over_stall;
		r->window_over_util = w->over_util;
		memcpy(r->window_util_hist, w->util_hist, sizeof(r->window_util_hist));
		memcpy(r->window_stall_hist, w->stall_hist, sizeof(r->window_stall_hist));
		memcpy(r->util_hist, l->util_hist, sizeof(r->util_hist));
		memcpy(r->stall_hist, l->stall_hist, sizeof(r->stall_hist));
	}
	nvlc_file_reset_locked(f);
	return sizeof(*h) + (size_t)n * sizeof(*r);
}

/* Make @next the configured source (NULL: none); returns the old one for the caller to free. */
struct nvlc_state *nvlc_swap_state(struct nvlc_state *next)
{
	struct nvlc_state *old;
	struct nvlc_file *f;
	unsigned long flags;

	spin_lock_irqsave(&nvlc_lock, flags);
	old = nvlc_cur;
	if (next)
		next->epoch_ns = ktime_get_ns();
	nvlc_cur = next;
	/* Windows are per link index: a new link table starts every window afresh. */
	list_for_each_entry(f, &nvlc_files, node)
		nvlc_file_reset_locked(f);
	spin_unlock_irqrestore(&nvlc_lock, flags);
	return old;
}

void nvlc_state_free(struct nvlc_state *s)
{
	if (!s)
		return;
	nvlc_mmio_release(s);
	kvfree(s->links);
	kvfree(s->regs);
	kfree(s->bars);
	kfree(s);
}
