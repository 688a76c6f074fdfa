// SPDX-License-Identifier: GPL-2.0
/*
 * The sampler: an hrtimer in hard interrupt context reads every configured link and folds the
 * per-sample deltas into cumulative histograms and into one shared segment of window
 * statistics (nvlc_seg). Its work is O(links) whatever the number of open files: the segment
 * reaches each file's window in process context (nvlc_readers.c).
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
DECLARE_WAIT_QUEUE_HEAD(nvlc_wq);
struct nvlc_state *nvlc_cur;
struct nvlc_win *nvlc_seg;	/* NVLC_MAX_LINKS entries, owned by nvlc_readers.c */
/* Bumped when a link crosses a threshold upwards or a device goes away; poll compares it. */
unsigned long nvlc_event_seq;
u64 nvlc_period_ns = NVLC_PERIOD_DEFAULT_NS;
u64 nvlc_stall_threshold = 2000;
u64 nvlc_util_threshold = NVLC_UTIL_ONE * 9 / 10;

static struct hrtimer nvlc_timer;
static u64 nvlc_seq;		/* samples taken */
static u64 nvlc_ticks;		/* periods elapsed, from the overrun counts */
static u64 nvlc_last_ns;	/* time of the latest sample */
static u64 nvlc_busy_ns;	/* time spent in the timer's sampling, for its cost per sample */

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
		struct nvlc_win *w = &nvlc_seg[i];

		if (l->flags & NVLC_LINK_DEVICE_GONE)
			continue;
		if (s->source == NVLC_SOURCE_SIM) {
			u64 t_ns = now > s->epoch_ns ? now - s->epoch_ns : 0;

			for (c = 0; c < NVLC_NUM_COUNTERS; c++)
				l->cum[c] = nvlc_sim_value(&l->sim, c, t_ns);
		} else if (!nvlc_mmio_read_link(l)) {
			l->flags |= NVLC_LINK_DEVICE_GONE;
			WRITE_ONCE(nvlc_event_seq, nvlc_event_seq + 1);
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

		w->samples++;
		for (c = 0; c < NVLC_NUM_COUNTERS; c++)
			w->max_delta[c] = max(w->max_delta[c], delta[c]);
		w->max_util = max(w->max_util, util);
		w->max_stall = max(w->max_stall, stall);
		w->over_stall += over_s;
		w->over_util += over_u;
		w->util_hist[bu]++;
		w->stall_hist[bs]++;
		if (crossed) {
			WRITE_ONCE(nvlc_event_seq, nvlc_event_seq + 1);
			wake = true;
		}
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
	nvlc_busy_ns += ktime_get_ns() - now;
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

/* Where the sampler stands now. nvlc_lock held. */
void nvlc_marks_locked(struct nvlc_marks *m)
{
	m->seq = nvlc_seq;
	m->ticks = nvlc_ticks;
	m->ns = nvlc_last_ns;
	m->event_seq = nvlc_event_seq;
}

/* Samples taken since load and the time the timer spent taking them. */
void nvlc_sampler_stats(u64 *samples, u64 *busy_ns)
{
	unsigned long flags;

	spin_lock_irqsave(&nvlc_lock, flags);
	*samples = nvlc_seq;
	*busy_ns = nvlc_busy_ns;
	spin_unlock_irqrestore(&nvlc_lock, flags);
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
